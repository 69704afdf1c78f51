"""The router's listener (:mod:`bana_sglang.router.front`): generation requests on its
own path, everything else handed to aiohttp, both on the same connection.

Real router over fake PD workers on 127.0.0.1, driven by raw sockets so that the
exact bytes on the wire are seen. Which path answered shows in the ``Server``
header: aiohttp sends its own, the fast path sends none.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support.fake_router import run, running

from bana_sglang.router import front
from bench.fake_pd import MODEL, FakeWorker

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": True}


def post(path: str, body: dict | bytes, extra: str = "", version: str = "1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: (status, headers with lower-case names, body de-chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10))[:-2], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return status, headers, body


def fakes(**kw) -> tuple[list[FakeWorker], list[FakeWorker]]:
    return [FakeWorker("prefill")], [FakeWorker("decode", chunks=3, **kw)]


async def connect(router):
    return await asyncio.open_connection("127.0.0.1", router.cfg.port)


def test_stream_on_the_fast_path_then_aiohttp_on_the_same_connection():
    async def go():
        async with running(*fakes()) as (router, _):
            r, w = await connect(router)
            w.write(post("/v1/completions", BODY) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await answer(r)
            assert status == 200 and "server" not in headers  # the fast path
            assert headers["content-type"].startswith("text/event-stream")
            assert headers["transfer-encoding"] == "chunked" and "date" in headers
            events = [e for e in body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and len(events) == 4
            status, headers, body = await answer(r)  # pipelined: handed to aiohttp
            assert status == 200 and "aiohttp" in headers["server"]
            assert json.loads(body)["status"] in ("ok", "degraded")
            w.write(post("/v1/completions", BODY))  # aiohttp keeps the connection now
            status, headers, _ = await answer(r)
            assert status == 200 and "aiohttp" in headers["server"]
            w.close()

    run(go())


def test_keep_alive_answers_in_order_and_json_answers_have_a_length():
    async def go():
        async with running(*fakes()) as (router, _):
            r, w = await connect(router)
            plain = dict(BODY, stream=False)
            w.write(post("/v1/completions", plain) + post("/v1/completions", BODY))
            status, headers, body = await answer(r)
            assert status == 200 and "server" not in headers
            assert int(headers["content-length"]) == len(body)
            assert json.loads(body)["text"] == "decoded"  # the fake decode worker's answer
            status, headers, body = await answer(r)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
            w.write(post("/v1/completions", BODY, extra="Connection: close\r\n"))
            status, headers, body = await answer(r)
            assert status == 200 and headers.get("connection") == "close"
            assert await asyncio.wait_for(r.read(), 5) == b""  # and closed
            w.close()

    run(go())


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (post("/v1/completions", BODY, version="1.0"), 200),  # HTTP/1.0
        (post("/v1/completions?x=1", BODY), 200),  # a query string
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(json.dumps(BODY)), json.dumps(BODY).encode()),
            200,
        ),
        (post("/v1/completions", BODY, extra="Bad header line\r\n"), 400),
        (post("/v1/completions", {"prompt": "x" * 2048}), 413),  # over --max-body-bytes
    ],
    ids=["http10", "query", "chunked-body", "malformed-head", "too-large"],
)
def test_what_the_fast_path_does_not_take_is_aiohttps(request_bytes, status):
    async def go():
        async with running(*fakes(), max_body_bytes=1024) as (router, _):
            r, w = await connect(router)
            w.write(request_bytes)
            got, headers, body = await answer(r)
            assert got == status, body
            assert "aiohttp" in headers["server"]
            if status == 413:
                assert "max-body-bytes" in json.loads(body)["error"]["message"]
            w.close()

    run(go())


def test_a_body_that_comes_in_pieces_is_served_whole_on_the_fast_path():
    async def go():
        async with running(*fakes()) as (router, _):
            r, w = await connect(router)
            big = dict(BODY, prompt="y" * 300_000)
            data = post("/v1/completions", big) + post("/v1/completions", BODY)
            for i in range(0, len(data), 8192):
                w.write(data[i : i + 8192])
                await w.drain()
                await asyncio.sleep(0)
            for _ in range(2):
                status, headers, body = await answer(r)
                assert status == 200 and "server" not in headers
                assert body.endswith(b"data: [DONE]\n\n")
            w.close()

    run(go())


def _raw(head_lines: list[bytes], body: bytes = b"{}") -> bytes:
    return b"\r\n".join([b"POST /v1/completions HTTP/1.1", *head_lines]) + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    "request_bytes",
    [
        _raw([b"Host: x", b"X-A: 1\nTransfer-Encoding: chunked", b"Content-Length: 2"]),
        _raw([b"Host: x", b"Transfer Encoding: chunked", b"Content-Length: 2"]),
        _raw([b"Host: x", b"\x0bTransfer-Encoding: chunked", b"Content-Length: 2"]),
        _raw([b"Host: x", b"X-A: a\x00b", b"Content-Length: 2"]),
        _raw([b"Host: x", b"Content-Length: \x0b2"]),
        _raw([b"Content-Length: 2"]),  # no Host
        _raw([b"Host: x", b"Host: y", b"Content-Length: 2"]),
        _raw([b"Host: x", b"Connection: close", b"Connection: keep-alive", b"Content-Length: 2"]),
        _raw([b"Host: x", b"X-Long: " + b"a" * 9000, b"Content-Length: 2"]),
        b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",  # bare LFs
    ],
    ids=[
        "bare-lf",
        "space-in-name",
        "vt-in-name",
        "nul-in-value",
        "vt-in-length",
        "no-host",
        "two-hosts",
        "two-connections",
        "long-line",
        "lf-only",
    ],
)
def test_a_head_the_fast_path_would_read_differently_from_aiohttp_is_aiohttps(request_bytes):
    """Whatever aiohttp's parser refuses or weighs differently never reaches the fast path
    (a proxy in front reading it aiohttp's way could otherwise be smuggled past)."""

    async def go():
        async with running(*fakes()) as (router, _):
            r, w = await connect(router)
            w.write(request_bytes)
            status, headers, body = await answer(r)
            assert "aiohttp" in headers.get("server", ""), (status, body)
            w.close()

    run(go())


def test_a_request_still_coming_in_is_not_idle(monkeypatch):
    monkeypatch.setattr(front, "KEEPALIVE_S", 0.3)

    async def go():
        async with running(*fakes()) as (router, _):
            r, w = await connect(router)
            data = post("/v1/completions", BODY)
            w.write(data[:-10])
            await asyncio.sleep(0.8)  # past the keep-alive time, mid-body
            w.write(data[-10:])
            status, _, body = await answer(r)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
            w.close()

    run(go())


def test_a_stream_under_way_when_the_router_stops_is_finished():
    async def go():
        async with running(*fakes(chunk_delay_s=0.2)) as (router, _):
            r, w = await connect(router)
            w.write(post("/v1/completions", BODY))
            await asyncio.wait_for(r.readuntil(b"data:"), 10)  # the stream began
            stopping = asyncio.ensure_future(router.listener.front.close(10.0))
            rest = await asyncio.wait_for(r.read(), 10)  # to the connection's end
            assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
            await stopping
            w.close()

    run(go())


def test_the_client_key_is_checked_on_the_fast_path():
    async def go():
        async with running(*fakes(), api_key="k3y") as (router, _):
            r, w = await connect(router)
            w.write(post("/v1/completions", BODY))
            status, headers, body = await answer(r)
            assert status == 401 and "server" not in headers
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            w.write(post("/v1/completions", BODY, extra="Authorization: Bearer k3y\r\n"))
            status, _, body = await answer(r)
            assert status == 200 and body.endswith(b"data: [DONE]\n\n")
            w.close()

    run(go())


def test_a_router_bug_is_a_json_500_and_the_connection_serves_on(monkeypatch):
    async def go():
        async with running(*fakes()) as (router, _):
            real = router._openai

            async def broken(request, path, label):
                if label == "completions":
                    raise KeyError("boom")
                return await real(request, path, label)

            monkeypatch.setattr(router, "_openai", broken)
            r, w = await connect(router)
            w.write(post("/v1/completions", BODY) + post("/v1/chat/completions", BODY))
            status, _, body = await answer(r)
            assert status == 500 and "KeyError" in json.loads(body)["error"]["message"]
            status, _, _ = await answer(r)  # the next request on it is still served
            assert status in (200, 400)
            w.close()

    run(go())


def test_a_client_that_goes_away_has_its_stream_given_up():
    async def go():
        async with running(*fakes(chunk_delay_s=0.2)) as (router, _):
            r, w = await connect(router)
            w.write(post("/v1/completions", dict(BODY, max_tokens=50)))
            await asyncio.wait_for(r.readuntil(b"data:"), 10)  # the stream began
            conns = router.listener.front.conns
            site_conns = lambda: [c for c in conns if c.task is not None]  # noqa: E731
            assert site_conns()
            w.close()
            for _ in range(100):  # the handler task is cancelled with the connection
                if not site_conns():
                    break
                await asyncio.sleep(0.05)
            assert not site_conns()
            inflight = sum(wk.inflight for wk in router.workers)
            assert inflight == 0

    run(go())


def test_an_idle_connection_is_closed(monkeypatch):
    monkeypatch.setattr(front, "KEEPALIVE_S", 0.2)

    async def go():
        async with running(*fakes()) as (router, _):
            r, w = await connect(router)
            w.write(post("/v1/completions", BODY))
            status, _, _ = await answer(r)
            assert status == 200
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed by the router
            w.close()

    run(go())
