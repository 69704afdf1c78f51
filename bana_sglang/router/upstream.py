"""An open streamed PD request, as the router's relay holds it; what a worker's failed answer means."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp

from bana_sglang.router.errors import UpstreamError, streamed_failure
from bana_sglang.router.workers import Worker

#: what a broken connection to a worker raises while its answer is read
BROKEN = (
    TimeoutError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientConnectionError,
    ConnectionError,
)


# SGLang 0.5.23's decode-side errors when its prefill peer cannot be reached or
# its KV never arrives (disaggregation/mooncake/conn.py, decode.py).
KV_TRANSFER_FAILURE = re.compile(
    r"KVTransferError|bootstrap|Prefill instance could be dead|"
    r"remote mooncake session .* is not alive",
    re.IGNORECASE,
)
# bana's decode-side error when the peer holding a request's KV pages (KV-block
# migration) failed: the worker is fine, the request is recomputed elsewhere or there.
KV_BLOCKS_LOST = re.compile(r"KV blocks lost")
# SGLang's answer when a load from the global store failed after it started (a page
# lost or failing its MAC): the worker is fine and the bad pages are reported, so
# the same request misses and recomputes on a retry (unified_radix_cache.py).
STORE_LOAD_FAILED = re.compile(r"External KV cache load failed")


def prefill_stream_failure(data: bytes) -> tuple[int, str] | None:
    """The failure to act on in a streamed answer read whole (a streamed request's
    prefill half), as (status, message), or None. SGLang streams an abort with a 200,
    and after most aborts (a failed store load) the decode half never hears of it and
    waits for KV that never comes (SGLang's 300 s timeout). A failed KV transfer is the
    exception: the decode side learns of it through the transfer, its answer decides,
    and the prefill worker is not to blame for a decode worker that died."""
    failed = streamed_failure(data)
    if failed is None or KV_TRANSFER_FAILURE.search(failed[1]):
        return None
    return failed


class HandshakeTimeout(UpstreamError):
    """A half of a continuation whose pair sent no first byte before its deadline,
    from a worker that still answers: the pair is given up, the worker is not to blame."""


def store_load_failed(e: UpstreamError, p: Worker) -> bool:
    return (
        e.worker is p
        and e.status == 503
        and bool(STORE_LOAD_FAILED.search(e.body.decode(errors="replace")))
    )


class Upstream:
    """An open streamed PD request: its pair, the decode worker's response, its first bytes."""

    def __init__(
        self,
        p: Worker,
        d: Worker,
        resp: aiohttp.ClientResponse,
        first: bytes,
        p_task: asyncio.Task,
        d_tok: int,
        rid: str = "",
        watched: set | None = None,
    ):
        self.p, self.d, self.resp, self.first, self.p_task, self.d_tok = (
            p,
            d,
            resp,
            first,
            p_task,
            d_tok,
        )
        self.rid = rid  # the request id it was sent with (a migratable request's, for its handoff)
        self.drained = False
        self._ended = False
        self.since = time.monotonic()  # when its last bytes came (the relay keeps it fresh)
        self.stalled: str | None = None  # why the router ended it for silence (see stalls.py)
        self._watched = watched  # the router's stall watch, while this stream is open
        if watched is not None:
            watched.add(self)

    @property
    def worker(self) -> Worker:
        return self.d

    silence = "sent nothing"  # what the stall watch says of a silent stream
    deadline: float | None = None  # an open stream has none (see Opening.deadline)

    def stall(self, why: str) -> None:
        """Its decode worker hangs: close the connection, so the relay resumes it."""
        self.stalled = why
        self.resp.close()

    def finish(self, drained: bool) -> None:
        """Give the connection back (read to the end) or abort it, and end the counts; idempotent."""
        if self._ended:
            return
        self._ended = True
        if self._watched is not None:
            self._watched.discard(self)
        (self.resp.release if drained else self.resp.close)()
        self.d.end(self.d_tok)
        if not self.p_task.done():
            # the prefill answer is only bookkeeping once decode streams
            self.p_task.add_done_callback(_swallow)


class Opening:
    """A half of a PD request sent to ``worker`` (decode or prefill) whose answer has
    not come (a decode half: no first byte yet; a prefill half: no answer), watched
    by the router for a hung worker: :meth:`stall` cancels what the request waits on
    (``fut``), and the waiter raises the reason (``stalled``) as the worker's failure
    (:meth:`reraise`). With a ``deadline`` (monotonic time: a continuation's), the
    watch also gives it up then, whether or not its worker still answers; the waiter
    raises :class:`HandshakeTimeout` instead."""

    silence = "has not answered"  # what the stall watch says of it

    def __init__(
        self, worker: Worker, fut: asyncio.Future, watched: set, deadline: float | None = None
    ):
        self.worker, self.fut, self.deadline = worker, fut, deadline
        self.since = time.monotonic()
        self.stalled: str | None = None
        self.timed_out = False
        self._watched = watched
        watched.add(self)

    def stall(self, why: str, *, timed_out: bool = False) -> None:
        self.stalled, self.timed_out = why, timed_out
        self.fut.cancel()

    def _error(self) -> UpstreamError:
        assert self.stalled is not None
        return (HandshakeTimeout if self.timed_out else UpstreamError)(self.worker, self.stalled)

    def raise_if_stalled(self, cancel: asyncio.Future) -> None:
        """After a wait that the stall may have ended: give ``cancel`` (the other half's
        wait) up and raise the stall as the worker's failure."""
        if self.stalled is not None:
            cancel.cancel()
            raise self._error()

    def reraise(self) -> None:
        """Inside ``except asyncio.CancelledError``: a stall becomes the worker's
        failure (the request is retried elsewhere); anything else is re-raised."""
        if self.stalled is None:
            raise
        raise self._error() from None

    def close(self) -> None:
        self._watched.discard(self)


def _swallow(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
