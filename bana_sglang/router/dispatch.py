"""The router's PD dispatch: pick a pair, send to both, relay, retry, blame.

For each request the policy picks a prefill and a decode worker; the same body
goes to both with SGLang's bootstrap fields (the prefill worker's
``bootstrap_host``/``bootstrap_port`` and a random 63-bit ``bootstrap_room``).
Until the first byte reaches the client nothing is committed: a worker that
refuses the connection or answers 5xx is marked down and the request is
retried on another pair; a decode worker that reports missing KV blames its
prefill peer (:meth:`PDDispatchMixin._blame`). Streams are relayed chunk by
chunk (:meth:`PDDispatchMixin._pd_stream`), continued across a request
migration by :class:`~.continuation.ContinuationMixin`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from bana_sglang.router.errors import (
    ClientError,
    UpstreamError,
    error_body,
    error_response,
    sse_error,
)
from bana_sglang.router.front import stream_out
from bana_sglang.router.generate import fix_logprob_window, merge_input_logprobs
from bana_sglang.router.http1 import Response
from bana_sglang.router.pairs import PairsMixin
from bana_sglang.router.policy import RouteRequest
from bana_sglang.router.splice import Splicer, mark, unmigratable_reason
from bana_sglang.router.upstream import (
    BROKEN,
    KV_BLOCKS_LOST,
    KV_TRANSFER_FAILURE,
    HandshakeTimeout,
    Opening,
    Upstream,
    first_done,
    prefill_stream_failure,
    relay,
    store_load_failed,
)
from bana_sglang.router.workers import Worker
from bana_sglang.types import Tier
from bana_sglang.wire.agent import PREFIX as MIGRATABLE

logger = logging.getLogger("bana_sglang.router.server")  # one logger for the router's lines

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST
_JSON = "application/json"


class PDDispatchMixin(PairsMixin):
    """The router supplies its workers, policy, config, metrics and session (see
    :class:`~.server.Router`)."""

    def _start_pair(
        self, p: Worker, d: Worker, path: str, body: dict, route: RouteRequest
    ) -> tuple[bytes, int, asyncio.Task]:
        """Count the pair, add the bootstrap fields and send the prefill half;
        returns (body sent, as JSON bytes for the decode half too: one serialisation
        for both; decode tokens to release; prefill task)."""
        bp = orjson.dumps(self._bootstrap(body, p))
        charge = self._charge_prefill(p, route)
        d_tok = self._begin(d, route.num_tokens + route.max_new_tokens)
        p_task = asyncio.create_task(self._post(p, path, bp))
        p_task.add_done_callback(lambda _t: charge.release())
        return bp, d_tok, p_task

    def _bootstrap(self, body: dict, p: Worker, *, fake: bool = False) -> dict:
        return dict(
            body,
            bootstrap_host=FAKE_BOOTSTRAP_HOST if fake else p.host,
            bootstrap_port=p.bootstrap_port,
            bootstrap_room=self._rooms.getrandbits(63),
        )

    async def _post(self, w: Worker, path: str, body: dict | bytes) -> bytes:
        """POST (``body``: a dict or its JSON bytes) and read the whole answer; raises
        UpstreamError / ClientError."""
        assert self.http is not None
        payload = body if isinstance(body, bytes) else orjson.dumps(body)
        resp = None
        try:
            resp = await self.http.post(w.url, path, payload)
            data = await resp.read()
        except BROKEN as e:
            raise UpstreamError(w, f"{type(e).__name__}: {e}") from None
        finally:
            if resp is not None:
                resp.close()
        if resp.status < 400 and data.startswith(b"data:"):
            failed = prefill_stream_failure(data)
            if failed is not None:
                status, message = failed
                if status >= 500:
                    raise UpstreamError(
                        w,
                        f"aborted the request ({status}): {message[:200]}",
                        status,
                        error_body(status, message),
                    )
                raise ClientError(status, error_body(status, message), _JSON)
        if resp.status >= 500:
            raise UpstreamError(w, f"answered {resp.status}: {data[:200]!r}", resp.status, data)
        if resp.status >= 400:
            raise ClientError(resp.status, data, resp.content_type)
        return data

    def _fail(self, w: Worker, why: str) -> None:
        self.metrics.worker_failures.labels(w.url, w.tier.value).inc()
        w.mark_down(why)

    async def _prefill_only(self, body: dict, route: RouteRequest) -> tuple[int, bytes]:
        """Prompt-only request on one prefill worker (no KV leaves it); logprob window fixed."""
        start = body.get("logprob_start_len")
        shift = bool(body.get("return_logprob")) and isinstance(start, int) and start > 0
        sent = dict(body, logprob_start_len=start - 1) if shift else body
        tried: set = set()
        last = "no prefill worker"
        for _ in range(self.cfg.max_attempts):
            p = self._pick(Tier.PREFILL, route, tried)
            if p is None:
                break
            tried.add(p.id)
            charge = self._charge_prefill(p, route)
            try:
                data = await self._post(p, "/generate", self._bootstrap(sent, p, fake=True))
            except UpstreamError as e:
                self._fail(p, e.reason)
                self.metrics.retries.labels("prefill_failed").inc()
                last = str(e)
                continue
            except ClientError as e:
                return e.status, e.body
            finally:
                charge.release()
            if body.get("return_logprob"):
                out = orjson.loads(data)
                fix_logprob_window(
                    out.get("meta_info", {}),
                    shift=shift,
                    from_start=not shift and start in (0, None),
                )
                data = orjson.dumps(out)
            return 200, data
        return 502, error_body(502, f"no prefill worker could serve the request: {last}")

    async def _pd_once_json(
        self, path: str, body: dict, route: RouteRequest, *, merge_logprobs: bool
    ) -> tuple[int, bytes]:
        """Non-streaming PD request with retries; (status, body)."""
        tried_p: set = set()
        tried_d: set = set()
        last = "no worker"
        for p, d in self._pairs(route, tried_p, tried_d):
            bp, d_tok, p_task = self._start_pair(p, d, path, body, route)
            d_task = asyncio.create_task(self._post(d, path, bp))
            opening = Opening(d, d_task, self._watched)
            p_open = Opening(p, p_task, self._watched)
            try:
                # A failed prefill leaves its decode waiting for KV that never comes:
                # whichever fails first decides, and the other is cancelled.
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                if not d_task.done():
                    p_open.raise_if_stalled(d_task)
                if p_task.done() and not d_task.done():
                    p_task.result()  # raises if the prefill failed
                try:
                    d_data = await d_task
                except asyncio.CancelledError:
                    opening.reraise()
            except UpstreamError as e:
                d_task.cancel()
                if (
                    e.worker is d
                    and e.status is not None
                    and KV_BLOCKS_LOST.search(e.body.decode(errors="replace"))
                ):
                    # the decode worker is healthy; nothing of this request was returned yet: recompute it
                    self.metrics.retries.labels("kv_blocks_lost").inc()
                    last = str(e)
                    continue
                if store_load_failed(e, p):  # retried, the worker stays routable
                    self.metrics.retries.labels("store_load_failed").inc()
                    last = str(e)
                    continue
                culprit = e.worker if e.worker is p else await self._blame(p, p_task, e)
                (tried_p if culprit is p else tried_d).add(culprit.id)
                self._fail(
                    culprit, e.reason if culprit is e.worker else culprit.down_reason or e.reason
                )
                self.metrics.retries.labels(f"{culprit.tier.value}_failed").inc()
                last = str(e)
                continue
            except ClientError as e:
                p_task.cancel()
                d_task.cancel()
                return e.status, e.body
            except BaseException:
                p_task.cancel()
                d_task.cancel()
                raise
            finally:
                opening.close()
                p_open.close()
                d.end(d_tok)
            try:
                # (cancelled: the stall watch gave the prefill up just as the decode answered)
                p_data = None if p_task.cancelled() else await p_task
            except UpstreamError as e:  # decode got its KV, so the answer stands
                logger.warning("prefill answer lost after decode finished: %s", e)
                p_data = None
            except ClientError:
                p_data = None
            if merge_logprobs and p_data is not None:
                d_data = merge_input_logprobs(p_data, d_data)
            return 200, d_data
        return 502, error_body(502, f"no worker pair could serve the request: {last}")

    async def _blame(self, p: Worker, p_task: asyncio.Task, err: UpstreamError) -> Worker:
        """Decode failed: was it the prefill worker's fault? A decode worker whose
        prefill peer died fails too, so wait briefly for the prefill's outcome.
        A decode worker that *answered* that it could not receive the KV (SGLang's
        KV transfer or bootstrap error) is alive: the prefill side is blamed, even
        before its own request fails (an unreachable host only fails at the
        connect timeout); a healthy prefill is readmitted by its next probe."""
        if (
            err.worker is not p
            and err.status is not None
            and KV_TRANSFER_FAILURE.search(err.body.decode(errors="replace") or err.reason)
        ):
            if not p_task.done():
                p_task.cancel()
            p.down_reason = f"its decode peer could not receive the KV: {err.reason[:200]}"
            return p
        try:
            await asyncio.wait_for(asyncio.shield(p_task), timeout=1.0)
        except UpstreamError as pe:
            p.down_reason = pe.reason
            return p
        except (TimeoutError, ClientError, asyncio.CancelledError):
            pass
        finally:
            if not p_task.done():
                p_task.cancel()
        return p if not p.healthy else err.worker

    async def _pd(
        self,
        request: web.Request,
        path: str,
        body: dict,
        route: RouteRequest,
        label: str,
        t0: float,
        *,
        stream: bool,
        merge_logprobs: bool,
    ) -> web.StreamResponse:
        if not stream:
            status, data = await self._pd_once_json(
                path, body, route, merge_logprobs=merge_logprobs
            )
            self._count(label, status, t0)
            return web.Response(status=status, body=data, content_type=_JSON)
        return await self._pd_stream(request, path, body, route, label, t0)

    async def _open_stream(
        self,
        path: str,
        body: dict,
        route: RouteRequest,
        *,
        avoid_d: frozenset = frozenset(),
        prefer_d: Worker | None = None,
        headers: dict | None = None,
        first_byte_s: float | None = None,
    ) -> Upstream | web.Response | str:
        """Send a streamed PD request and wait for its first byte, retrying other
        pairs on failures before it (``headers``: extra ones for the decode half).
        ``first_byte_s`` (a continuation's): a pair with no first byte by then (twice
        that on the second try, and so on) is given up, though neither worker is marked
        down, and the next try prefers other workers. Returns the open upstream, a worker's 4xx answer (the client's
        problem), or why no pair could serve it."""
        assert self.http is not None
        tried_p: set = set()
        tried_d: set = {w.id for w in self.decode if w.url in avoid_d}
        slow: set = set()  # workers of pairs that timed out (avoided while there are others)
        last = "no worker"
        pairs = self._pairs(route, tried_p, tried_d, prefer_d=prefer_d, avoid=slow)
        for attempt, (p, d) in enumerate(pairs):
            if attempt and str(body.get("rid", "")).startswith(MIGRATABLE):
                # A retry gets a rid of its own, sharing no prefix with the first try's: the
                # worker may still hold the first try (SGLang refuses a duplicate rid), and
                # SGLang aborts every request whose rid *starts with* an aborted one, so the
                # first try's late abort would end the retry with an empty answer.
                body = mark(body, self._rooms)
            bp, d_tok, p_task = self._start_pair(p, d, path, body, route)
            resp: Response | None = None
            post = self.http.begin(d.url, path, bp, headers)
            # doubled on each try: a long continuation on a busy prefill worker gets longer
            deadline = (
                None if first_byte_s is None else time.monotonic() + first_byte_s * 2**attempt
            )
            opening = Opening(d, post, self._watched, deadline)
            p_open = Opening(p, p_task, self._watched, deadline)
            try:
                # a prefill that fails first leaves its decode waiting for KV: it decides
                await first_done(post, p_task)
                p_open.raise_if_stalled(post)
                early = None if post.done() or p_task.cancelled() else p_task.exception()
                if isinstance(early, (UpstreamError, ClientError)):
                    _drop(post, None)
                    if isinstance(early, UpstreamError):
                        raise early
                    d.end(d_tok)
                    return web.Response(
                        status=early.status,
                        body=early.body,
                        content_type=early.content_type or _JSON,
                    )
                try:
                    resp = await post
                except (TimeoutError, ConnectionError) as e:
                    raise UpstreamError(d, f"{type(e).__name__}: {e}") from None
                except asyncio.CancelledError:
                    opening.reraise()
                if resp.status >= 400:
                    data = await resp.read()
                    if resp.status < 500:
                        p_task.cancel()
                        d.end(d_tok)
                        return web.Response(
                            status=resp.status, body=data, content_type=resp.content_type or _JSON
                        )
                    raise UpstreamError(
                        d, f"answered {resp.status}: {data[:200]!r}", resp.status, data
                    )
                first = opening.fut = resp.next_bytes()
                while True:
                    await (first_done(first) if p_task.done() else first_done(first, p_task))
                    if first.done():
                        break
                    p_open.raise_if_stalled(first)
                    exc = p_task.exception()
                    if isinstance(exc, UpstreamError):
                        first.cancel()
                        raise exc
                    if isinstance(exc, ClientError):
                        first.cancel()
                        resp.close()
                        d.end(d_tok)
                        return web.Response(
                            status=exc.status, body=exc.body, content_type=exc.content_type or _JSON
                        )
                try:
                    chunk = first.result()
                except BROKEN as e:
                    raise UpstreamError(
                        d, f"stream broke before the first byte: {type(e).__name__}"
                    ) from None
                except asyncio.CancelledError:
                    opening.reraise()
                if not chunk:
                    raise UpstreamError(d, "stream ended before the first byte")
            except HandshakeTimeout as e:
                _drop(post, resp)
                p_task.cancel()
                slow.update((p.id, d.id))
                self.metrics.retries.labels("continuation_timeout").inc()
                logger.warning("a continuation's pair gave no first byte in time: %s", e)
                last = str(e)
                d.end(d_tok)
                continue
            except UpstreamError as e:
                _drop(post, resp)
                if store_load_failed(e, p):  # retried, the worker stays routable
                    self.metrics.retries.labels("store_load_failed").inc()
                    last = str(e)
                    d.end(d_tok)
                    continue
                culprit = await self._blame(p, p_task, e) if e.worker is d else e.worker
                (tried_p if culprit is p else tried_d).add(culprit.id)
                self._fail(culprit, (culprit.down_reason if culprit is not d else "") or e.reason)
                self.metrics.retries.labels(f"{culprit.tier.value}_failed").inc()
                last = str(e)
                d.end(d_tok)
                continue
            except BaseException:
                opening.fut.cancel()  # the first byte's read, if it got that far
                _drop(post, resp)
                p_task.cancel()
                d.end(d_tok)
                raise
            finally:
                opening.close()
                p_open.close()
            return Upstream(
                p,
                d,
                resp,
                chunk,
                p_task,
                d_tok,
                rid=str(body.get("rid", "")),
                watched=self._watched,
            )
        return last

    async def _pd_stream(
        self,
        request: web.Request,
        path: str,
        body: dict,
        route: RouteRequest,
        label: str,
        t0: float,
    ) -> web.StreamResponse:
        # A stream that a continuation can carry on exactly is watched event by event
        # (a Splicer): to move it between decode workers (request migration, when the
        # workers have agents) and to resume it elsewhere if its decode worker dies.
        splice = None
        why = unmigratable_reason(label, body)
        if why is None:
            if self.cfg.request_migration and self.admin.agents:
                body = mark(body, self._rooms)
            splice = Splicer(label, body, decode=self.prompts.decoder)
            body = splice.body
        elif self.cfg.request_migration and self.admin.agents:
            self.metrics.unmigratable.labels(why.split(":", 1)[0]).inc()
        up = await self._open_stream(
            path, body, route, headers=splice.upstream_headers if splice is not None else None
        )
        if isinstance(up, web.Response):
            self._count(label, up.status, t0)
            return up
        if isinstance(up, str):
            self._count(label, 502, t0)
            return error_response(502, f"no worker pair could serve the request: {up}")
        # ---- committed: relay chunk by chunk
        out = stream_out(
            request,
            {
                "Content-Type": up.resp.headers.get("content-type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        chunk: bytes | None = up.first
        try:
            await out.prepare(request)
            self.metrics.first_byte(label, time.perf_counter() - t0)
            while True:
                why = None
                if splice is None:
                    if chunk:
                        await out.write(chunk)
                else:
                    if chunk:
                        events = splice.feed(chunk)
                        if events:  # one write for all the whole events of a chunk
                            await out.write(b"".join(events))
                    if splice.migrated is not None:
                        up.finish()
                        nxt = await self._continue(splice, up, route)
                        if isinstance(nxt, bytes):  # nothing could continue it: the client is told
                            await out.write(nxt)
                            break
                        up, chunk = nxt, nxt.first
                        continue
                    if splice.aborted:
                        why = f"decode worker {up.d.url} aborted the request"
                if why is None:
                    try:
                        # b"": the stream's end; None: the splice needs this task (a handoff,
                        # an abort), everything before it relayed
                        chunk = await relay(up, out, request.transport, splice)
                    except BROKEN as e:
                        why = f"decode worker {up.d.url} failed mid-stream: {type(e).__name__}"
                        if not isinstance(e, asyncio.TimeoutError) and up.stalled is None:
                            self._fail(up.d, why)
                    if why is None and chunk == b"" and splice is not None and not splice.done:
                        why = f"decode worker {up.d.url} ended the stream before its end"
                    if up.stalled is not None and not up.resp.complete:
                        why = up.stalled  # ended by the stall watch, whatever the read saw
                if why is not None:
                    logger.warning("%s", why)
                    nxt = await self._resume(splice, up, route) if splice is not None else None
                    if nxt is not None:
                        up.finish()
                        up, chunk = nxt, nxt.first
                        continue
                    self.metrics.stream_errors.inc()
                    await out.write(sse_error(why))
                    break
                if chunk == b"":
                    if splice is not None:
                        await out.write(splice.flush())
                    break
            await out.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            logger.info("client went away; aborting its request on %s", up.d.url)
            up.p_task.cancel()
            raise
        finally:
            up.finish()
        self._count(label, 200, t0)
        return out


def _drop(post: asyncio.Future, resp: Response | None) -> None:
    """Give a decode half up: its answer, whether it came already or comes later, is
    closed. An answer nobody reads would keep its connection, a slot of its worker's
    pool and the worker's request until they timed out."""
    if resp is not None:
        resp.close()
        return
    post.cancel()
    post.add_done_callback(_close_answer)


def _close_answer(post: asyncio.Future) -> None:
    if not post.cancelled() and post.exception() is None:
        post.result().close()
