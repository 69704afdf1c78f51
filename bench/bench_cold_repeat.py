"""Cold prompts and their repeats on the other prefill worker, global store on and off.

``python -m bench.bench_cold_repeat`` starts a 2P1D cluster with round-robin
routing, sends ``--prompts`` distinct prompts of ``--prompt-tokens`` tokens one
at a time (cold: nothing to hit; ``--gap`` seconds apart, default back to
back), then the same prompts again, each landing on the *other* prefill worker
(a global-store hit with the store on; a recompute without it). Arms, one after
the other on the same machine: ``store`` (the launcher's default) and
``nostore`` (``--no-global-store``); ``--rounds N`` runs every arm N times,
each round in the reverse order of the one before (store, nostore, nostore,
store, ...), so that the machine's drift falls on both. Every arm starts from
an empty store (a cluster starts with a fresh master and storage process).

It prints, per model: the median TTFT of cold prompts and of repeats per arm,
and the ratios the store is held to (a miss costs nothing: cold store/nostore
<= 1.05; a hit pays: repeat store / repeat nostore, at most 0.25 on ``small``
and below 1 on ``tiny``); then the per-request breakdown of the store arm, from
the workers' and the router's ``/metrics`` deltas over each phase: the router's
global lookup, the linker's index round trip and header check, loads (time, the
forward's wait, pages recomputed because loading was predicted slower), and
publishing (wall and CPU time per request, and the prefill forward's time per
token while a publish was written against without); with several rounds, the
ratios of each round, and from three rounds on an interval of each ratio over
rounds (a bootstrap of whole rounds: on the shared 2-core VM, clusters of one
configuration differ by more than the 5% the cold ratio is held to); the CPU
time per request of each part of the cluster (workers, router, the store's
processes) in each arm and phase, which ``/metrics`` cannot show; and the
loads of the repeats against the wire: their bandwidth (bytes over load-thread
time), the fraction hidden under compute, and a raw batched get of whole pages
through the same store, probed after the phases of each store arm
(``--raw-mb``).

Outputs: ``bench/runs/cold-repeat-<UTC time>/`` (``summary.json``,
``report.md``, logs); ``--write-results`` replaces the "Global KV store: cold
and repeated prompts" section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bench import breakdown
from bench.results import ROOT, machine_description, parse_cluster_bench_args, write_results_section

logger = logging.getLogger("bench.cold_repeat")

SECTION = "Global KV store: cold and repeated prompts"
ARMS = ("store", "nostore")


@dataclass
class Phase:
    ttft_s: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # usage's (the decode worker's) cached tokens
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # worker -> deltas
    router: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)  # part -> CPU seconds in the phase


@dataclass
class ArmRun:
    model: str
    arm: str
    cold: Phase
    repeat: Phase
    raw_get_mbps: float | None = None  # store arm: whole-page batched gets, same store
    raw_put_mbps: float | None = None
    page_nbytes: int | None = None


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 250) for _ in range(length)] for _ in range(n)]


def ttft(client: httpx.Client, url: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one streamed completion."""
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    cached = 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter() - t0
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or cached)
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, cached


def run_arm(model: str, arm: str, ids: list[list[int]], args, out: Path, port: int) -> ArmRun:
    cfg = LaunchConfig(
        model_path=model,
        num_prefill=2,
        num_decode=1,
        port=port,
        worker_base_port=port + 100,
        policy="round_robin",
        global_store=arm == "store",
        sglang_args=("--enable-cache-report", *args.sglang_args.split()),
        decode_args=tuple(args.decode_args.split()),
        log_dir=out / "logs" / f"{model}-{arm}-{int(time.time())}",
    )
    plan = plan_cluster(cfg)
    workers = {p.name: p.health_url.removesuffix("/health") for p in plan.workers}
    t0 = time.monotonic()
    with (
        Cluster(plan, log_dir=cfg.log_dir, startup_timeout=900) as cluster,
        httpx.Client(timeout=600) as c,
    ):
        logger.info("%s/%s up in %.0fs", model, arm, time.monotonic() - t0)
        url = plan.endpoint
        warm = prompts(3, 64, seed=10_000)
        ttft(c, url, warm[0], 2)
        ttft(c, url, warm[1], 2)  # one warm-up per prefill worker
        phases = []
        for phase, fill in (("cold", len(ids) % 2 == 0), ("repeat", False)):
            before, rbefore = breakdown.scrape(workers), breakdown.router_metrics(url)
            cpu0 = breakdown.cpu_of_parts(cluster.procs)
            ph = Phase()
            for p in ids:
                s, cached = ttft(c, url, p, args.max_tokens)
                ph.ttft_s.append(s)
                ph.cached.append(cached)
                time.sleep(args.gap)
            time.sleep(1.0)  # publishing is asynchronous: let it land in this phase
            cpu1 = breakdown.cpu_of_parts(cluster.procs)
            ph.cpu_s = {k: v - cpu0[k] for k, v in cpu1.items() if k in cpu0}
            ph.metrics = breakdown.delta(breakdown.scrape(workers), before)
            ph.router = {
                k: v - rbefore.get(k, 0.0) for k, v in breakdown.router_metrics(url).items()
            }
            phases.append(ph)
            if fill:  # round robin: repeat i lands on the other prefill worker than cold i
                ttft(c, url, warm[2], 2)
            logger.info(
                "%s/%s %s: TTFT p50 %.0f ms, cached %s",
                model,
                arm,
                phase,
                1e3 * statistics.median(ph.ttft_s),
                ph.cached,
            )
        run = ArmRun(model, arm, phases[0], phases[1])
        if plan.store and plan.master is not None and args.raw_mb > 0:
            # after the phases, so that it delays no request: the wire's speed in this run
            run.page_nbytes = breakdown.page_nbytes(plan)
            run.raw_put_mbps, run.raw_get_mbps = breakdown.raw_bandwidth(
                breakdown.master_addr(plan), run.page_nbytes, args.raw_mb
            )
            logger.info("%s/%s raw get %.0f MB/s", model, arm, run.raw_get_mbps)
    return run


def order(arms: Sequence[str], rounds: int) -> list[str]:
    """The arms of every round, each round in the reverse order of the one before
    (A B, B A, A B, ...), so that a drift of the machine falls on every arm alike."""
    out: list[str] = []
    for r in range(max(1, rounds)):
        out += list(arms) if r % 2 == 0 else list(arms)[::-1]
    return out


def _p50(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(runs: Sequence[ArmRun], command: str, n: int, length: int, gap: float = 0.0) -> str:
    pace = f"{gap:g} s apart" if gap > 0 else "back to back"
    lines = [
        f"Command: `{command}`",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {machine_description()}",
        "",
        f"2P1D, round-robin routing, {n} distinct prompts of {length} tokens sent one at a time, "
        f"{pace} (cold), then the same prompts again, each on the other prefill worker (repeat). "
        "TTFT medians in ms; each arm starts with an empty store.",
        "",
        "| model | arm | cold TTFT | repeat TTFT | prompt tokens loaded per repeat |",
        "|---|---|---|---|---|",
    ]
    by: dict[tuple[str, str], list[ArmRun]] = {}
    for r in runs:
        by.setdefault((r.model, r.arm), []).append(r)
    for (model, arm), rs in by.items():
        cold = [x for r in rs for x in r.cold.ttft_s]
        rep = [x for r in rs for x in r.repeat.ttft_s]
        loaded = sum(
            m.get("global_hit_tokens", 0.0) for r in rs for m in r.repeat.metrics.values()
        ) / max(1, sum(len(r.repeat.ttft_s) for r in rs))
        lines.append(
            f"| {model} | {arm} | {1e3 * _p50(cold):.0f} | {1e3 * _p50(rep):.0f} | {loaded:.0f} |"
        )
    lines += [
        "",
        "| model | cold: store / nostore | repeat: store hit / nostore recompute |",
        "|---|---|---|",
    ]
    intervals = False
    for model in dict.fromkeys(r.model for r in runs):
        on, off = by.get((model, "store")), by.get((model, "nostore"))
        if not on or not off:
            continue
        cells = []
        for phase in ("cold", "repeat"):
            cell = f"{_pooled_ratio(on, off, phase):.2f}"
            ci = round_interval(on, off, phase)
            if ci is not None:
                cell += f" ({ci[0]:.2f}-{ci[1]:.2f})"
                intervals = True
            cells.append(cell)
        lines.append(f"| {model} | {cells[0]} | {cells[1]} |")
    if intervals:
        lines += [
            "",
            f"In brackets: a {ROUND_CI:.0%} interval of the ratio over rounds (bootstrap: "
            f"{ROUND_DRAWS} draws of whole rounds with replacement, the ratio of pooled medians "
            "of each draw). A round is one cluster per arm, and clusters of the same "
            "configuration differ by more than requests within one do, so the round is the "
            "unit resampled. It covers the spread between the rounds of this run, not the "
            "machine's drift between runs.",
        ]
    per_round = _round_ratios(runs)
    if any(len(v) > 1 for v in per_round.values()):
        lines += [
            "",
            "The same ratios per round (each round runs both arms, back to back; the machine "
            "drifts between rounds):",
            "",
            "| model | round | cold: store / nostore | repeat: store hit / nostore recompute |",
            "|---|---|---|---|",
        ]
        for model, rows_ in per_round.items():
            for i, (c, rp) in enumerate(rows_, 1):
                lines.append(f"| {model} | {i} | {c:.2f} | {rp:.2f} |")
    lines += cpu_table(by)
    loads = []
    for model in dict.fromkeys(r.model for r in runs):
        on = by.get((model, "store"), [])
        figs = breakdown.load_figures(_merged([r.repeat.metrics for r in on]))
        raw = [r.raw_get_mbps for r in on if r.raw_get_mbps]
        if figs is None:
            continue
        mb, secs, hidden = figs
        bw = mb / secs
        line = (
            f"- {model}: layer-wise loads of the repeats moved {mb:.1f} MB in {secs:.2f} s of "
            f"load-thread time, {bw:.0f} MB/s; {hidden:.0%} of load time hidden under compute"
        )
        if raw:
            g = statistics.median(raw)
            line += (
                f"; raw batched get of whole {on[-1].page_nbytes} B pages (batches of 16, "
                f"zero copy) through the same store after the phases: {g:.0f} MB/s, "
                f"ratio {bw / g:.2f}"
            )
        loads.append(line)
    if loads:
        lines += ["", "Loads (store arm, repeat phase, every round):", "", *loads]
    for model in dict.fromkeys(r.model for r in runs):
        on = by.get((model, "store"))
        if not on:
            continue
        r = on[-1]
        lines += [
            "",
            f"Per-request breakdown, store arm, {model} (last round; from `/metrics` deltas):",
            "",
            "| | cold | repeat |",
            "|---|---|---|",
        ]
        cold = breakdown.rows(r.cold.metrics, n, r.cold.router)
        rep = breakdown.rows(r.repeat.metrics, n, r.repeat.router)
        for (what, a), (_, b) in zip(cold, rep):
            lines.append(f"| {what} | {a} | {b} |")
    return "\n".join(lines)


ROUND_CI = 0.9
ROUND_DRAWS = 2000
CPU_COLUMNS = [c for _, c in breakdown.CPU_PARTS]


def cpu_per_request(rs: Sequence[ArmRun], phase: str) -> dict[str, float] | None:
    """CPU ms per request of ``phase`` by column of ``breakdown.CPU_PARTS`` (and ``total``),
    pooled over the runs ``rs``; None when no run measured it."""
    phases = [getattr(r, phase) for r in rs]
    n = sum(len(ph.ttft_s) for ph in phases if ph.cpu_s)
    if not n:
        return None
    out: dict[str, float] = {}
    for ph in phases:
        for col, secs in breakdown.cpu_columns(ph.cpu_s).items():
            if col != "total":
                out[col] = out.get(col, 0.0) + 1e3 * secs / n
    out["total"] = sum(out.values())
    return out


def cpu_table(by: dict[tuple[str, str], list[ArmRun]]) -> list[str]:
    rows = []
    for (model, arm), rs in by.items():
        for phase in ("cold", "repeat"):
            ms = cpu_per_request(rs, phase)
            if ms is not None:
                cells = " | ".join(f"{ms[c]:.1f}" for c in CPU_COLUMNS)
                rows.append(f"| {model} | {arm} | {phase} | {cells} | {ms['total']:.1f} |")
    if not rows:
        return []
    head = " | ".join(CPU_COLUMNS)
    return [
        "",
        "CPU per request by part of the cluster (ms of user + system time, every process and "
        "thread of the part, over each phase including its last second of publishing; all "
        "rounds pooled; prefill: both workers):",
        "",
        f"| model | arm | phase | {head} | total |",
        "|---|---|---|" + "---|" * (len(CPU_COLUMNS) + 1),
        *rows,
    ]


def _pooled_ratio(on: Sequence[ArmRun], off: Sequence[ArmRun], phase: str) -> float:
    """Median TTFT of ``phase`` over every request of ``on``, over that of ``off``."""
    return _p50([x for r in on for x in getattr(r, phase).ttft_s]) / _p50(
        [x for r in off for x in getattr(r, phase).ttft_s]
    )


def round_interval(
    on: Sequence[ArmRun],
    off: Sequence[ArmRun],
    phase: str,
    *,
    level: float = ROUND_CI,
    draws: int = ROUND_DRAWS,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A ``level`` percentile interval of :func:`_pooled_ratio` over rounds: each draw
    takes as many rounds as there are, with replacement (round ``k`` is the k-th run
    of each arm, which ran back to back), and pools their requests. None with fewer
    than 3 rounds (too few to say anything)."""
    pairs = list(zip(on, off))
    if len(pairs) < 3:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        draw = [rng.choice(pairs) for _ in pairs]
        ratios.append(_pooled_ratio([a for a, _ in draw], [b for _, b in draw], phase))
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * (draws - 1))]
    hi = ratios[int((1 + level) / 2 * (draws - 1))]
    return lo, hi


def _merged(ms: Sequence[breakdown.Metrics]) -> dict[str, dict[str, float]]:
    """Metrics of several runs as one: ``run index/worker`` -> counters."""
    return {f"{i}/{w}": dict(m) for i, mm in enumerate(ms) for w, m in mm.items()}


def _round_ratios(runs: Sequence[ArmRun]) -> dict[str, list[tuple[float, float]]]:
    """model -> (cold, repeat) store/nostore median ratios of each round, a round being
    the k-th run of each arm."""
    out: dict[str, list[tuple[float, float]]] = {}
    for model in dict.fromkeys(r.model for r in runs):
        on = [r for r in runs if r.model == model and r.arm == "store"]
        off = [r for r in runs if r.model == model and r.arm == "nostore"]
        out[model] = [
            (_pooled_ratio([a], [b], "cold"), _pooled_ratio([a], [b], "repeat"))
            for a, b in zip(on, off)
        ]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_cold_repeat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--models", default="small,tiny", help="comma-separated embedded models")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1400)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from: store, nostore")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every arm, each round in the reverse order of the one before "
        "(2: store, nostore, nostore, store)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sglang-args", default="", help="extra SGLang flags for every worker")
    p.add_argument("--decode-args", default="", help="extra SGLang flags for decode workers")
    p.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="seconds between one request's end and the next one's start (default 0: back "
        "to back); a gap lets the previous request's publishing finish first",
    )
    p.add_argument(
        "--raw-mb",
        type=int,
        default=32,
        help="MB moved by the raw Mooncake get probe after each store arm (0: no probe)",
    )
    args = parse_cluster_bench_args(p, argv, default_port=32000)
    if args.gap < 0:
        p.error(f"--gap must be >= 0, got {args.gap}")
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            p.error(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    out = args.out or ROOT / "bench" / "runs" / time.strftime(
        "cold-repeat-%Y%m%d-%H%M%S", time.gmtime()
    )
    out.mkdir(parents=True, exist_ok=True)
    ids = prompts(args.prompts, args.prompt_tokens, args.seed)
    runs: list[ArmRun] = []
    for model in [m for m in args.models.split(",") if m]:
        for arm in order(arms, args.rounds):
            runs.append(run_arm(model, arm, ids, args, out, args.port))
    command = "python -m bench.bench_cold_repeat " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(runs, command.strip(), args.prompts, args.prompt_tokens, args.gap)
    (out / "report.md").write_text(text + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            [
                dict(
                    model=r.model,
                    arm=r.arm,
                    cold=r.cold.__dict__,
                    repeat=r.repeat.__dict__,
                    raw_get_mbps=r.raw_get_mbps,
                    raw_put_mbps=r.raw_put_mbps,
                    page_nbytes=r.page_nbytes,
                )
                for r in runs
            ],
            indent=1,
        )
    )
    print(text)
    if args.write_results:
        write_results_section(SECTION, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
