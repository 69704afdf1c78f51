"""The router's half of live request migration: continue a handed-off stream;
and of a decode worker's death: resume its streams elsewhere.

A decode worker that stopped a migratable request (:mod:`bana_sglang.migrate.requests.handler`)
leaves its stream with the handoff mark; :class:`~.splice.Splicer` sees it, and
:meth:`ContinuationMixin._continue` asks that worker's agent for the request's
tokens, waits briefly for the global index to list its pages, and opens the
continuation on another pair (the migration's peer when it is healthy). The
relay in :mod:`.server` then goes on with the new upstream.

When a decode worker dies mid-stream, :meth:`ContinuationMixin._resume` opens the
same kind of continuation from what the router itself relayed (the Splicer keeps
the prompt's and the answer's token ids), so the client reads one answer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from bana_sglang.migrate.client import AgentUnavailable
from bana_sglang.router.errors import sse_error
from bana_sglang.router.policy import RouteRequest
from bana_sglang.router.splice import Splicer
from bana_sglang.router.upstream import Upstream
from bana_sglang.router.workers import Worker
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

logger = logging.getLogger("bana_sglang.router.server")

# How long to wait for the stopped request's tokens (its worker's agent answers
# at a batch boundary) and for its pages to be listed in the global index.
HANDOFF_WAIT_S = 10.0
PUBLISH_WAIT_S = 2.0


class ContinuationMixin:
    """The router supplies ``cfg``, ``admin``, ``metrics``, ``global_index``, ``decode``,
    ``_open_stream`` and ``_route_request``. A continuation's pair that sends no first
    byte within ``cfg.continuation_timeout_s`` is given up and the continuation opened
    again (:meth:`~.dispatch.PDDispatchMixin._open_stream`)."""

    async def _continue(
        self, splice: Splicer, up: Upstream, route: RouteRequest
    ) -> Upstream | bytes:
        """The decode worker ``up.d`` handed the request off: continue it on
        another pair. Returns the new upstream, or the error events to end the
        client's stream with."""
        t0 = time.perf_counter()
        mid, rid = splice.migrated, up.rid
        why = await self._handoff(up.d, rid)
        if isinstance(why, str):
            return self._migration_failed(mid, why)
        info = why
        path, body = splice.continuation(info.input_ids, info.output_ids)
        ids = body.get("input_ids") or body.get("prompt")
        await self._await_published(ids)
        nroute = await self._route_request(ids, splice.tokens_left())
        prefer = self._decode_by_agent(info.peer)
        nxt = await self._open_stream(
            path,
            body,
            nroute,
            avoid_d=frozenset({up.d.url}),
            prefer_d=prefer,
            first_byte_s=self.cfg.continuation_timeout_s,
        )
        if isinstance(nxt, web.Response):
            return self._migration_failed(
                mid, f"the continuation was refused ({nxt.status}): {nxt.body[:200]!r}"
            )
        if isinstance(nxt, str):
            return self._migration_failed(mid, f"no worker pair could continue it: {nxt}")
        stall = time.perf_counter() - t0
        self.metrics.request_migrations.labels("continued").inc()
        self.metrics.migration_stall_seconds.observe(stall)
        logger.info(
            "request migration %s: %s continues on %s (via %s) after %d tokens on %s; client stall "
            "%.0f ms",
            mid,
            rid,
            nxt.d.url,
            nxt.p.url,
            splice.done_tokens,
            up.d.url,
            1e3 * stall,
        )
        return nxt

    async def _resume(self, splice: Splicer, up: Upstream, route: RouteRequest) -> Upstream | None:
        """The decode worker ``up.d`` died mid-stream: continue the stream on another
        pair from the prompt and the answer the client has seen (the prompt's pages
        come from the global store). None when it cannot be resumed exactly (no token
        ids: a chat stream from a worker without the extension) or no pair could take
        it: the client then gets an error event."""
        cont = splice.resume()
        if cont is None:
            self.metrics.stream_resumes.labels("not_resumable").inc()
            return None
        t0 = time.perf_counter()
        path, body = cont
        ids = body.get("input_ids") or body.get("prompt")
        nroute = await self._route_request(ids, splice.tokens_left())
        nxt = await self._open_stream(
            path,
            body,
            nroute,
            avoid_d=frozenset({up.d.url}),
            first_byte_s=self.cfg.continuation_timeout_s,
        )
        if not isinstance(nxt, Upstream):
            why = nxt if isinstance(nxt, str) else f"refused ({nxt.status})"
            logger.warning("could not resume a stream of %s: %s", up.d.url, why)
            self.metrics.stream_resumes.labels("failed").inc()
            return None
        self.metrics.stream_resumes.labels("resumed").inc()
        logger.info(
            "a stream of %s resumed on %s (via %s) after %d answer tokens in %.0f ms",
            up.d.url,
            nxt.d.url,
            nxt.p.url,
            splice.done_tokens,
            1e3 * (time.perf_counter() - t0),
        )
        return nxt

    async def _handoff(self, d: Worker, rid: str):
        """The handed-off request's tokens from ``d``'s agent (it answers once the request stopped)."""
        if d.url not in self.admin.agents:
            return f"{d.url} has no migration agent to ask for the request's tokens"
        deadline = time.monotonic() + HANDOFF_WAIT_S
        while True:
            try:
                reply = await self.admin.call(d.url, m.Handoff, rid=rid)
            except AgentUnavailable as e:
                return f"the agent of {d.url} did not answer: {e}"
            if isinstance(reply, m.HandoffInfo):
                return reply
            if (
                isinstance(reply, m.Error)
                and reply.reason == "busy"
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.02)
                continue
            return f"the agent of {d.url} answered {describe(reply)}"

    async def _await_published(self, ids: list[int]) -> None:
        """Wait (briefly) until the global index lists the handed-off pages, so the
        prefill worker loads them rather than recomputing: the store publishes
        asynchronously after the request's end."""
        gi = self.global_index
        if gi is None or not ids:
            return
        want = ((len(ids) - 1) // gi.page_size) * gi.page_size
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while time.monotonic() < deadline:
            got = await gi.cached_tokens(ids)
            if got is None or got >= want:
                return
            await asyncio.sleep(0.01)
        self.metrics.request_migrations.labels("published_late").inc()

    def _decode_by_agent(self, endpoint: str) -> Worker | None:
        for url, ep in self.admin.endpoints.items():
            if ep == endpoint:
                return next((w for w in self.decode if w.url.rstrip("/") == url), None)
        return None

    def _migration_failed(self, mid: str, why: str) -> bytes:
        self.metrics.request_migrations.labels("failed").inc()
        self.metrics.stream_errors.inc()
        logger.warning("request migration %s could not continue the request: %s", mid, why)
        return sse_error(
            f"the request moved to another decode worker and could not continue there: {why}"
        )
