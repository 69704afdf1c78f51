"""The router in this process against fake PD workers (``bench.fake_pd``), real HTTP on
127.0.0.1: what the router unit tests share."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from bana_sglang.router.config import RouterConfig
from bana_sglang.router.server import Router
from bench.fake_pd import FakeWorker, free_port


@contextlib.asynccontextmanager
async def running(prefill: list[FakeWorker], decode: list[FakeWorker], **cfg_kw):
    """Start the fakes and a router over them; yield (router, client session)."""
    for f in prefill + decode:
        await f.start()
    port = free_port()
    cfg = RouterConfig(
        prefill=tuple((f.url, f.boot) for f in prefill),
        decode=tuple(f.url for f in decode),
        port=port,
        poll_interval_s=0.05,
        probe_min_s=0.05,
        probe_max_s=0.2,
        **cfg_kw,
    )
    router = Router(cfg)
    runner = web.AppRunner(router.build_app())
    await runner.setup()
    await router.site(runner, "127.0.0.1", port).start()
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
        for _ in range(100):  # until it knows the model
            async with client.get("/health", headers=auth_headers(cfg_kw)) as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        try:
            yield router, client
        finally:
            await runner.cleanup()
            for f in prefill + decode:
                await f.stop()


def auth_headers(kw) -> dict:
    """The client key header for a router started with ``api_key`` in ``kw``."""
    return {"Authorization": f"Bearer {kw['api_key']}"} if kw.get("api_key") else {}


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))
