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
  ``freeze_stream`` (after two stream chunks the whole worker stops answering,
  streams, ``/health`` and ``/v1/loads`` alike, keeping its connections open, as a
  SIGSTOPped process does, until :meth:`FakeWorker.stop`), ``frozen`` (the same
  from the start: requests are taken in and never answered),
  ``kv_lost_once`` (decode: the first request ends 503 "KV blocks lost", as a
  decode worker whose KV-block host died answers), ``store_load_503_once`` (the
  first request ends 503 "External KV cache load failed", as a prefill worker
  whose global-store load failed answers), ``stream_abort_once`` (prefill: the first
  *streamed* request is answered 200 with one event whose finish reason is that abort
  and its KV is never sent, as SGLang 0.5.23 streams it), ``abort_once`` (with ``ids``: the first
  stream ends at once with an abort finish reason and no token, as SGLang streams a
  request aborted before its first token);
  ``loads_delay_s`` makes ``/v1/loads`` slow, as a CPU worker busy in a long
  prefill is; ``hang_nth`` (prefill): its n-th request (from 1) is taken in and never
  answered while the worker answers everything else, as a PD bootstrap handshake that
  never completes;
- ``ids=True``: streams carry SGLang's token ids (``/generate``: cumulative
  ``output_ids``, ``prompt_token_ids`` when asked; ``/v1/completions``: each
  chunk's ``token_ids``, the first one's ``prompt_token_ids`` when
  ``return_token_ids``; ``/v1/chat/completions``: chat chunks, with ``bana_ids``
  events when asked with the header bana's workers take, see
  :mod:`bana_sglang.plugin.chat_ids`), and the answer is a pure function of the ids so far
  (:func:`next_token`), so a continuation from prompt + answer-so-far gives
  exactly the rest of the answer, as greedy decoding does.

Rooms are shared by the fakes of one process. ``python -m bench.fake_pd``
runs a prefill and a decode fake as a separate process (benchmarks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from aiohttp import web

from bana_sglang.launch.procs import PortAllocator
from bana_sglang.wire.agent import CHAT_IDS_HEADER

MODEL = "fake-model"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


# Below the kernel's ephemeral range (32768+ on Linux), where an outgoing connection
# made between choosing a port and binding it could take it first (seen in CI: a
# router's port taken while its fakes polled each other), and below the launcher's
# and the live tests' ports (30000+). One block per process so that two processes
# (a bench and its fakes, two test runs) rarely probe the same ports.
_PORTS = PortAllocator("127.0.0.1", 20000 + (os.getpid() % 4) * 2000, end=30000)


def free_port() -> int:
    """A port free now, for a server that binds it later in this process or a child."""
    return _PORTS.take()


def next_token(ids: list[int]) -> int:
    """The fakes' "greedy model": the next token of a sequence (``ids=True``)."""
    return (sum(ids) * 31 + len(ids)) % 997


def fake_answer(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def _prompt_ids(body: dict, path: str) -> list[int]:
    if path == "/v1/chat/completions":  # a "chat template": the messages' contents
        msgs = body.get("messages") or []
        return [1, *"".join(str(m.get("content", "")) for m in msgs).encode()]
    v = body.get("input_ids") if path == "/generate" else body.get("prompt")
    if isinstance(v, list) and all(type(x) is int for x in v):
        return list(v)
    text = str(body.get("text") if path == "/generate" else v)
    return [1, *text.encode()]  # as a tokenizer with a BOS would


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
        hang_nth: int = 0,
        ids: bool = False,
        chat_ids: bool = True,
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
        self.hang_nth = hang_nth  # prefill: this request (from 1) never gets an answer
        self.ids = ids  # streams carry token ids (see the module doc)
        self.chat_ids = chat_ids  # chat streams carry them when asked (bana's workers; stock: no)
        self.bodies: list[dict] = []
        self.in_flight = self.most_in_flight = 0  # requests being answered, now and at most
        self.frozen = mode == "frozen"  # the worker answers nothing, as if stopped
        self._thaw = asyncio.Event()
        self.runner: web.AppRunner | None = None

    def _room(self, r: int) -> asyncio.Event:
        return FakeWorker.rooms.setdefault(r, asyncio.Event())

    async def start(self) -> None:
        if self.mode == "refuse":
            return  # nothing listens on the port
        # SGLang's HTTP server takes bodies of any size; aiohttp's default is 1 MiB
        app = web.Application(client_max_size=1 << 26)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/loads", self.loads)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.handle)
        # SGLang aborts a request whose client went away: so do the fakes.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self._thaw.set()
        if self.runner:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        if self.frozen:
            await self._thaw.wait()
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.frozen:
            await self._thaw.wait()
        return web.json_response({})

    async def _freeze(self) -> None:
        self.frozen = True
        await self._thaw.wait()

    async def loads(self, request: web.Request) -> web.Response:
        if self.frozen:
            await self._thaw.wait()
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
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._handle(request)
        finally:
            self.in_flight -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.frozen:
            await self._thaw.wait()
        if self.mode == "error500":
            return web.json_response({"error": "boom"}, status=500)
        room = body.get("bootstrap_room")
        if self.mode == "store_load_503_once" and len(self.bodies) == 1:
            # SGLang's answer when a global-store load failed after it started
            return web.json_response(
                {"object": "error", "message": "External KV cache load failed", "code": 503},
                status=503,
            )
        if self.mode == "stream_abort_once" and len(self.bodies) == 1 and body.get("stream"):
            fr = {"type": "abort", "message": "External KV cache load failed", "status_code": 503}
            if request.path == "/generate":
                ev: dict = {"text": "", "output_ids": [], "meta_info": {"finish_reason": fr}}
            else:
                err = {"message": fr["message"], "type": "SERVICE_UNAVAILABLE", "code": 503}
                ev = {"error": {"object": "error", "param": None, **err}}
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        if self.role == "prefill":
            if self.mode == "hang" or len(self.bodies) == self.hang_nth:
                # an unreachable host (or a handshake that never completes): nothing
                # comes back, no KV is sent
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
        if self.ids:
            return await self._stream_ids(request, resp, body)
        for i in range(self.chunks):
            await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await asyncio.sleep(self.chunk_delay_s)
            if self.mode == "break_stream" and i == 1:
                request.transport.close()
                return resp
            if self.mode == "freeze_stream" and i == 1:
                await self._freeze()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _stream_ids(
        self, request: web.Request, resp: web.StreamResponse, body: dict
    ) -> web.StreamResponse:
        path = request.path
        prompt = _prompt_ids(body, path)
        if path == "/generate":
            n = (body.get("sampling_params") or {}).get("max_new_tokens", 128)
        else:
            n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        answer = fake_answer(prompt, n)
        chat = path == "/v1/chat/completions"
        chat_ids = chat and self.chat_ids and request.headers.get(CHAT_IDS_HEADER) == "1"
        if self.mode == "abort_once" and len(self.bodies) == 1:
            # what SGLang streams for a request aborted before its first token
            if path == "/generate":
                fr = {"type": "abort", "message": "Aborted by AbortReq."}
                ev0: dict = {"text": "", "output_ids": [], "meta_info": {"finish_reason": fr}}
            else:
                ev0 = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
            await resp.write(b"data: " + json.dumps(ev0).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        for i, tok in enumerate(answer):
            last = i == len(answer) - 1
            if path == "/generate":
                ev: dict = {
                    "text": "".join(f" {t}" for t in answer[: i + 1]),
                    "output_ids": answer[: i + 1],
                    "meta_info": {
                        "id": "fake",
                        "prompt_tokens": len(prompt),
                        "completion_tokens": i + 1,
                        "finish_reason": {"type": "length", "length": n} if last else None,
                    },
                }
                if body.get("return_prompt_token_ids"):
                    ev["prompt_token_ids"] = prompt
            elif chat:  # SGLang's streamed chat: no ids, unless asked as bana's workers are
                fr = "length" if last else None
                choice = {"index": 0, "delta": {"content": f" {tok}"}, "finish_reason": fr}
                ev = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [choice]}
                if chat_ids:
                    ids: dict = {"prompt_ids": prompt, "ids": [tok]} if i == 0 else {"ids": [tok]}
                    await resp.write(
                        b"event: bana_ids\ndata: " + json.dumps(ids).encode() + b"\n\n"
                    )
            else:
                choice: dict = {
                    "index": 0,
                    "text": f" {tok}",
                    "finish_reason": "length" if last else None,
                }
                if body.get("return_token_ids"):
                    choice["token_ids"] = [tok]
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                ev = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await asyncio.sleep(self.chunk_delay_s)
            if self.mode == "break_stream" and i == 1:
                request.transport.close()
                return resp
            if self.mode == "freeze_stream" and i == 1:
                await self._freeze()
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
