"""What an idle CPU cluster costs the machine, and whether a request still starts at once.

``python -m bench.bench_idle_cpu`` starts a 2P1D cluster of an embedded model
(global store on, the launcher's defaults) once per arm and round:

- ``sleep``: the CPU layer as it ships: a scheduler that holds no request and no
  migration waits ``BANA_IDLE_SLEEP_MS`` (100 ms) on its sockets;
- ``poll``: ``BANA_IDLE_SLEEP_MS=0``, the 5 ms wait (``BANA_IDLE_POLL_MS``)
  throughout.

After a warm-up request per prefill worker and a pause, it reads the CPU time of
every process of the cluster over ``--seconds`` of idleness (``/proc`` through
psutil, all threads), then sends ``--requests`` short prompts, each after a
second of idleness, and takes their TTFT: a longer idle wait must not delay the
request that ends it. ``--rounds N`` alternates the arms (sleep, poll, poll,
sleep, ...), so the machine's drift falls on both.

Outputs: ``bench/runs/idle-cpu-<UTC time>/report.md``; ``--write-results``
replaces the "Idle CPU of a cluster" section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bana_sglang import envs
from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bench.bench_cold_repeat import order, prompts, ttft
from bench.results import ROOT, machine_description, parse_cluster_bench_args, write_results_section

logger = logging.getLogger("bench.idle_cpu")

SECTION = "Idle CPU of a cluster"
ARMS = ("sleep", "poll")


@dataclass
class ArmRun:
    arm: str
    seconds: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # part -> CPU seconds in the window
    ttft_s: list[float] = field(default_factory=list)


def _part(p: psutil.Process) -> str:
    """``scheduler``, ``server`` (a worker's HTTP process), or the program's name."""
    name = p.name()
    if name.startswith("sglang::"):
        return name.removeprefix("sglang::")
    cmd = " ".join(p.cmdline())
    for key, part in (
        ("sglang.launch_server", "server"),
        ("bana_sglang.router", "router"),
        ("radix_global.service", "index"),
        ("storage_server", "storage"),
        ("mooncake_master", "master"),
    ):
        if key in cmd:
            return part
    return name


def cpu_by_part() -> dict[str, float]:
    """CPU seconds (user + system, every thread) of this process's descendants, by part."""
    out: dict[str, float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            part = _part(p)
        except psutil.Error:
            continue
        out[part] = out.get(part, 0.0) + t.user + t.system
    return out


def schedulers() -> int:
    return sum(
        1 for p in psutil.Process().children(recursive=True) if p.name() == "sglang::scheduler"
    )


def run_arm(arm: str, args, out: Path, port: int) -> ArmRun:
    cfg = LaunchConfig(
        model_path=args.model,
        num_prefill=2,
        num_decode=1,
        port=port,
        worker_base_port=port + 100,
        policy="round_robin",
        log_dir=out / "logs" / f"{arm}-{int(time.time())}",
    )
    sleep_ms = envs.BANA_IDLE_SLEEP_MS.get() if arm == "sleep" else 0
    with envs.override(BANA_IDLE_SLEEP_MS=sleep_ms):  # the plan takes the workers' environment
        plan = plan_cluster(cfg)
    with Cluster(plan, log_dir=cfg.log_dir, startup_timeout=900), httpx.Client(timeout=600) as c:
        url = plan.endpoint
        warm = prompts(2, 64, seed=10_000)
        for p in warm:  # one per prefill worker
            ttft(c, url, p, 2)
        time.sleep(3)
        run = ArmRun(arm, args.seconds)
        before, t0 = cpu_by_part(), time.monotonic()
        time.sleep(args.seconds)
        after, run.seconds = cpu_by_part(), time.monotonic() - t0
        run.cpu_s = {k: after[k] - before.get(k, 0.0) for k in after}
        run.cpu_s["_schedulers"] = schedulers()
        for p in prompts(args.requests, 256, seed=int(time.time())):
            time.sleep(1.0)
            run.ttft_s.append(ttft(c, url, p, 2)[0])
        logger.info(
            "%s: schedulers %.0f ms of CPU per second each, TTFT after idle p50 %.0f ms",
            arm,
            1e3 * run.cpu_s.get("scheduler", 0.0) / run.seconds / max(1, run.cpu_s["_schedulers"]),
            1e3 * statistics.median(run.ttft_s),
        )
    return run


def _rate(runs: Sequence[ArmRun], part: str | None) -> float:
    """ms of CPU per second of idleness: of one scheduler (mean), or of the whole cluster."""
    vals = []
    for r in runs:
        if part == "scheduler":
            n = max(1, int(r.cpu_s.get("_schedulers", 1)))
            vals.append(r.cpu_s.get("scheduler", 0.0) / n / r.seconds)
        else:
            total = sum(v for k, v in r.cpu_s.items() if not k.startswith("_"))
            vals.append(total / r.seconds)
    return 1e3 * statistics.median(vals)


def report(runs: Sequence[ArmRun], command: str, model: str, seconds: float, requests: int) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {machine_description()}",
        "",
        f"2P1D `{model}` cluster with the global store, idle for {seconds:g} s after a warm-up "
        f"request per prefill worker; then {requests} prompts of 256 tokens, each after 1 s "
        "idle. CPU in ms per second of idleness (user + system, every thread; medians over "
        "rounds); TTFT median over every round's requests.",
        "",
        "| arm | idle wait | one scheduler | whole cluster | TTFT after idle (ms) |",
        "|---|---|---|---|---|",
    ]
    by = {a: [r for r in runs if r.arm == a] for a in ARMS}
    waits = {
        "sleep": f"{envs.BANA_IDLE_SLEEP_MS.get()} ms with nothing under way, else "
        f"{envs.BANA_IDLE_POLL_MS.get()} ms",
        "poll": f"{envs.BANA_IDLE_POLL_MS.get()} ms",
    }
    for arm, rs in by.items():
        if not rs:
            continue
        lines.append(
            f"| {arm} | {waits[arm]} | {_rate(rs, 'scheduler'):.0f} | {_rate(rs, None):.0f} | "
            f"{1e3 * statistics.median([x for r in rs for x in r.ttft_s]):.0f} |"
        )
    if by["sleep"] and by["poll"]:
        lines += [
            "",
            f"sleep / poll: one scheduler's idle CPU "
            f"{_rate(by['sleep'], 'scheduler') / _rate(by['poll'], 'scheduler'):.2f}, the "
            f"cluster's {_rate(by['sleep'], None) / _rate(by['poll'], None):.2f}.",
        ]
    parts = sorted({k for r in runs for k in r.cpu_s if not k.startswith("_")})
    lines += ["", "By part (ms of CPU per second of idleness, medians over rounds):", ""]
    lines += ["| part | " + " | ".join(a for a in ARMS if by[a]) + " |"]
    lines += ["|---|" + "---|" * sum(1 for a in ARMS if by[a])]
    for part in parts:
        cells = [
            f"{1e3 * statistics.median([r.cpu_s.get(part, 0.0) / r.seconds for r in by[a]]):.0f}"
            for a in ARMS
            if by[a]
        ]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_idle_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="embedded model")
    p.add_argument("--seconds", type=float, default=20.0, help="idle window per arm")
    p.add_argument("--requests", type=int, default=5, help="requests after idleness per arm")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both arms, alternating")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from: sleep, poll")
    args = parse_cluster_bench_args(p, argv, default_port=32600)
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            p.error(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    if args.seconds <= 0 or args.requests < 1:
        p.error("--seconds must be > 0 and --requests >= 1")
    out = args.out or ROOT / "bench" / "runs" / time.strftime(
        "idle-cpu-%Y%m%d-%H%M%S", time.gmtime()
    )
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_arm(arm, args, out, args.port) for arm in order(arms, args.rounds)]
    command = "python -m bench.bench_idle_cpu " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(runs, command.strip(), args.model, args.seconds, args.requests)
    (out / "report.md").write_text(text + "\n")
    print(text)
    if args.write_results:
        write_results_section(SECTION, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
