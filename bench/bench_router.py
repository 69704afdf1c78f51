"""Router overhead: latency the router adds per request, at 100+ concurrent streams.

``python -m bench.bench_router`` starts a fake PD pair (``bench.fake_pd``, a
separate process whose prefill answers after ``--prefill-delay`` and whose
decode streams ``--chunks`` chunks ``--chunk-delay`` apart) and the real
router (``python -m bana_sglang.router``, its own process) in front of it.
The client then sends the same streaming requests several ways, with open-loop
Poisson arrivals at the rate that keeps ``--streams`` requests in flight on
average, rotating the order every round so that machine noise hits all alike:

- **direct**: the client pairs prefill and decode itself (the bootstrap fields,
  both requests at once), i.e. routing with zero overhead;
- **bana router**: through our router (policy ``bana``: load snapshots, pairing,
  accounting, relaying);
- **stock sglang_router**: through SGLang's Rust router in PD mode, the same
  job in compiled code (skip with ``--no-stock``).

It prints time to first chunk and end-to-end latency at p50/p99 for each arm,
what each router adds over direct, and each router's CPU per request, and
saves the numbers
under ``bench/runs/``. Fake workers keep the upstream cost fixed and tiny, so
the difference is the router's own; with real SGLang workers the same
milliseconds would hide under model time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bana_sglang import compat
from bana_sglang.launch.procs import http_ok
from bench.fake_pd import free_port

RUNS = Path(__file__).resolve().parent / "runs"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict, prefill: str | None
) -> tuple[float, float]:
    t0 = time.perf_counter()
    p_task = None
    if prefill is not None:  # direct: the client does the PD pairing itself
        body = dict(
            body,
            bootstrap_host="127.0.0.1",
            bootstrap_port=1,
            bootstrap_room=random.getrandbits(63),
        )
        p_task = asyncio.create_task(session.post(prefill + "/v1/completions", json=body))
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        first = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        end = time.perf_counter() - t0
    if p_task is not None:
        (await p_task).release()
    return first or end, end


async def _arm(
    session, url, prefill, n: int, rate: float, rng: random.Random
) -> tuple[list[float], list[float]]:
    """``n`` requests with Poisson arrivals at ``rate``/s (open loop)."""
    body = {
        "model": "fake-model",
        "prompt": "benchmark the router " * 8,
        "max_tokens": 16,
        "stream": True,
    }
    tasks = []
    t = time.perf_counter()
    for _ in range(n):
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        tasks.append(asyncio.create_task(_one(session, url, body, prefill)))
    out = await asyncio.gather(*tasks)
    return [a for a, _ in out], [b for _, b in out]


@dataclasses.dataclass
class Arm:
    """One way of sending the requests: straight to the fakes, or through a router."""

    name: str
    url: str
    prefill: str | None = None  # set: the client pairs prefill and decode itself
    proc: subprocess.Popen | None = None  # a router process, whose CPU is measured
    ttft: list[float] = dataclasses.field(default_factory=list)
    e2e: list[float] = dataclasses.field(default_factory=list)
    cpu_s: float = 0.0
    user_s: float = 0.0


async def measure(
    arms: list[Arm], *, requests: int, streams: int, rounds: int, duration_s: float
) -> dict:
    """Rotate through the arms for ``rounds`` rounds at the arrival rate that keeps
    ``streams`` requests in flight on average (Little's law: rate = streams / duration)."""
    import psutil
    from tqdm import tqdm

    rate = streams / duration_s
    rng = random.Random(streams)
    per = max(1, requests // rounds)
    for arm in arms:
        arm.ttft, arm.e2e, arm.cpu_s, arm.user_s = [], [], 0.0, 0.0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        for arm in arms:  # warm every path's connections
            await _arm(s, arm.url, arm.prefill, min(per, streams), rate, rng)
        with tqdm(
            total=len(arms) * rounds * per, desc=f"{streams} streams ({rate:.0f} req/s)", unit="req"
        ) as bar:
            for r in range(rounds):
                for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                    proc = psutil.Process(arm.proc.pid) if arm.proc else None
                    c0 = proc.cpu_times() if proc else None
                    ttft, e2e = await _arm(s, arm.url, arm.prefill, per, rate, rng)
                    if proc:
                        c1 = proc.cpu_times()
                        arm.user_s += c1.user - c0.user
                        arm.cpu_s += c1.user + c1.system - c0.user - c0.system
                    arm.ttft.extend(ttft)
                    arm.e2e.extend(e2e)
                    bar.update(per)
    n = rounds * per
    out: dict = {
        "streams": streams,
        "rate_per_s": round(rate, 2),
        "requests_per_arm": n,
        "arms": {},
    }
    direct = arms[0]
    for arm in arms:
        row: dict = {}
        if arm.proc:
            row["cpu_ms_per_request"] = round(1e3 * arm.cpu_s / n, 3)
            row["user_cpu_ms_per_request"] = round(1e3 * arm.user_s / n, 3)
        for metric in ("ttft", "e2e"):
            for q in (50, 90, 99):
                v = pct(getattr(arm, metric), q) * 1e3
                row[f"{metric}_p{q}_ms"] = round(v, 3)
                row[f"{metric}_p{q}_added_ms"] = round(v - pct(getattr(direct, metric), q) * 1e3, 3)
        out["arms"][arm.name] = row
    return out


def _pinned(cpus: set[int] | None):
    """A ``preexec_fn`` that pins the child (and every thread it will start) to ``cpus``."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _start_router(
    kind: str, port: int, pp: int, dp: int, policy: str, cpus: set[int] | None = None
) -> subprocess.Popen:
    if kind == "bana":
        argv = [
            sys.executable,
            "-m",
            "bana_sglang.router",
            "--policy",
            policy,
            "--log-level",
            "WARNING",
        ]
    else:  # the stock Rust router, PD mode
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--log-level",
            "warn",
        ]
    argv += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        f"http://127.0.0.1:{pp}",
        "1",
        "--decode",
        f"http://127.0.0.1:{dp}",
    ]
    return subprocess.Popen(
        argv, env=compat.child_env(), stdout=subprocess.DEVNULL, preexec_fn=_pinned(cpus)
    )  # noqa: PLW1509  (no threads yet)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_router",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--streams",
        default="100,200",
        help="comma-separated mean numbers of concurrent streams (open-loop Poisson arrivals "
        "at streams / stream duration per second)",
    )
    p.add_argument("--requests", type=int, default=2000, help="requests per arm and stream level")
    p.add_argument("--rounds", type=int, default=4, help="alternating direct/router rounds")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-delay", type=float, default=0.02)
    p.add_argument("--prefill-delay", type=float, default=0.005)
    p.add_argument("--policy", default="bana", help="our router's policy")
    p.add_argument(
        "--stock",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the stock sglang_router arm in the same run (--no-stock skips it)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="routers on CPU 0, the client and the fake workers on the other CPUs: the routers' "
        "own cost without competing with the load generator for a core",
    )
    a = p.parse_args(argv)
    levels = [int(x) for x in a.streams.split(",") if x.strip()]
    router_cpus = client_cpus = None
    if a.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            p.error("--pin needs at least 2 CPUs")
        router_cpus, client_cpus = {cpus[0]}, set(cpus[1:])
        os.sched_setaffinity(0, client_cpus)
    duration = a.prefill_delay + a.chunks * a.chunk_delay

    pp, dp = free_port(), free_port()
    fake = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.fake_pd",
            "--prefill-port",
            str(pp),
            "--decode-port",
            str(dp),
            "--chunks",
            str(a.chunks),
            "--chunk-delay",
            str(a.chunk_delay),
            "--prefill-delay",
            str(a.prefill_delay),
        ],
        preexec_fn=_pinned(client_cpus),
    )  # noqa: PLW1509
    arms = [Arm("direct", f"http://127.0.0.1:{dp}", prefill=f"http://127.0.0.1:{pp}")]
    for kind in ("bana", "sglang") if a.stock else ("bana",):
        port = free_port()
        arms.append(
            Arm(
                "bana router" if kind == "bana" else "stock sglang_router",
                f"http://127.0.0.1:{port}",
                proc=_start_router(kind, port, pp, dp, a.policy, router_cpus),
            )
        )
    procs = [arm.proc for arm in arms if arm.proc] + [fake]
    try:
        deadline = time.monotonic() + 120
        while not all(
            http_ok(arm.url + ("/health" if arm.proc is None else "/v1/models")) for arm in arms
        ):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("fake workers or a router did not start")
            time.sleep(0.2)
        rows = [
            asyncio.run(
                measure(arms, requests=a.requests, streams=c, rounds=a.rounds, duration_s=duration)
            )
            for c in levels
        ]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)

    pinning = (
        f"routers pinned to CPU {sorted(router_cpus)}, client and fakes to {sorted(client_cpus)}"
        if a.pin
        else "no pinning"
    )
    print(
        f"\nrouter overhead ({pinning}; our router's policy {a.policy}; fake PD upstream: prefill "
        f"{a.prefill_delay * 1e3:.0f} ms, {a.chunks} chunks x {a.chunk_delay * 1e3:.0f} ms; open-loop arrivals)"
    )
    print(
        f"{'streams':>7} {'arm':<20} {'CPU ms/req':>10}  "
        + "  ".join(f"{m} p{q} (+added)".rjust(20) for m in ("ttft", "e2e") for q in (50, 99))
    )
    for row in rows:
        for name, v in row["arms"].items():
            cpu = f"{v['cpu_ms_per_request']:.2f}" if "cpu_ms_per_request" in v else "-"
            cells = "  ".join(
                f"{v[f'{m}_p{q}_ms']:9.2f} ({v[f'{m}_p{q}_added_ms']:+7.2f})".rjust(20)
                for m in ("ttft", "e2e")
                for q in (50, 99)
            )
            print(f"{row['streams']:>7} {name:<20} {cpu:>10}  {cells}")
    RUNS.mkdir(exist_ok=True)
    out = RUNS / f"router-overhead-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
