"""A worker's answer as the router's HTTP/1.1 client (:mod:`.http1`) reads it.

:class:`Response` parses the status line and headers, frames the body
(``Content-Length``, chunked with extensions and trailers, or until the worker
closes) and hands it on three ways: whole (:meth:`Response.read`), piece by piece
(:meth:`Response.readany`, or :meth:`Response.next_bytes` as a future), or pushed to
a callback from the connection's ``data_received`` (:meth:`Response.push`). The
connection (:class:`~.http1._Conn`) feeds it through :meth:`Response.take_head`,
:meth:`Response.take_body`, :meth:`Response.body_done` and :meth:`Response.fail`;
anything that is not HTTP/1.x as read here fails it with :class:`BadResponse`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bana_sglang.router.http1 import _Conn

MAX_HEAD_BYTES = 64 * 1024  # a worker's status line and headers
_CHUNKED, _LENGTH, _UNTIL_CLOSE, _NONE = range(4)
_WS = " \t\r\n\x0b\x0c"  # what bytes.strip() strips (str.strip() strips more)


def _digits(s: str) -> bool:
    return s.isascii() and s.isdigit()


class UpstreamClosed(ConnectionError):
    """The connection to a worker broke (or never opened) before its answer was whole."""


class BadResponse(UpstreamClosed):
    """A worker's answer that is not HTTP/1.1 as this client reads it."""


class Response:
    """A worker's answer: ``status``, ``headers`` (lower-case names), and its body."""

    def __init__(self, conn: _Conn):
        self._conn: _Conn | None = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._framing = _NONE
        self._left = 0  # body bytes still due: of the body (length) or of the chunk (chunked)
        self._chunk_state = 0  # chunked: 0 size line, 1 data, 2 the CRLF after data, 3 trailers
        self._keep_alive = True
        self._buf: list[bytes] = []
        self._waiter: asyncio.Future | None = None
        self._next: asyncio.Future | None = None  # next_bytes()'s, resolved with the bytes
        self._on_data: Callable[[bytes], None] | None = None
        self._on_end: Callable[[BaseException | None], None] | None = None
        self.complete = False  # the whole body came
        self.final = False  # the bytes being delivered are the body's last
        self.error: BaseException | None = None

    @property
    def until_close(self) -> bool:
        """Its body ends when the worker closes the connection (no length, not chunked)."""
        return self._framing == _UNTIL_CLOSE

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip()

    # ------------------------------------------------------------------ reading
    async def readany(self) -> bytes:
        """The body bytes that came since the last call (waiting for some); b"" at its end."""
        while not self._buf:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        """The buffered body bytes, taken."""
        buf = self._buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        return data

    def next_bytes(self) -> asyncio.Future:
        """:meth:`readany` as a future, resolved from the connection's callback (no task
        to wait on): the body bytes that came since the last read, b"" at its end, or
        why it broke. Cancelling it leaves the bytes for the next read."""
        fut = self._next = asyncio.get_running_loop().create_future()
        self._wake()
        return fut

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def push(
        self, on_data: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]
    ) -> None:
        """From now on, hand each piece of the body to ``on_data`` as it comes, from the
        connection's callback, and call ``on_end`` once (None: the body is whole; else
        why it broke). :meth:`pull` goes back to :meth:`readany`."""
        self._on_data, self._on_end = on_data, on_end
        if self._buf:
            on_data(self._take())
        if self.complete or self.error is not None:
            self._end()

    def pull(self) -> None:
        self._on_data = self._on_end = None

    def pause(self) -> None:
        """Stop reading from the worker (the client is slow); :meth:`resume` goes on."""
        if self._conn is not None:
            self._conn.reading(False)

    def resume(self) -> None:
        if self._conn is not None:
            self._conn.reading(True)

    # ------------------------------------------------------------------ ending
    def close(self) -> None:
        """Done with the answer: a whole one's connection is back in the pool already;
        otherwise the connection is closed (the answer is abandoned)."""
        conn, self._conn = self._conn, None
        why = UpstreamClosed("the router closed the connection before the answer's end")
        if conn is not None:
            conn.abort(why)
        self.fail(why)

    # ------------------------------------------------------------------ the connection's side
    def take_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")  # one decode for the whole head
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not _digits(parts[1]):
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadResponse(f"a malformed header line: {line[:80]!r}")
            key = name.strip(_WS).lower()
            val = value.strip(_WS)
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        self._keep_alive = (
            parts[0] == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        )
        if self.status in (204, 304):
            self._framing = _NONE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = _CHUNKED
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise BadResponse(
                    f"a bad Content-Length: {headers['content-length'][:40]!r}"
                ) from None
            self._framing = _LENGTH if self._left else _NONE
        else:
            self._framing, self._keep_alive = _UNTIL_CLOSE, False

    def take_body(self, data: bytes) -> bool:
        """Take body bytes; True once the body is whole (extra bytes are an error)."""
        if self._framing == _CHUNKED:
            return self._chunks(data)
        if self._framing == _LENGTH:
            if len(data) > self._left:
                raise BadResponse("more body bytes than its Content-Length")
            self._left -= len(data)
            self.final = self._left == 0
            self._deliver(data)
            return self.final
        if self._framing == _UNTIL_CLOSE:
            self._deliver(data)
            return False
        if data:
            raise BadResponse("body bytes in an answer that has none")
        return True

    def _chunks(self, data: bytes) -> bool:
        conn = self._conn
        assert conn is not None
        buf = conn.pending + data if conn.pending else data
        conn.pending = b""
        pos, n, out = 0, len(buf), []
        while pos < n:
            state = self._chunk_state
            if state == 1:  # data
                end = min(n, pos + self._left)
                out.append(buf[pos:end])
                self._left -= end - pos
                pos = end
                if self._left == 0:
                    self._chunk_state = 2
                continue
            i = buf.find(b"\r\n", pos)
            if i < 0:
                if n - pos > 4096:
                    raise BadResponse("a chunk-size line longer than 4 KiB")
                conn.pending = buf[pos:]
                break
            line, pos = buf[pos:i], i + 2
            if state == 0 and line.isalnum():  # a plain size: the usual chunk, read at once
                try:
                    size = int(line, 16)
                except ValueError:
                    raise BadResponse(f"a bad chunk size: {line[:40]!r}") from None
                end = pos + size
                if size and end + 2 <= n and buf[end : end + 2] == b"\r\n":
                    out.append(buf[pos:end])
                    pos = end + 2
                    continue
                if size:
                    self._left, self._chunk_state = size, 1
                else:
                    self._chunk_state = 3
                continue
            if state == 2:
                if line:
                    raise BadResponse("no CRLF after a chunk's data")
                self._chunk_state = 0
            elif state == 0:
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise BadResponse(f"a bad chunk size: {line[:40]!r}") from None
                if size:
                    self._left, self._chunk_state = size, 1
                else:
                    self._chunk_state = 3
            elif not line:  # state 3: trailers end with an empty line
                if pos != n:
                    raise BadResponse("bytes after the end of a chunked body")
                self.final = True
                if out:
                    self._deliver(b"".join(out))
                return True
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out))
        return False

    def _deliver(self, data: bytes) -> None:
        if not data:
            return
        if self._on_data is not None:
            self._on_data(data)
            return
        self._buf.append(data)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        nxt = self._next
        if nxt is None:
            return
        if not nxt.done():  # else cancelled: the bytes stay for the next read
            if self._buf:
                nxt.set_result(self._take())
            elif self.error is not None:
                nxt.set_exception(self.error)
            elif self.complete:
                nxt.set_result(b"")
            else:
                return  # nothing yet
        self._next = None

    def body_done(self) -> None:
        """The body is whole: the connection goes back to its pool (or is closed)."""
        self.complete = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(keep=self._keep_alive)
        self._end()

    def fail(self, exc: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = exc
        self._conn = None
        self._end()

    def _end(self) -> None:
        if self._on_end is not None:
            on_end, self._on_data, self._on_end = self._on_end, None, None
            on_end(self.error)
        else:
            self._wake()
