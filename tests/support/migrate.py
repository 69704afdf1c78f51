"""Helpers of the live migration tests (layers, KV blocks, requests): the admin
API key their clusters run with, the migration command line, the agents'
listing through the router, and greedy requests."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import httpx

from bana_sglang.migrate.client import AgentClient
from bana_sglang.wire import agent as m

KEY = "migrate-test-key"  # the admin API key of every cluster these helpers talk to


def cli(c, *args: str) -> subprocess.CompletedProcess:
    """``python -m bana_sglang.migrate --router URL *args`` against cluster ``c``."""
    return subprocess.run(
        [sys.executable, "-m", "bana_sglang.migrate", "--router", c.url, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "BANA_API_KEY": KEY},
    )


def agents(c) -> dict[str, dict]:
    r = httpx.get(
        c.url + "/bana/admin/agents", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    return {a["worker"]: a for a in r.json()["agents"] if "worker" in a}  # not the unreachable ones


def _greedy(url: str, input_ids: list, n: int, key: str | None, ignore_eos: bool):
    """``/generate`` greedy for ``n`` tokens of one prompt or a batch; its JSON answer."""
    sp = {"temperature": 0, "max_new_tokens": n, **({"ignore_eos": True} if ignore_eos else {})}
    r = httpx.post(
        url + "/generate",
        timeout=300,
        headers={"Authorization": f"Bearer {key}"} if key else {},
        json={"input_ids": input_ids, "sampling_params": sp},
    )
    assert r.status_code == 200, r.text
    return r.json()


def generate(
    url: str, ids: list[int], n: int, key: str | None = None, ignore_eos: bool = False
) -> list[int]:
    out = _greedy(url, ids, n, key, ignore_eos)["output_ids"]
    assert not ignore_eos or len(out) == n
    return out


def generate_many(
    url: str, prompts: list[list[int]], n: int, ignore_eos: bool = False
) -> list[list[int]]:
    """:func:`generate` for several prompts in one batched request (the reference
    answers decode together, not one after another)."""
    outs = [x["output_ids"] for x in _greedy(url, prompts, n, None, ignore_eos)]
    assert len(outs) == len(prompts)
    assert not ignore_eos or all(len(o) == n for o in outs)
    return outs


def counter(url: str, name: str) -> float:
    """A counter on a worker's /metrics (SGLang's multiprocess registry)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def prompts_of(seed: int, n: int, base: int = 20, step: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(base + step * i)] for i in range(n)]


def migration(c, worker: str, mid: str) -> dict:
    return next(x for x in agents(c)[worker]["migrations"] if x["migration"] == mid)


def wait_state(c, worker: str, mid: str, states: tuple[str, ...], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while (x := migration(c, worker, mid))["state"] not in states:
        assert time.monotonic() < deadline, x
        time.sleep(0.3)
    return x


def pid_of(c, worker: str) -> int:
    """The pid of ``worker``'s scheduler process (where its agent runs)."""
    client = AgentClient(agents(c)[worker]["agent"], timeout_s=10)
    try:
        return client.call(m.Ping).pid
    finally:
        client.close()
