"""Router overhead: latency the router adds per request, at 100+ concurrent streams.

``python -m bench.bench_router`` starts a fake PD pair (``bench.fake_pd``, a
separate process whose prefill answers after ``--prefill-delay`` and whose
decode streams ``--chunks`` chunks ``--chunk-delay`` apart) and the real
router (``python -m bana_sglang.router``, its own process) in front of it.
The client then sends the same streaming requests two ways, with open-loop
Poisson arrivals at the rate that keeps ``--streams`` requests in flight on
average, alternating in rounds so that machine noise hits both alike:

- **direct**: the client pairs prefill and decode itself (the bootstrap fields,
  both requests at once), i.e. routing with zero overhead;
- **router**: through the router (policy ``bana``: load snapshots, pairing,
  accounting, relaying).

It prints time to first chunk and end-to-end latency at p50/p90/p99 for both
and their difference (the router's added latency), and saves the raw numbers
under ``bench/runs/``. Fake workers keep the upstream cost fixed and tiny, so
the difference is the router's own; with real SGLang workers the same
milliseconds would hide under model time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bana_sglang.procs import http_ok
from bench.fake_pd import free_port

RUNS = Path(__file__).resolve().parent / "runs"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def _one(session: aiohttp.ClientSession, url: str, body: dict, prefill: str | None) -> tuple[float, float]:
    t0 = time.perf_counter()
    p_task = None
    if prefill is not None:  # direct: the client does the PD pairing itself
        body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=1,
                    bootstrap_room=random.getrandbits(63))
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


async def _arm(session, url, prefill, n: int, rate: float, rng: random.Random) -> tuple[list[float], list[float]]:
    """``n`` requests with Poisson arrivals at ``rate``/s (open loop)."""
    body = {"model": "fake-model", "prompt": "benchmark the router " * 8, "max_tokens": 16, "stream": True}
    tasks = []
    t = time.perf_counter()
    for _ in range(n):
        t += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        tasks.append(asyncio.create_task(_one(session, url, body, prefill)))
    out = await asyncio.gather(*tasks)
    return [a for a, _ in out], [b for _, b in out]


async def measure(router: str, decode: str, prefill: str, *, requests: int, streams: int, rounds: int,
                  duration_s: float, router_proc) -> dict:
    """Alternate direct/router rounds at the arrival rate that keeps ``streams``
    requests in flight on average (Little's law: rate = streams / duration)."""
    import psutil
    from tqdm import tqdm

    rate = streams / duration_s
    rng = random.Random(streams)
    res = {"direct": ([], []), "router": ([], [])}
    per = max(1, requests // rounds)
    cpu = psutil.Process(router_proc.pid)
    router_cpu_s = router_user_s = 0.0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        await _arm(s, router, None, min(per, streams), rate, rng)  # warm both paths' connections
        await _arm(s, decode, prefill, min(per, streams), rate, rng)
        with tqdm(total=2 * rounds * per, desc=f"{streams} streams ({rate:.0f} req/s)", unit="req") as bar:
            for r in range(rounds):
                order = ("direct", "router") if r % 2 == 0 else ("router", "direct")
                for arm in order:
                    c0 = cpu.cpu_times()
                    ttft, e2e = await _arm(s, router if arm == "router" else decode,
                                           None if arm == "router" else prefill, per, rate, rng)
                    if arm == "router":
                        c1 = cpu.cpu_times()
                        router_user_s += c1.user - c0.user
                        router_cpu_s += c1.user + c1.system - c0.user - c0.system
                    res[arm][0].extend(ttft)
                    res[arm][1].extend(e2e)
                    bar.update(per)
    out = {"streams": streams, "rate_per_s": round(rate, 2), "requests_per_arm": rounds * per,
           "router_cpu_ms_per_request": round(1e3 * router_cpu_s / (rounds * per), 3),
           "router_user_cpu_ms_per_request": round(1e3 * router_user_s / (rounds * per), 3)}
    for metric, i in (("ttft", 0), ("e2e", 1)):
        for q in (50, 90, 99):
            d, r = pct(res["direct"][i], q) * 1e3, pct(res["router"][i], q) * 1e3
            out[f"{metric}_p{q}_direct_ms"] = round(d, 3)
            out[f"{metric}_p{q}_router_ms"] = round(r, 3)
            out[f"{metric}_p{q}_added_ms"] = round(r - d, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_router", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--streams", default="100,200",
                   help="comma-separated mean numbers of concurrent streams (open-loop Poisson arrivals "
                        "at streams / stream duration per second)")
    p.add_argument("--requests", type=int, default=2000, help="requests per arm and stream level")
    p.add_argument("--rounds", type=int, default=4, help="alternating direct/router rounds")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-delay", type=float, default=0.02)
    p.add_argument("--prefill-delay", type=float, default=0.005)
    p.add_argument("--policy", default="bana")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.streams.split(",") if x.strip()]
    duration = a.prefill_delay + a.chunks * a.chunk_delay

    pp, dp, rp = free_port(), free_port(), free_port()
    fake = subprocess.Popen([sys.executable, "-m", "bench.fake_pd", "--prefill-port", str(pp),
                             "--decode-port", str(dp), "--chunks", str(a.chunks),
                             "--chunk-delay", str(a.chunk_delay), "--prefill-delay", str(a.prefill_delay)])
    router = subprocess.Popen([sys.executable, "-m", "bana_sglang.router", "--port", str(rp),
                               "--prefill", f"http://127.0.0.1:{pp}", "1", "--decode", f"http://127.0.0.1:{dp}",
                               "--policy", a.policy, "--log-level", "WARNING"])
    rurl, durl, purl = (f"http://127.0.0.1:{x}" for x in (rp, dp, pp))
    try:
        deadline = time.monotonic() + 60
        while not (http_ok(rurl + "/health") and http_ok(durl + "/health")):
            if time.monotonic() > deadline or fake.poll() is not None or router.poll() is not None:
                raise SystemExit("fake workers or router did not start")
            time.sleep(0.2)
        rows = [asyncio.run(measure(rurl, durl, purl, requests=a.requests, streams=c, rounds=a.rounds,
                                    duration_s=duration, router_proc=router)) for c in levels]
    finally:
        for proc in (router, fake):
            proc.terminate()
        for proc in (router, fake):
            proc.wait(timeout=30)

    print(f"\nrouter overhead (policy {a.policy}; fake PD upstream: prefill {a.prefill_delay * 1e3:.0f} ms, "
          f"{a.chunks} chunks x {a.chunk_delay * 1e3:.0f} ms)")
    print(f"{'streams':>8} {'metric':>6} {'pct':>4} {'direct ms':>10} {'router ms':>10} {'added ms':>9}")
    for row in rows:
        print(f"{row['streams']:>8} router CPU {row['router_cpu_ms_per_request']:.2f} ms per request "
              f"({row['router_user_cpu_ms_per_request']:.2f} ms user, the rest in the kernel) "
              f"at {row['rate_per_s']} req/s")
        for metric in ("ttft", "e2e"):
            for q in (50, 90, 99):
                print(f"{row['streams']:>8} {metric:>6} {'p' + str(q):>4} "
                      f"{row[f'{metric}_p{q}_direct_ms']:>10.2f} {row[f'{metric}_p{q}_router_ms']:>10.2f} "
                      f"{row[f'{metric}_p{q}_added_ms']:>9.2f}")
    RUNS.mkdir(exist_ok=True)
    out = RUNS / f"router-overhead-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
