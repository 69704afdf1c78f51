"""Fake SGLang PD workers: cheap, deterministic upstreams for router tests and
the router-overhead benchmark.

They speak the part of the PD contract a router depends on:

- ``/health``, ``/v1/models``, ``/v1/loads`` like SGLang 0.5.23;
- ``/generate``, ``/v1/completions``, ``/v1/chat/completions``;
- the decode side answers a request only after the prefill side has seen the
  same ``bootstrap_room`` (so a router that forgets to cancel a decode request
  after its prefill failed waits forever, as with real workers), unless the
  prefill got SGLang's fake bootstrap host (prompt-only requests);
- a prefill answer carries SGLang 0.5.23's logprob window shape: the first
  entry of a ``logprob_start_len`` window is ``None``;
- ``mode`` injects faults: ``refuse`` (nothing listens), ``hang`` (prefill:
  accepts, never answers, sends no KV: an unreachable host), ``error500``,
  ``break_stream`` (the connection drops after two stream chunks),
  ``kv_lost_once`` (decode: the first request ends 503 "KV blocks lost", as a
  decode worker whose KV-block host died answers), ``store_load_503_once`` (the
  first request ends 503 "External KV cache load failed", as a prefill worker
  whose global-store load failed answers);
  ``loads_delay_s`` makes ``/v1/loads`` slow, as a CPU worker busy in a long
  prefill is.

Rooms are shared by the fakes of one process. ``python -m bench.fake_pd``
runs a prefill and a decode fake as a separate process (benchmarks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys

from aiohttp import web

MODEL = "fake-model"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answer(payload: dict):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(payload)

    return handler


class FakeWorker:
    """One fake worker (``role`` prefill or decode) on its own port."""

    rooms: dict[int, asyncio.Event] = {}

    def __init__(
        self,
        role: str,
        mode: str = "ok",
        *,
        port: int | None = None,
        chunks: int = 4,
        chunk_delay_s: float = 0.01,
        prefill_delay_s: float = 0.0,
        loads_delay_s: float = 0.0,
        kv_wait_s: float = 30.0,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role, self.mode = role, mode
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.boot = free_port()
        self.chunks, self.chunk_delay_s, self.prefill_delay_s = (
            chunks,
            chunk_delay_s,
            prefill_delay_s,
        )
        self.loads_delay_s = loads_delay_s  # a busy worker answers /v1/loads late
        self.kv_wait_s = kv_wait_s  # decode: how long to wait for the prefill's KV before a 500
        self.bodies: list[dict] = []
        self.runner: web.AppRunner | None = None

    def _room(self, r: int) -> asyncio.Event:
        return FakeWorker.rooms.setdefault(r, asyncio.Event())

    async def start(self) -> None:
        if self.mode == "refuse":
            return  # nothing listens on the port
        app = web.Application()
        app.router.add_get("/health", _answer({}))
        app.router.add_get("/v1/models", _answer({"object": "list", "data": [{"id": MODEL}]}))
        app.router.add_get("/v1/loads", self.loads)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.handle)
        # SGLang aborts a request whose client went away: so do the fakes.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()

    async def loads(self, request: web.Request) -> web.Response:
        if self.loads_delay_s:
            await asyncio.sleep(self.loads_delay_s)
        return web.json_response(
            {
                "loads": [
                    {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000}
                ]
            }
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "error500":
            return web.json_response({"error": "boom"}, status=500)
        room = body.get("bootstrap_room")
        if self.mode == "store_load_503_once" and len(self.bodies) == 1:
            # SGLang's answer when a global-store load failed after it started
            return web.json_response(
                {"object": "error", "message": "External KV cache load failed", "code": 503},
                status=503,
            )
        if self.role == "prefill":
            if self.mode == "hang":  # an unreachable host: nothing comes back, no KV is sent
                await asyncio.sleep(3600)
            if self.prefill_delay_s:
                await asyncio.sleep(self.prefill_delay_s)
            if body.get("bootstrap_host") != FAKE_BOOTSTRAP_HOST:
                self._room(room).set()
            n = len(str(body.get("text", "x")).split())
            start = body.get("logprob_start_len") or 0  # SGLang: null is the default
            lps = [[None if i == start else -1.0 - i, i, f"t{i}"] for i in range(start, n)]
            return web.json_response(
                {
                    "text": "p",
                    "output_ids": [7],
                    "meta_info": {"input_token_logprobs": lps, "prompt_tokens": n},
                }
            )
        try:
            await asyncio.wait_for(self._room(room).wait(), timeout=self.kv_wait_s)
        except TimeoutError:  # what SGLang's decode answers when its prefill peer is gone
            return web.json_response(
                {
                    "error": {
                        "message": f"KVTransferError(bootstrap_room={room}): "
                        "Prefill instance could be dead"
                    }
                },
                status=500,
            )
        FakeWorker.rooms.pop(room, None)
        if self.mode == "kv_lost_once" and len(self.bodies) == 1:
            return web.json_response(
                {
                    "object": "error",
                    "message": "KV blocks lost: no answer from the KV host",
                    "code": 503,
                },
                status=503,
            )
        if not body.get("stream"):
            return web.json_response(
                {
                    "text": "decoded",
                    "output_ids": list(range(self.chunks)),
                    "meta_info": {"input_token_logprobs": [], "room": room},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await asyncio.sleep(self.chunk_delay_s)
            if self.mode == "break_stream" and i == 1:
                request.transport.close()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.fake_pd",
        description="A fake SGLang prefill + decode pair (for router benchmarks).",
    )
    p.add_argument("--prefill-port", type=int, required=True)
    p.add_argument("--decode-port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=16, help="stream chunks per decode answer")
    p.add_argument("--chunk-delay", type=float, default=0.02, help="seconds between chunks")
    p.add_argument("--prefill-delay", type=float, default=0.005, help="seconds a prefill takes")
    a = p.parse_args(argv)

    async def run() -> None:
        pf = FakeWorker("prefill", port=a.prefill_port, prefill_delay_s=a.prefill_delay)
        dc = FakeWorker("decode", port=a.decode_port, chunks=a.chunks, chunk_delay_s=a.chunk_delay)
        await pf.start()
        await dc.start()
        print("fake-pd ready", flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
