"""An open streamed PD request, as the router's relay holds it; what a worker's failed answer means."""

from __future__ import annotations

import asyncio
import re
import time

from aiohttp import web

from bana_sglang.router.errors import UpstreamError, streamed_failure
from bana_sglang.router.front import FrontStream
from bana_sglang.router.http1 import Response
from bana_sglang.router.workers import Worker

#: what a broken connection to a worker raises while its answer is read
#: (:mod:`~.http1` raises its :class:`~.http1.UpstreamClosed`, a ConnectionError)
BROKEN = (TimeoutError, ConnectionError)
#: the client's unsent bytes past which the relay stops reading its upstream, and under
#: which it reads on (a slow client must not make the router buffer a whole answer)
_HIGH_WATER, _LOW_WATER = 64 * 1024, 16 * 1024


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
        resp: Response,
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

    def finish(self) -> None:
        """Close the answer (a whole one's connection is back in the pool already, see
        :meth:`~.http1.Response.close`) and end the counts; idempotent."""
        if self._ended:
            return
        self._ended = True
        if self._watched is not None:
            self._watched.discard(self)
        self.resp.close()
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


async def first_done(*futs: asyncio.Future) -> None:
    """Wait until one of ``futs`` is done: ``asyncio.wait(..., FIRST_COMPLETED)`` with
    less to set up (no sets, one waiter), as a request's opening waits twice. Like it,
    cancelling the wait cancels none of ``futs``."""
    if any(f.done() for f in futs):
        return
    woke = asyncio.get_running_loop().create_future()

    def wake(_f: asyncio.Future) -> None:
        if not woke.done():
            woke.set_result(None)

    for f in futs:
        f.add_done_callback(wake)
    try:
        await woke
    finally:
        for f in futs:
            f.remove_done_callback(wake)


def _swallow(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def relay(
    up: Upstream,
    out: web.StreamResponse | FrontStream,
    transport: asyncio.Transport | None,
    splice,
) -> bytes | None:
    """Relay ``up``'s answer to the client until it ends (returns b""), its connection
    breaks (raises one of :data:`BROKEN`), or ``splice`` (a :class:`~.splice.Splicer`,
    or None) may need the caller: returns None, with everything so far relayed, when
    the splice saw a handoff or an abort, and on a client that is not sent chunks.

    The bytes go from the worker's connection callback straight to the client's
    transport, framed as the chunks of ``out`` (already prepared): no task wakes per
    chunk. A client that reads slowly makes it stop reading the worker until the
    client's buffer drains; a client that went away raises ConnectionResetError. A
    response that is not chunked (an HTTP/1.0 client) is relayed piece by piece by
    this task instead."""
    chunked = isinstance(out, FrontStream) or (
        out.headers.get("Transfer-Encoding", "").lower() == "chunked" and not out.compression
    )
    if transport is None or not chunked:
        chunk = await up.resp.readany()
        up.since = time.monotonic()
        if not chunk:
            return b""
        chunk = _for_client(chunk, splice)
        if chunk:
            await out.write(chunk)
        return None
    await out.write(b"")  # the headers, if nothing was written yet (aiohttp holds them back)
    while True:
        why, exc = await _push(up, out, transport, splice)
        if why == "end":
            if exc is not None:
                raise exc
            return b""
        if why == "gone":
            raise ConnectionResetError("the client went away")
        if why == "bug":
            assert exc is not None
            raise exc
        if why == "splice":
            return None  # the connection is given up or resumed elsewhere: it stays paused
        nap = 0.005  # "drain": a slow client, polled (aiohttp's drain is not public)
        while transport.get_write_buffer_size() > _LOW_WATER:
            if transport.is_closing():
                raise ConnectionResetError("the client went away")
            if up.resp.error is not None:  # closed meanwhile (the stall watch)
                raise up.resp.error
            await asyncio.sleep(nap)
            nap = min(0.1, nap * 2)
        up.resp.resume()


def _for_client(data: bytes, splice) -> bytes:
    """What of the worker's ``data`` goes to the client: all of it, or the whole events
    the splicer lets through."""
    if splice is None:
        return data
    events = splice.feed(data)
    return events[0] if len(events) == 1 else b"".join(events)


async def _push(
    up: Upstream, out: web.StreamResponse | FrontStream, transport: asyncio.Transport, splice
) -> tuple[str, BaseException | None]:
    """Relay from the connection's callback until something needs the relay's task:
    ("end", error or None), "splice", "drain" (the client's buffer is full), "gone" or
    ("bug", the splicer's exception)."""
    resp = up.resp
    woke: asyncio.Future = asyncio.get_running_loop().create_future()
    closable = isinstance(out, FrontStream)  # its end can be written here

    def stop(why: str, exc: BaseException | None = None) -> None:
        if not woke.done():
            woke.set_result((why, exc))

    def on_data(data: bytes) -> None:
        up.since = time.monotonic()
        try:
            data = _for_client(data, splice)
        except Exception as e:  # noqa: BLE001  (the router's bug, not the worker's failure)
            resp.pause()
            stop("bug", e)
            return
        if transport.is_closing():
            resp.pause()
            stop("gone")
            return
        # the worker's last bytes: the client's answer ends in the same write
        last = resp.final and closable and (splice is None or splice.finished)
        if last and splice is not None:
            data += splice.flush()
        framed = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if last:
            framed += out.take_terminator()
        if framed:
            transport.write(framed)
        if splice is not None and (splice.migrated is not None or splice.aborted):
            resp.pause()
            stop("splice")
        elif transport.get_write_buffer_size() > _HIGH_WATER:
            resp.pause()
            stop("drain")

    try:
        resp.push(on_data, lambda exc: stop("end", exc))
        return await woke
    finally:
        resp.pull()
