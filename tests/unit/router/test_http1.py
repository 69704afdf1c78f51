"""The router's HTTP/1.1 client (``bana_sglang.router.http1``) against real sockets on
127.0.0.1: raw asyncio servers that write exactly the bytes a test names (framings,
answers cut anywhere, connections dropped or silent) and one aiohttp server for the
keep-alive and streaming paths a worker's own server takes."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from bana_sglang.router.http1 import BadResponse, UpstreamClosed, WorkerHTTP


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class RawServer:
    """Answers each request (read up to its body's end) with ``answer(n)`` (n: the
    request's number on the server), written in pieces of ``step`` bytes with a yield
    (``gap_s``) in between; ``then`` after it: "keep" the connection, "close" it, or "hang"."""

    def __init__(self, answer, *, step: int = 0, then: str = "keep", gap_s: float = 0.0):
        self.answer, self.step, self.then, self.gap_s = answer, step, then, gap_s
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,  # a GET
                )
                self.requests.append(head + await reader.readexactly(length))
                data = self.answer(len(self.requests))
                step = self.step or max(1, len(data))
                for i in range(0, len(data), step):
                    writer.write(data[i : i + step])
                    await writer.drain()
                    await asyncio.sleep(self.gap_s)
                if self.then == "close":
                    writer.close()
                    return
                if self.then == "hang":
                    await asyncio.sleep(3600)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def _chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def _client(**kw) -> WorkerHTTP:
    args = {"limit_per_worker": 8, "connect_timeout_s": 2.0, "read_timeout_s": 30.0} | kw
    return WorkerHTTP({"Authorization": "Bearer k"}, **args)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_each_framing_reads_whole_however_the_bytes_are_cut(step):
    """A body framed by length, by chunks (with an extension and a trailer) or by the
    connection's end reads back whole, whether it comes at once or byte by byte."""
    answers = {
        "length": (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world", "keep"),
        "chunked": (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n",
            "keep",
        ),
        "until close": (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello world", "close"),
    }

    async def go():
        for name, (raw, then) in answers.items():
            async with RawServer(lambda n, raw=raw: raw, step=step, then=then) as url:
                http = _client()
                resp = await http.post(url, "/generate", b'{"a": 1}')
                assert (resp.status, await resp.read()) == (200, b"hello world"), name
                resp = await http.post(url, "/generate", b"{}")  # after a close: a new one
                assert await resp.read() == b"hello world", name
                await http.close()

    run(go())


def test_a_request_carries_the_worker_headers_and_its_own():
    async def go():
        server = RawServer(lambda n: b"HTTP/1.1 204 No Content\r\n\r\n")
        async with server as url:
            http = _client()
            resp = await http.post(url, "/v1/completions", b'{"x":1}', {"X-Extra": "yes"})
            assert resp.status == 204 and await resp.read() == b""
            await http.close()
        head = server.requests[0].lower()
        assert head.startswith(b"post /v1/completions http/1.1\r\n")
        for h in (b"authorization: bearer k", b"content-type: application/json", b"x-extra: yes"):
            assert h in head
        assert head.endswith(b'content-length: 7\r\n\r\n{"x":1}')

    run(go())


def test_a_get_has_no_body_and_its_answer_reads_back_on_the_same_connection():
    async def go():
        body = b'{"loads": []}'
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        server = RawServer(lambda n: raw)
        async with server as url:
            http = _client()
            for _ in range(2):
                resp = await http.get(url, "/v1/loads?include=core")
                assert (resp.status, await resp.read()) == (200, body)
            assert server.connections == 1
            await http.close()
        head = server.requests[0].lower()
        assert head.startswith(b"get /v1/loads?include=core http/1.1\r\n")
        assert b"authorization: bearer k" in head and b"content-length" not in head

    run(go())


def test_a_get_is_outside_the_per_worker_limit():
    async def go():
        body = b"{}"
        whole = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + body
        stuck = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc"  # never whole
        async with RawServer(lambda n: stuck if n == 1 else whole) as url:
            http = _client(limit_per_worker=1)
            held = await http.post(url, "/generate", b"{}")  # holds the only slot
            resp = await asyncio.wait_for(http.get(url, "/v1/loads"), 5)
            assert (resp.status, await resp.read()) == (200, body)
            held.close()
            await http.close()

    run(go())


def test_connections_are_kept_and_reused_unless_the_worker_says_close():
    async def go():
        keep = RawServer(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        close = RawServer(
            lambda n: b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
        )
        for server, want in ((keep, 1), (close, 3)):
            async with server as url:
                http = _client()
                for _ in range(3):
                    assert await (await http.post(url, "/g", b"{}")).read() == b"ok"
                await http.close()
            assert server.connections == want

    run(go())


def test_an_idle_connection_is_closed_before_the_workers_keep_alive_could():
    async def go():
        server = RawServer(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        async with server as url:
            http = _client(idle_s=0.2)
            assert await (await http.post(url, "/g", b"{}")).read() == b"ok"
            await asyncio.sleep(1.5)  # the janitor runs once a second
            assert await (await http.post(url, "/g", b"{}")).read() == b"ok"
            await http.close()
        assert server.connections == 2

    run(go())


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", UpstreamClosed),
        (_chunked(b"one", b"two")[:-12], UpstreamClosed),  # cut inside the chunks
        (b"HTTP/1.1 200 OK\r\nContent-", UpstreamClosed),  # cut inside the head
        (b"SSH-2.0-OpenSSH\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -\r\n\r\n", BadResponse),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nab", BadResponse),
        ("HTTP/1.1 2\u00b2 OK\r\n\r\n".encode("latin-1"), BadResponse),  # a digit, not 0-9
    ],
)
def test_a_cut_or_malformed_answer_fails_the_reader_with_a_connection_error(raw, error):
    async def go():
        async with RawServer(lambda n: raw, then="close") as url:
            http = _client()
            with pytest.raises(error) as e:
                resp = await http.post(url, "/g", b"{}")
                await resp.read()
            assert isinstance(e.value, ConnectionError)
            await http.close()

    run(go())


def test_a_silent_worker_fails_the_read_after_the_read_timeout():
    async def go():
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n"
        async with RawServer(lambda n: raw, then="hang") as url:
            http = _client(read_timeout_s=0.5)
            resp = await http.post(url, "/g", b"{}")
            assert await resp.readany() == b"one"
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await resp.readany()
            assert asyncio.get_running_loop().time() - t0 < 3.0
            await http.close()

    run(go())


def test_nothing_listening_is_a_connection_error_naming_the_worker():
    async def go():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        http = _client()
        with pytest.raises(UpstreamClosed, match=f"127.0.0.1:{port}"):
            await http.post(f"http://127.0.0.1:{port}", "/g", b"{}")
        await http.close()

    run(go())


def test_at_most_limit_requests_are_in_flight_per_worker_and_a_cancel_frees_its_slot():
    async def go():
        async with RawServer(lambda n: b"", then="hang") as url:  # never answers
            http = _client(limit_per_worker=2)
            first = [asyncio.create_task(http.post(url, "/g", b"{}")) for _ in range(2)]
            await asyncio.sleep(0.2)
            third = asyncio.create_task(http.post(url, "/g", b"{}"))
            await asyncio.sleep(0.2)
            pool = http.pool(url)
            assert len(pool.busy) == 2 and not third.done()
            first[0].cancel()  # its connection is closed and its slot freed
            await asyncio.sleep(0.2)
            assert len(pool.busy) == 2 and not third.done()  # the third one is sent now
            for t in (first[1], third):
                t.cancel()
            await asyncio.gather(*first, third, return_exceptions=True)
            assert not pool.busy and not pool.idle
            await http.close()

    run(go())


def test_push_hands_a_stream_over_in_order_and_then_its_end():
    """Against aiohttp's server (a worker's server streams the same way): pieces go to
    the callback as they come, bytes that came before :meth:`push` first, then the end."""

    async def stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        await out.prepare(request)
        for i in range(50):
            await out.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.001)
        await out.write_eof()
        return out

    async def go():
        app = web.Application()
        app.router.add_post("/s", stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        http = _client()
        url = f"http://127.0.0.1:{port}"
        for _ in range(2):  # the second on the kept connection
            resp = await http.post(url, "/s", b"{}")
            got, ended = [await resp.readany()], asyncio.get_running_loop().create_future()
            resp.push(got.append, ended.set_result)
            assert await ended is None
            assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(50))
        assert len(http.pool(url).idle) == 1
        await http.close()
        await runner.cleanup()

    run(go())


class _SlowClient:
    """A client transport whose unsent bytes are whatever ``backlog`` says."""

    def __init__(self, backlog: int):
        self.backlog, self.writes = backlog, []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return self.backlog

    def is_closing(self) -> bool:
        return False


class _Out:
    headers = {"Transfer-Encoding": "chunked"}
    compression = False

    async def write(self, data: bytes) -> None:
        assert data == b""  # the relay only flushes headers through aiohttp


def test_the_relay_stops_reading_the_worker_while_the_client_cannot_keep_up():
    """Chunks go straight to the client's transport, framed; while its unsent bytes are
    over the high-water mark the worker's connection is not read, and once they drain
    the rest follows in order."""
    from types import SimpleNamespace

    from bana_sglang.router.upstream import relay

    parts = [b"data: %d\n\n" % i for i in range(20)]

    async def go():
        server = RawServer(lambda n: _chunked(*parts), step=16)
        async with server as url:
            http = _client()
            resp = await http.post(url, "/s", b"{}")
            up = SimpleNamespace(resp=resp, since=0.0)
            client = _SlowClient(backlog=1 << 20)
            task = asyncio.create_task(relay(up, _Out(), client, None))
            await asyncio.sleep(0.3)
            conn = http.pool(url).busy.copy().pop()
            assert len(client.writes) == 1 and not conn.transport.is_reading()
            client.backlog = 0
            assert await task == b""
            got = b"".join(client.writes)
            assert got == b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in _split(got, parts))
            await http.close()

    run(go())


def _split(framed: bytes, parts: list[bytes]) -> list[bytes]:
    """The payloads of chunk-framed bytes, checked to join into ``parts``."""
    out, pos = [], 0
    while pos < len(framed):
        i = framed.index(b"\r\n", pos)
        n = int(framed[pos:i], 16)
        out.append(framed[i + 2 : i + 2 + n])
        pos = i + 4 + n
    assert b"".join(out) == b"".join(parts)
    return out


def test_a_connection_whose_answer_ended_while_paused_reads_the_next_answer():
    """The relay pauses a worker's connection from inside a piece that also ends the
    answer (a handoff's last event, a full client buffer): the connection goes back to
    the pool and must read the next request's answer."""

    async def go():
        head = len(_chunked()) - len(b"0\r\n\r\n")  # the head first, then the body
        async with RawServer(lambda n: _chunked(b"answer %d" % n), step=head, gap_s=0.2) as url:
            http = _client()
            for n in (1, 2):
                resp = await http.post(url, "/s", b"{}")
                got, ended = [], asyncio.get_running_loop().create_future()

                def on_data(data, resp=resp, got=got):
                    got.append(data)
                    resp.pause()

                resp.push(on_data, ended.set_result)
                assert await asyncio.wait_for(ended, 5) is None
                assert got == [b"answer %d" % n]
            await http.close()

    run(go())


def test_a_decode_half_given_up_after_its_answer_began_is_closed_not_left_open():
    """The router gives a decode half up (its client went away, its prefill failed) after
    the answer's head came but before anyone read it: the connection is closed and its
    slot freed, not held until the worker's stream or the read timeout ends."""
    from bana_sglang.router.dispatch import _drop

    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n"

    async def go():
        async with RawServer(lambda n: raw, then="hang") as url:
            http = _client()
            post = asyncio.ensure_future(http.post(url, "/s", b"{}"))
            await asyncio.sleep(0.3)
            assert post.done() and len(http.pool(url).busy) == 1
            _drop(post, None)
            await asyncio.sleep(0.1)
            assert not http.pool(url).busy and not http.pool(url).idle
            assert post.result().error is not None
            await http.close()

    run(go())


def test_a_paused_connection_is_not_timed_out_for_the_silence_it_was_asked_for():
    """A relay pauses a worker's connection while its client is slow: the pause is not
    the worker's silence. Once reading again, a silent worker times out as before."""
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n"

    async def go():
        async with RawServer(lambda n: raw, then="hang") as url:
            http = _client(read_timeout_s=0.5)
            resp = await http.post(url, "/s", b"{}")
            assert await resp.readany() == b"one"
            resp.pause()
            await asyncio.sleep(2.2)  # two sweeps past the read timeout
            assert resp.error is None
            resp.resume()
            with pytest.raises(TimeoutError):
                await resp.readany()
            await http.close()

    run(go())


def test_begin_sends_at_once_on_an_idle_connection_and_reads_like_post():
    async def go():
        async with RawServer(lambda n: _chunked(b"one", b"two")) as url:
            http = _client()
            assert await (await http.post(url, "/g", b"{}")).read() == b"onetwo"  # one idle conn
            head = http.begin(url, "/g", b"{}")
            assert not isinstance(head, asyncio.Task)  # the connection's own future
            resp = await head
            assert resp.status == 200
            assert await resp.next_bytes() in (b"one", b"onetwo")
            await resp.read()
            # no idle connection: a task opens one, and the answer is the same
            head = http.begin(url, "/g", b"{}")
            other = http.begin(url, "/g", b"{}")
            assert isinstance(other, asyncio.Task)
            assert [await (await f).read() for f in (head, other)] == [b"onetwo", b"onetwo"]
            await http.close()

    run(go())


def test_a_begun_request_cancelled_before_its_head_closes_its_connection_and_frees_its_slot():
    async def go():
        async with RawServer(
            lambda n: b"" if n == 2 else b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            then="keep",
        ) as url:
            http = _client(limit_per_worker=1)
            assert await (await http.post(url, "/g", b"{}")).read() == b"ok"
            pool = http.pool(url)
            head = http.begin(url, "/g", b"{}")  # the worker never answers this one
            await asyncio.sleep(0.1)
            assert len(pool.busy) == 1 and not head.done()
            head.cancel()
            await asyncio.sleep(0.1)
            assert not pool.busy and not pool.idle  # closed, not pooled
            # the slot is free again: the next request goes out and is answered
            assert await (await http.post(url, "/g", b"{}")).read() == b"ok"
            await http.close()

    run(go())


def test_next_bytes_gives_what_came_then_the_end_or_why_it_broke():
    async def go():
        raw = _chunked(b"one", b"two")
        async with RawServer(lambda n: raw, step=len(raw) - 5, gap_s=0.1) as url:
            http = _client()
            resp = await http.post(url, "/g", b"{}")
            first = resp.next_bytes()
            assert not first.done() or first.result()
            assert (await first) in (b"one", b"onetwo")
            pending = resp.next_bytes()
            pending.cancel()  # a cancelled wait leaves the bytes for the next read
            rest = b""
            while chunk := await resp.next_bytes():
                rest += chunk
            assert (await first) + rest == b"onetwo" and resp.complete
            assert await resp.next_bytes() == b""
            await http.close()
        cut = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"
        async with RawServer(lambda n: cut, then="close") as url:
            http = _client()
            resp = await http.post(url, "/g", b"{}")
            got = b""
            with pytest.raises(UpstreamClosed):
                while chunk := await resp.next_bytes():
                    got += chunk
            assert got == b"half"
            await http.close()

    run(go())


def test_a_waiter_cancelled_after_it_was_handed_a_slot_gives_the_slot_on():
    async def go():
        async with RawServer(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as url:
            http = _client(limit_per_worker=1)
            pool = http.pool(url)
            await pool._acquire()  # the only slot
            waiter = asyncio.create_task(pool._acquire())
            queued = asyncio.create_task(http.post(url, "/g", b"{}"))
            await asyncio.sleep(0.05)
            pool._release()  # handed to the waiter, which is cancelled before it runs
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            assert await (await asyncio.wait_for(queued, 5)).read() == b"ok"
            assert pool._free == 1 and not pool._queue
            await http.close()

    run(go())
