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
