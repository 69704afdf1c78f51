"""Errors between the router and its workers, and how they reach the client."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web

if TYPE_CHECKING:
    from bana_sglang.router.workers import Worker

JSON = "application/json"


class UpstreamError(Exception):
    """A worker failed: connection refused/reset, or a 5xx answer."""

    def __init__(self, worker: Worker, reason: str, status: int | None = None, body: bytes = b""):
        super().__init__(f"{worker.tier.value} worker {worker.url}: {reason}")
        self.worker, self.reason, self.status, self.body = worker, reason, status, body


class ClientError(Exception):
    """A worker answered 4xx: pass it through to the client."""

    def __init__(self, status: int, body: bytes, content_type: str | None):
        super().__init__(f"worker answered {status}")
        self.status, self.body, self.content_type = status, body, content_type


def streamed_failure(data: bytes) -> tuple[int, str] | None:
    """The failure a streamed answer read whole ended with (the prefill half of a
    streamed PD request): (status, message) of its abort or error event, or None.

    SGLang answers a streamed request that it aborts (a failed store load, a timeout)
    with 200 and an event saying so: ``/generate`` a finish reason of type ``abort``
    (its ``status_code``, when it has one), the OpenAI routes an ``error`` event or a
    choice finished with ``abort``. Its KV never reaches the decode worker."""
    if b'"abort"' not in data and b'"error"' not in data:
        return None
    for line in data.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            ev = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        if not isinstance(ev, dict):
            continue
        err = ev.get("error")
        if isinstance(err, dict):
            return _status(err.get("code")), str(err.get("message") or "error")
        meta = ev.get("meta_info")
        fr = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(fr, dict) and fr.get("type") == "abort":
            return _status(fr.get("status_code")), str(fr.get("message") or "aborted")
        choices = ev.get("choices")
        if isinstance(choices, list) and any(
            isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices
        ):
            return 503, "aborted"
    return None


def _status(code: object) -> int:
    return code if type(code) is int and 400 <= code < 600 else 503


def error_body(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
) -> bytes:
    """OpenAI's error format."""
    type_ = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code or status}}
    )


def error_response(status: int, message: str, *, headers: dict | None = None, **kw) -> web.Response:
    return web.Response(
        status=status, body=error_body(status, message, **kw), content_type=JSON, headers=headers
    )


def sse_error(message: str, status: int = 502) -> bytes:
    """The last events of a stream that broke after its first byte."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
