"""The router's HTTP/1.1 client for its workers: keep-alive pools on asyncio protocols.

A streamed request crosses the router as a few dozen small chunks, and with
aiohttp's client each one costs a parser callback, a stream-reader buffer, a
future and a task step before the relay can write it (``python -m bench.bench_router``
measured the router at 1.7x the stock Rust router's CPU per request). This client
does only what the router asks of a worker: ``POST`` a JSON body (or ``GET``: the
load polls) and read the answer, whole (:meth:`Response.read`), piece by piece (:meth:`Response.readany`,
or :meth:`Response.next_bytes` as a future), or pushed to a callback from the
connection's own ``data_received`` (:meth:`Response.push`) so that the relay writes
each chunk to the client with no task switch at all. :meth:`Pool.begin` sends a
request at once when a slot and an idle connection are free, and its answer's head
is a future the connection resolves: a decode half's opening wakes no task of its own.
Bodies come framed by ``Content-Length``, chunked, or until the worker closes
(the answer's parsing and reading are :mod:`.http1_response`'s); requests are small
and sent whole.

Connections are kept per worker (``host:port``) and reused; one idle longer than
``idle_s`` is closed before the worker's own keep-alive timeout could close it under
a new request (uvicorn's, SGLang's server, is 5 s). At most ``limit`` requests are in
flight per worker. A read that gets no byte for ``read_timeout_s`` fails with
:class:`TimeoutError`, checked once a second by the pools' janitor rather than by a
timer re-armed per chunk. A broken connection fails the reader with
:class:`UpstreamClosed`, a :class:`ConnectionError`, as does a failed connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from urllib.parse import urlsplit

from bana_sglang.router.http1_response import (
    MAX_HEAD_BYTES,
    BadResponse,
    Response,
    UpstreamClosed,
)

__all__ = ["BadResponse", "Response", "UpstreamClosed", "WorkerHTTP"]


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a worker; at most one answer at a time."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.resp: Response | None = None
        self.head: asyncio.Future | None = None  # resolved with resp once its head is read
        self.pending = b""  # bytes of an unfinished head or chunk-size line
        self.last = time.monotonic()  # when it last got bytes, or went idle
        self.lost = False
        self.paused = False  # reading paused (a slow client); never so in the pool
        self.slot = True  # its request holds one of the pool's slots

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def send(self, request: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Send ``request``; the future of its answer (resolved once the head came).
        Cancelling that future closes the answer (and so the connection): nobody will
        read it."""
        resp = self.resp = Response(self)
        self.head = loop.create_future()
        self.head.add_done_callback(lambda f: f.cancelled() and resp.close())
        self.pending = b""
        self.last = time.monotonic()
        assert self.transport is not None
        self.transport.write(request)
        return self.head

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        resp = self.resp
        if resp is None:  # bytes nobody asked for: this connection is not to be trusted
            self.abort(BadResponse("bytes from the worker with no request open"))
            return
        try:
            if self.head is not None:
                buf = self.pending + data if self.pending else data
                i = buf.find(b"\r\n\r\n")
                if i < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise BadResponse(f"headers longer than {MAX_HEAD_BYTES} bytes")
                    self.pending = buf
                    return
                self.pending = b""
                resp.take_head(buf[:i])
                data = buf[i + 4 :]
                if 100 <= resp.status < 200:  # an interim answer: the real one follows
                    resp.status, resp.headers = 0, {}
                    self.data_received(data)
                    return
                head, self.head = self.head, None
                if not head.done():
                    head.set_result(resp)
            if resp.take_body(data):
                resp.body_done()
        except BadResponse as e:
            self.abort(e)

    def eof_received(self) -> bool:
        resp = self.resp
        if resp is not None and resp.until_close and self.head is None:
            resp.body_done()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.transport = None
        self.abort(exc)
        self.pool.forget(self)

    def abort(self, exc: BaseException | None) -> None:
        """Close the connection; a request open on it fails (``exc``: why)."""
        why = exc if isinstance(exc, ConnectionError | TimeoutError) else None
        if why is None:
            detail = f": {exc}" if exc else ""
            why = UpstreamClosed(f"the worker closed the connection before its answer{detail}")
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(why)
            head.exception()  # a cancelled waiter never reads it
        resp, self.resp = self.resp, None
        if resp is not None:
            resp.fail(why)
            self.pool.done(self)
        if self.transport is not None:
            self.transport.close()

    def reading(self, on: bool) -> None:
        if self.transport is not None and self.paused == on:
            self.paused = not on
            self.last = time.monotonic()  # paused is not silent: the read timeout restarts
            (self.transport.resume_reading if on else self.transport.pause_reading)()

    def finished(self, *, keep: bool) -> None:
        self.resp = None
        self.pool.done(self)
        # an answer can end in the very bytes whose relay paused the reading: the next
        # request on this connection must be read
        self.reading(True)
        if keep and not self.pending and not self.lost:
            self.last = time.monotonic()
            self.pool.idle.append(self)
        elif self.transport is not None:
            self.transport.close()


class Pool:
    """Connections to one worker (``host:port``) and the requests in flight on them."""

    def __init__(
        self,
        host: str,
        port: int,
        headers: dict[str, str],
        *,
        limit: int,
        connect_timeout_s: float,
    ):
        self.host, self.port = host, port
        self.idle: list[_Conn] = []
        self.busy: set[_Conn] = set()
        # free request slots, and the requests waiting for one (a freed slot goes to the
        # first of them still waiting)
        self._free = limit
        self._queue: deque[asyncio.Future] = deque()
        self._connect_timeout_s = connect_timeout_s
        fixed = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._fixed = f"Host: {host}:{port}\r\n{fixed}".encode("latin-1")

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> Response:
        """Send ``body`` (JSON) to ``path``; the answer once its status and headers came."""
        return await self._send(b"POST", path, body, headers)

    def begin(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future:
        """:meth:`post` as a future. With a slot and an idle connection free (the usual
        case) the request leaves now and the future is the connection's own, resolved
        from its callback: no task. Else a task waits for them. Cancelling the future
        before the answer's head came closes the connection, as cancelling :meth:`post`
        does."""
        if self._take_slot():
            conn = self._idle_conn()
            if conn is not None:
                return self._issue(conn, b"POST", path, body, headers, limited=True)
            self._release()  # nobody queues (_take_slot): the slot is simply free again
        return asyncio.ensure_future(self.post(path, body, headers))

    async def get(self, path: str) -> Response:
        """``GET path`` (the load polls: outside the per-worker limit, so that a worker
        saturated with requests still has its load read); the answer once its status
        and headers came."""
        return await self._send(b"GET", path, None, None, limited=False)

    async def _send(
        self,
        method: bytes,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None,
        *,
        limited: bool = True,
    ) -> Response:
        if limited:
            await self._acquire()
        try:
            conn = await self._conn()
        except BaseException:
            if limited:
                self._release()
            raise
        head = self._issue(conn, method, path, body, headers, limited=limited)
        resp = conn.resp
        assert resp is not None
        try:
            return await head
        except asyncio.CancelledError:
            # cancelled with the head already come (a cancelled head closed it already):
            # closes the connection only while this answer holds it, since a whole answer
            # has given it back to the pool, maybe to another request already
            resp.close()
            raise

    def _issue(
        self,
        conn: _Conn,
        method: bytes,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None,
        *,
        limited: bool,
    ) -> asyncio.Future:
        """Send the request on ``conn``; the future of its answer's head."""
        conn.slot = limited
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() if headers else b""
        if body is None:
            request = b"%s %s HTTP/1.1\r\n%s%s\r\n" % (method, path.encode(), self._fixed, extra)
        else:
            request = b"%s %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n%s" % (
                method,
                path.encode(),
                self._fixed,
                extra,
                len(body),
                body,
            )
        self.busy.add(conn)
        return conn.send(request, asyncio.get_running_loop())

    def _take_slot(self) -> bool:
        """Take a free slot now if there is one and nobody queues for it."""
        if self._free > 0 and not self._queue:
            self._free -= 1
            return True
        return False

    async def _acquire(self) -> None:
        if self._take_slot():
            return
        slot = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        try:
            await slot  # _release hands its slot over by resolving this
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():  # handed a slot, then cancelled
                self._release()
            else:
                with contextlib.suppress(ValueError):
                    self._queue.remove(slot)
            raise

    def _release(self) -> None:
        while self._queue:
            slot = self._queue.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self._free += 1

    def _idle_conn(self) -> _Conn | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _conn(self) -> _Conn:
        conn = self._idle_conn()
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except TimeoutError:
            raise UpstreamClosed(
                f"connecting to {self.host}:{self.port} took over {self._connect_timeout_s:g} s"
            ) from None
        except OSError as e:
            raise UpstreamClosed(f"cannot connect to {self.host}:{self.port}: {e}") from None
        return conn

    def done(self, conn: _Conn) -> None:
        """``conn``'s request ended (whole or failed): its slot is free again."""
        if conn in self.busy:
            self.busy.discard(conn)
            if conn.slot:
                self._release()

    def forget(self, conn: _Conn) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    def sweep(self, now: float, idle_s: float, read_timeout_s: float) -> None:
        """Close connections idle over ``idle_s``; fail reads silent over ``read_timeout_s``."""
        while self.idle and now - self.idle[0].last > idle_s:
            conn = self.idle.pop(0)
            if conn.transport is not None:
                conn.transport.close()
        for conn in [c for c in self.busy if not c.paused and now - c.last > read_timeout_s]:
            conn.abort(
                TimeoutError(f"no byte from {self.host}:{self.port} in {read_timeout_s:g} s")
            )

    def close(self) -> None:
        for conn in [*self.idle, *self.busy]:
            conn.abort(UpstreamClosed("the router is shutting down"))
        self.idle.clear()


class WorkerHTTP:
    """The router's pools, one per worker URL, and their janitor."""

    def __init__(
        self,
        headers: dict[str, str],
        *,
        limit_per_worker: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        idle_s: float = 3.0,
    ):
        self._headers = {"Content-Type": "application/json", **headers}
        self._limit, self._connect_timeout_s = limit_per_worker, connect_timeout_s
        self.read_timeout_s, self.idle_s = read_timeout_s, idle_s
        self._pools: dict[str, Pool] = {}
        self._janitor: asyncio.Task | None = None

    def pool(self, url: str) -> Pool:
        pool = self._pools.get(url)
        if pool is None:
            u = urlsplit(url)
            if u.scheme != "http" or not u.hostname:
                raise ValueError(f"a worker URL must be http://host:port, got {url!r}")
            pool = self._pools[url] = Pool(
                u.hostname,
                u.port or 80,
                self._headers,
                limit=self._limit,
                connect_timeout_s=self._connect_timeout_s,
            )
            if self._janitor is None:
                self._janitor = asyncio.get_running_loop().create_task(
                    self._sweep(), name="bana-router-http1"
                )
        return pool

    async def post(self, url: str, path: str, body: bytes, headers: dict | None = None):
        return await self.pool(url).post(path, body, headers)

    def begin(self, url: str, path: str, body: bytes, headers: dict | None = None):
        """:meth:`Pool.begin` on ``url``'s pool: the answer's head as a future."""
        return self.pool(url).begin(path, body, headers)

    async def get(self, url: str, path: str) -> Response:
        return await self.pool(url).get(path)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for pool in list(self._pools.values()):
                pool.sweep(now, self.idle_s, self.read_timeout_s)

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
        for pool in self._pools.values():
            pool.close()
