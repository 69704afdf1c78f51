"""The router's stall watch: requests taken away from a worker that hangs.

A worker whose HTTP server answered nothing for ``stall_timeout_s`` (no load poll
and no liveness probe, see :class:`~bana_sglang.router.monitor.WorkerMonitor`) is a
hung or stopped process (SIGSTOP), not a busy one: a busy worker's HTTP server still
answers. Once one of its requests has waited as long too (a stream since its last
bytes, a decode half for its first byte, a prefill half for its answer), the worker
is marked down (no new request goes there until it answers ``/health`` again), and
each such request is stalled (:mod:`.upstream`): a stream's connection is closed, so
the relay resumes it on another decode worker (or ends it with an error event when
it cannot be resumed), and an unanswered half is cancelled, so its request is
retried on another pair, instead of holding the client until ``read_timeout_s`` (or
SGLang's 300 s KV timeout).

A continuation's halves (a resumed or migrated stream, see :mod:`.continuation`) also
carry a deadline (``continuation_timeout_s``): a pair that has sent no first byte by
then is given up even though its workers answer (a PD bootstrap handshake that never
completes, seen once holding a moved stream for SGLang's whole 300 s), and the
continuation is opened again; neither worker is marked down.
"""

from __future__ import annotations

import asyncio
import time


class StallWatchMixin:
    """Runs over ``self._watched`` (open :class:`~.upstream.Upstream` streams and
    :class:`~.upstream.Opening` halves: both have ``worker``, ``since``, ``stalled``,
    ``silence`` and ``stall``)."""

    async def _stall_watch(self) -> None:
        stall = self.cfg.stall_timeout_s
        tick = min(1.0, stall / 4, self.cfg.continuation_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for req in list(self._watched):
                w = req.worker
                if req.stalled is not None:
                    continue
                if now - req.since < stall or now - w.answered_at < stall:
                    # not a hung worker; a continuation's half past its deadline is given up
                    if req.deadline is not None and now >= req.deadline and not req.fut.done():
                        req.stall(
                            f"{w.tier.value} worker {w.url} {req.silence} within a "
                            f"continuation's deadline ({now - req.since:.0f}s)",
                            timed_out=True,
                        )
                    continue
                why = (
                    f"{w.tier.value} worker {w.url} {req.silence} for {now - req.since:.0f}s and "
                    f"answered nothing else for {now - w.answered_at:.0f}s (hung or stopped)"
                )
                if w.healthy:
                    self.metrics.stalls.labels(w.url, w.tier.value).inc()
                    self._fail(w, why)
                req.stall(why)
