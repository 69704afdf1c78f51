"""The router's client-facing listener: generation requests on a path of its own.

The router is an aiohttp application, and everything it serves stays one. But
aiohttp's server costs about as much CPU per request as the whole relay
(measured against a bare asyncio protocol doing the same relay: 0.30 ms of
0.78 per request), and the stock Rust router pays none of it. So the listener
is a protocol of its own (:class:`FrontConn`) that reads each request's head
and takes the three generation endpoints (``POST /v1/completions``,
``/v1/chat/completions``, ``/generate``) itself when the request is plain
HTTP/1.1 with a ``Content-Length`` body within ``--max-body-bytes``; it runs
the router's own handler for them (:meth:`~.server.Router.handle_front`, the
same code aiohttp's routes call) and writes the answer. Any other request,
and anything it does not fully understand (another HTTP version, a chunked or
compressed body, ``Expect``, an upgrade, a malformed head, a body over the
limit), hands the connection, with every byte read so far, to aiohttp's own
protocol, which serves it, and the rest of that connection, as before: its
errors (400, 413, 431) are aiohttp's.

What the handlers see: :class:`FrontRequest` has the parts of aiohttp's
``web.Request`` that they read (``method``, ``path``, ``headers``, ``read()``,
``transport``); :func:`stream_out` gives a streamed answer of either kind.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.tcp_helpers import tcp_nodelay
from multidict import CIMultiDict

logger = logging.getLogger("bana_sglang.router.server")

#: the paths served here (query strings go to aiohttp)
HOT_PATHS = frozenset((b"/v1/completions", b"/v1/chat/completions", b"/generate"))
MAX_HEAD_BYTES = 16384  # a longer request head is aiohttp's (it answers 431 or 400)
MAX_LINE_BYTES = 8190  # a longer head line is aiohttp's (its own limit)
#: pipelined bytes kept while a request is served, past which reading pauses
MAX_PENDING_BYTES = 1 << 20
KEEPALIVE_S = 75.0  # an idle connection (no request under way) is closed after this
_REFUSED = frozenset((b"transfer-encoding", b"expect", b"upgrade", b"content-encoding"))
#: a header line as RFC 9110 has it: a token, a colon, a value with no control
#: character but tab (so no bare CR or LF); anything else is aiohttp's to refuse
_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[ \t]*[^\x00-\x08\x0a-\x1f\x7f]*")

Handler = Callable[["FrontRequest"], Awaitable[web.StreamResponse]]
OnError = Callable[[BaseException], web.Response]


class StreamOut(web.StreamResponse):
    """aiohttp's streamed answer, its headers leaving with its first bytes: one write,
    not two (aiohttp's own ``Response`` buffers them the same way)."""

    _send_headers_immediately = False


def stream_out(request, headers: dict[str, str]) -> web.StreamResponse:
    """A 200 streamed answer to ``request``, of the kind its listener writes; the
    caller prepares it (``await out.prepare(request)``) and writes."""
    if isinstance(request, FrontRequest):
        return FrontStream(request.conn, headers)
    return StreamOut(status=200, headers=headers)


class FrontRequest:
    """A request read by :class:`FrontConn`: what the router's handlers use of
    aiohttp's ``web.Request``."""

    __slots__ = ("method", "path", "conn", "_lines", "_headers", "_body")

    def __init__(self, conn: FrontConn, method: str, path: str, lines: list, body: bytes):
        self.conn = conn
        self.method = method
        self.path = path
        self._lines = lines  # the head's header lines, checked by _parse_head
        self._headers: CIMultiDict | None = None
        self._body = body

    @property
    def headers(self) -> CIMultiDict:
        """The request's headers (built on first use: most requests never read them)."""
        if self._headers is None:
            pairs = []
            for line in self._lines:
                name, _, value = line.partition(b":")
                pairs.append((name.decode("latin-1"), value.strip().decode("latin-1")))
            self._headers = CIMultiDict(pairs)
        return self._headers

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.conn.transport

    async def read(self) -> bytes:
        return self._body


class FrontStream:
    """A streamed 200 answer on :class:`FrontConn`: chunked, its head sent with the
    first bytes. The subset of ``web.StreamResponse`` the router's streams use."""

    compression = False
    status = 200

    def __init__(self, conn: FrontConn, headers: dict[str, str]):
        self.conn = conn
        self.headers = {**headers, "Transfer-Encoding": "chunked"}
        # made now: headers set after this are not sent (no caller sets any)
        self._head: bytes | None = _head(200, "OK", self.headers, conn.keep_alive)
        self.eof = False

    async def prepare(self, request) -> None:
        """Nothing to do: the head leaves with the first write."""

    async def write(self, data: bytes) -> None:
        """Send ``data`` as one chunk (``b""``: only the head, if not sent yet)."""
        if self.eof:
            if data:
                raise RuntimeError("write after write_eof")
            return
        out = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if self._head is not None:
            out, self._head = self._head + out, None
        if out:
            await self.conn.send(out)

    def take_terminator(self) -> bytes:
        """The answer's last bytes, for a caller that writes them to the transport
        itself with the last chunk (one write, not two); :meth:`write_eof` then has
        nothing left to do. Only once the head is out."""
        assert self._head is None and not self.eof
        self.eof = True
        return b"0\r\n\r\n"

    async def write_eof(self, data: bytes = b"") -> None:
        if self.eof:
            return
        if data:
            await self.write(data)
        end = b"0\r\n\r\n"
        if self._head is not None:
            end, self._head = self._head + end, None
        self.eof = True
        await self.conn.send(end)


class FrontConn(asyncio.Protocol):
    """One client connection: generation requests served here, one at a time in
    order; the connection handed to aiohttp at the first request that is not."""

    def __init__(self, front: Front):
        self.front = front
        self.transport: asyncio.Transport | None = None
        # bytes read and not yet served, in pieces (a large body comes in many: joined
        # once, when it is whole); ``_want``: how many make the next request whole
        self._parts: list[bytes] = []
        self._size = 0
        self._want = 0
        self.task: asyncio.Task | None = None
        self.keep_alive = True
        self.sent = False  # whether any byte of the current answer was written
        self.idle_since = time.monotonic()  # when the last request ended (or none began)
        self._eof = False
        self._paused_reading = False
        self._drain: asyncio.Future | None = None  # set while the transport's buffer is full
        self._writable = True

    # ------------------------------------------------------------------ asyncio
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        tcp_nodelay(transport, True)
        self.front.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.front.conns.discard(self)
        self.transport = None
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: its request is given up
        self._wake_writer(ConnectionResetError("the client went away"))

    def data_received(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self.task is None:
            if self._size >= self._want:
                self._next()
        elif self._size > MAX_PENDING_BYTES and self.transport is not None:
            self.transport.pause_reading()
            self._paused_reading = True

    def eof_received(self) -> bool:
        # a half-closed client may still read the answer under way; nothing more comes
        self._eof = True
        return self.task is not None

    def pause_writing(self) -> None:
        self._writable = False

    def resume_writing(self) -> None:
        self._writable = True
        self._wake_writer(None)

    # ------------------------------------------------------------------ writing
    async def send(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client went away")
        t.write(data)
        self.sent = True
        if not self._writable:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def _wake_writer(self, exc: BaseException | None) -> None:
        w, self._drain = self._drain, None
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    # ------------------------------------------------------------------ requests
    def _buffered(self) -> bytes:
        parts = self._parts
        buf = parts[0] if len(parts) == 1 else b"".join(parts)
        self._parts = [buf] if buf else []
        return buf

    def _next(self) -> None:
        """Start serving the next whole request in the buffer, if there is one."""
        buf = self._buffered()
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES or b"\n\n" in buf:  # too long, or bare LFs
                self._hand_off()
            return
        req = _parse_head(buf[:end], self.front.max_body)
        if req is None:
            self._hand_off()
            return
        path, lines, length, close = req
        start = end + 4
        if len(buf) < start + length:
            self._want = start + length  # the body is still coming
            return
        body, rest = buf[start : start + length], buf[start + length :]
        self._parts, self._size, self._want = ([rest] if rest else []), len(rest), 0
        self.keep_alive = not close
        self.sent = False
        request = FrontRequest(self, "POST", path, lines, body)
        self.task = asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: FrontRequest) -> None:
        resp: web.StreamResponse | None = None
        try:
            resp = await self.front.handler(request)
        except asyncio.CancelledError:
            self._close()
            raise
        except ConnectionResetError:
            self._close()
        except web.HTTPException as e:  # an aiohttp-style answer raised, not returned
            resp = e
        except Exception as e:
            logger.exception("%s %s failed", request.method, request.path)
            resp = None if self.sent else self.front.on_error(e)
        try:
            if isinstance(resp, FrontStream):
                await resp.write_eof()
            elif isinstance(resp, web.Response):
                await self.send(_whole(resp, self.keep_alive))
            else:  # a stream begun and broken, or nothing to send: the connection ends
                self._close()
        except ConnectionResetError:
            self._close()
        except Exception:
            logger.exception("%s %s: its answer could not be written", request.method, request.path)
            self._close()
        self.task = None
        self.idle_since = time.monotonic()
        if not self.keep_alive or self._eof or self.front.closing:
            self._close()
        elif self.transport is not None:
            if self._paused_reading:
                self._paused_reading = False
                self.transport.resume_reading()
            if self._parts:
                self._next()

    def _close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def _hand_off(self) -> None:
        """aiohttp serves this connection from here on, starting with the bytes read."""
        t = self.transport
        if t is None:
            return
        self.front.conns.discard(self)
        proto = self.front.aiohttp_protocol()
        proto.connection_made(t)
        t.set_protocol(proto)
        buf = b"".join(self._parts)
        self._parts, self._size, self._want, self.transport = [], 0, 0, None
        if buf:
            proto.data_received(buf)


def _parse_head(head: bytes, max_body: int):
    """(path, header lines, body length, close) of a request head this listener
    serves, or None for one that aiohttp is to."""
    if len(head) > MAX_HEAD_BYTES:
        return None
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    path = parts[1]
    if path not in HOT_PATHS:
        return None
    del lines[0]
    length = -1
    close = None
    hosts = 0
    for line in lines:
        if len(line) > MAX_LINE_BYTES or _LINE.fullmatch(line) is None:
            return None
        name, _, value = line.partition(b":")
        key = name.lower()
        if key == b"content-length":
            value = value.strip(b" \t")
            if length >= 0 or not value.isdigit():
                return None
            length = int(value)
        elif key == b"host":
            hosts += 1
        elif key == b"connection":
            if close is not None:  # more than one: aiohttp's to weigh
                return None
            close = b"close" in value.lower()
        elif key in _REFUSED:
            return None
    if length < 0 or length > max_body or hosts != 1:
        return None
    return path.decode(), lines, length, bool(close)


def _head(status: int, reason: str, headers, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", f"Date: {_date()}"]
    # a value with a line break (a worker's content type, say) would split the head
    lines += [f"{k}: {v}" for k, v in headers.items() if "\r" not in v and "\n" not in v]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _whole(resp: web.Response, keep_alive: bool) -> bytes:
    """An aiohttp ``Response`` that was never prepared, as the bytes to send."""
    body = resp.body
    if body is None:
        body = b""
    elif not isinstance(body, (bytes, bytearray)):
        raise TypeError(f"a fast-path answer with a {type(body).__name__} body")
    headers = CIMultiDict(resp.headers)
    headers["Content-Length"] = str(len(body))
    headers.pop("Transfer-Encoding", None)
    return _head(resp.status, resp.reason, headers, keep_alive) + bytes(body)


_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


class Front:
    """What the connections share: the handler, aiohttp's protocol factory, the open
    connections (closed when the site stops)."""

    def __init__(
        self,
        handler: Handler,
        aiohttp_protocol: Callable[[], asyncio.Protocol],
        max_body: int,
        on_error: OnError,
    ):
        self.handler = handler
        self.aiohttp_protocol = aiohttp_protocol
        self.max_body = max_body
        self.on_error = on_error
        self.conns: set[FrontConn] = set()
        self.closing = False  # the site is stopping: no new request is begun
        self._janitor: asyncio.Task | None = None

    def start(self) -> None:
        self._janitor = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close connections idle past :data:`KEEPALIVE_S`: no request under way and
        none begun (a request still coming in is not idle)."""
        while True:
            await asyncio.sleep(min(5.0, KEEPALIVE_S / 4))
            cutoff = time.monotonic() - KEEPALIVE_S
            for conn in self.conns.copy():
                if conn.task is None and not conn._size and conn.idle_since < cutoff:
                    conn._close()

    async def close(self, timeout: float) -> None:
        """Close idle connections now; give the requests under way ``timeout`` seconds
        to finish (as aiohttp gives its own connections), then cancel the rest."""
        self.closing = True
        if self._janitor is not None:
            self._janitor.cancel()
        tasks = []
        for conn in list(self.conns):
            if conn.task is not None and not conn.task.done():
                tasks.append(conn.task)
            else:
                conn._close()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:
            task.cancel()
        for conn in list(self.conns):
            conn._close()
        self.conns.clear()
        await asyncio.gather(*tasks, return_exceptions=True)


class FrontSite(web.TCPSite):
    """aiohttp's TCP site with :class:`FrontConn` as the listener's protocol."""

    def __init__(self, runner: web.BaseRunner, front_args: dict, *args, **kwargs):
        super().__init__(runner, *args, **kwargs)
        self._front_args = front_args
        self.front: Front | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registered with the runner (its cleanup stops it)
        server = self._runner.server
        assert server is not None
        self.front = Front(aiohttp_protocol=server, **self._front_args)
        front = self.front
        front.start()
        self._server = await asyncio.get_running_loop().create_server(
            lambda: FrontConn(front),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
        else:
            self._bound_port = self._port

    async def stop(self) -> None:
        await super().stop()
        if self.front is not None:
            await self.front.close(getattr(self._runner, "_shutdown_timeout", 60.0))
