"""``n > 1``: OpenAI's choices as ``n`` one-choice PD requests.

SGLang's PD workers serve one choice per request (a prefill's KV goes to one
decode request), so the router fans a request with ``n > 1`` out to ``n``
requests, each with its own bootstrap room (with a ``seed``, choice i samples
with ``seed + i``), and gathers them: into one answer with choices 0..n-1, or,
streamed, into one stream whose events carry their choice's number, with one
summed usage event and one ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from bana_sglang.router.errors import error_body, error_response
from bana_sglang.router.front import stream_out
from bana_sglang.router.policy import RouteRequest
from bana_sglang.router.splice import event_json
from bana_sglang.router.upstream import BROKEN, Upstream

logger = logging.getLogger("bana_sglang.router.server")  # one logger for the router's lines
_JSON = "application/json"


class ChoicesMixin:
    """The router supplies ``_pd_once_json``, ``_open_stream``, ``_fail``, ``_count`` and
    ``metrics`` (see :class:`~.server.Router`)."""

    @staticmethod
    def _choice_body(body: dict, i: int) -> dict:
        """Choice ``i`` of an ``n > 1`` request: one choice, and with a ``seed``, seed + i."""
        b = dict(body, n=1)
        seed = body.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            b["seed"] = seed + i
        return b

    async def _fan_out(
        self, path: str, body: dict, route: RouteRequest, label: str, t0: float, n: int
    ) -> web.Response:
        """``n`` choices as OpenAI gives them: ``n`` PD requests of one choice each (each
        with its own bootstrap room; with a ``seed``, choice i samples with seed + i), their
        choices numbered 0..n-1 in one answer, usage summed over the completions."""
        results = await asyncio.gather(
            *(
                self._pd_once_json(path, self._choice_body(body, i), route, merge_logprobs=False)
                for i in range(n)
            )
        )
        bad = next(((st, data) for st, data in results if st != 200), None)
        if bad is not None:
            self._count(label, bad[0], t0)
            return web.Response(status=bad[0], body=bad[1], content_type=_JSON)
        answers = [orjson.loads(data) for _, data in results]
        merged = dict(answers[0])
        merged["choices"] = [
            dict(c, index=i) for i, a in enumerate(answers) for c in (a.get("choices") or [])[:1]
        ]
        usage = [a.get("usage") or {} for a in answers]
        if all(usage):
            completion = sum(int(u.get("completion_tokens") or 0) for u in usage)
            prompt_tokens = int(usage[0].get("prompt_tokens") or 0)
            merged["usage"] = dict(
                usage[0],
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
            )
        self._count(label, 200, t0)
        return web.Response(body=orjson.dumps(merged), content_type=_JSON)

    async def _fan_out_stream(
        self,
        request: web.Request,
        path: str,
        body: dict,
        route: RouteRequest,
        label: str,
        t0: float,
        n: int,
    ) -> web.StreamResponse:
        """``n`` streamed choices as OpenAI streams them: ``n`` streamed PD requests of one
        choice each (as :meth:`_fan_out`), their events interleaved as they come in one
        stream, each choice's ``index`` its number, one usage event (summed) and one
        ``[DONE]`` at the end. A choice whose decode worker fails mid-stream ends with an
        error event naming it; the others go on."""
        opened = await asyncio.gather(
            *(self._open_stream(path, self._choice_body(body, i), route) for i in range(n))
        )
        ups = [u for u in opened if isinstance(u, Upstream)]
        bad = next((u for u in opened if not isinstance(u, Upstream)), None)
        if bad is not None:  # nothing was sent to the client yet: answer as one request
            for u in ups:
                u.finish()
            if isinstance(bad, web.Response):
                self._count(label, bad.status, t0)
                return bad
            self._count(label, 502, t0)
            return error_response(502, f"no worker pair could serve the request: {bad}")
        out = stream_out(
            request,
            {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        events: asyncio.Queue = asyncio.Queue()
        usage: list[dict] = []

        async def pump(i: int, up: Upstream) -> None:
            buf, chunk = b"", up.first
            try:
                while chunk:
                    buf += chunk
                    *whole, buf = buf.split(b"\n\n")
                    for ev in whole:
                        fwd = _choice_event(ev, i, usage)
                        if fwd is not None:
                            await events.put(fwd)
                    chunk = await up.resp.readany()
            except BROKEN as e:
                why = f"choice {i}: decode worker {up.d.url} failed mid-stream: {type(e).__name__}"
                logger.warning("%s", why)
                self.metrics.stream_errors.inc()
                if not isinstance(e, asyncio.TimeoutError):
                    self._fail(up.d, why)
                await events.put(b"data: " + error_body(502, why))
            finally:
                up.finish()

        tasks = [asyncio.create_task(pump(i, u)) for i, u in enumerate(ups)]
        done = asyncio.gather(*tasks)
        try:
            await out.prepare(request)
            self.metrics.first_byte(label, time.perf_counter() - t0)
            while not (done.done() and events.empty()):
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                await out.write(get.result() + b"\n\n")
            if usage:
                await out.write(b"data: " + orjson.dumps(_summed_usage(usage)) + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("client went away; aborting its %d choices", n)
            for u in ups:
                u.p_task.cancel()
            raise
        finally:
            for t in tasks:
                t.cancel()
            for u in ups:
                u.finish()
        self._count(label, 200, t0)
        return out


def _choice_event(ev: bytes, i: int, usage: list[dict]) -> bytes | None:
    """One event of choice ``i``'s stream as the client of an ``n > 1`` stream reads it:
    its choices numbered ``i``; a usage-only event kept back (summed at the end); its
    ``[DONE]`` dropped (one comes at the end)."""
    ev = ev.strip()
    if not ev or ev.startswith(b"data: [DONE]"):
        return None
    obj = event_json(ev)
    if obj is None:
        return ev
    choices = obj.get("choices")
    if isinstance(obj.get("usage"), dict):
        usage.append(dict(obj, choices=[]))
        del obj["usage"]
        if not choices:
            return None
    if isinstance(choices, list):
        for c in choices:
            if isinstance(c, dict):
                c["index"] = i
    return b"data: " + orjson.dumps(obj)


def _summed_usage(events: list[dict]) -> dict:
    """The usage event of an ``n > 1`` stream: the first choice's, with the prompt
    counted once and the completions summed (as OpenAI counts ``n`` choices)."""
    usage = [e["usage"] for e in events]
    completion = sum(int(u.get("completion_tokens") or 0) for u in usage)
    prompt_tokens = int(usage[0].get("prompt_tokens") or 0)
    return dict(
        events[0],
        usage=dict(usage[0], completion_tokens=completion, total_tokens=prompt_tokens + completion),
    )
