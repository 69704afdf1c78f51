"""The side-by-side report: the results table, the ratios against the best
baseline, the sweep's saturation table, the three PNG plots, and the Markdown
report that states the command, machine, fairness, workload and rates.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
from collections.abc import Sequence
from pathlib import Path

from bench import breakdown, configs, metrics, workloads
from bench.results import RESULTS_MD
from bench.sidebyside import RunResult, RunSpec, rate_label


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def results_table(results: Sequence[RunResult]) -> str:
    head = (
        "| config | rate req/s | offered | ok/total | req/s | out tok/s | TTFT p50/p90/p99 ms | TPOT p50 ms | "
        "ITL p99 ms | E2E p50/p99 ms | goodput req/s (frac) | prefix hit | imbalance max/mean (CV) |"
    )
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in results:
        s = r.summary
        load = s.load
        lines.append(
            f"| {r.config} | {rate_label(r.rate)} | {_f(r.offered_rate)} | {s.ok}/{s.requests} | {s.req_per_s:.3f} | "
            f"{s.out_tok_per_s:.1f} | {metrics.ms(s.ttft.p50)}/{metrics.ms(s.ttft.p90)}/{metrics.ms(s.ttft.p99)} | "
            f"{metrics.ms(s.tpot.p50)} | {metrics.ms(s.itl.p99)} | {metrics.ms(s.e2e.p50)}/{metrics.ms(s.e2e.p99)} | "
            f"{s.goodput_per_s:.3f} ({s.goodput_frac:.0%}) | "
            f"{_f(s.prefix_hit_rate, '.1%') if s.prefix_hit_rate is not None else '-'} | "
            f"{_f(load.imbalance) if load else '-'} ({_f(load.cv) if load else '-'}) |"
        )
    return "\n".join(lines)


# (label, getter, higher is better)
RATIO_METRICS = (
    ("req/s", lambda s: s.req_per_s, True),
    ("out tok/s", lambda s: s.out_tok_per_s, True),
    ("goodput", lambda s: s.goodput_per_s, True),
    ("TTFT p50", lambda s: s.ttft.p50, False),
    ("TTFT p99", lambda s: s.ttft.p99, False),
    ("TPOT p50", lambda s: s.tpot.p50, False),
    ("E2E p50", lambda s: s.e2e.p50, False),
)


def ratio_table(results: Sequence[RunResult]) -> str:
    """Each configuration / the best baseline at the same rate, per metric.

    The best baseline is the best value among baseline configurations (the
    highest throughput, the lowest latency). Throughput ratios > 1 and latency
    ratios < 1 mean better than the best baseline."""
    head = "| config | rate | " + " | ".join(m[0] for m in RATIO_METRICS) + " |"
    lines = [head, "|" + "|".join(["---"] * (len(RATIO_METRICS) + 2)) + "|"]
    for rate in dict.fromkeys(r.rate for r in results):
        at = [r for r in results if r.rate == rate]
        base = [r for r in at if configs.get(r.config).baseline]
        if not base:
            continue
        for r in at:
            cells = []
            for _label, get, higher in RATIO_METRICS:
                vals = [get(b.summary) for b in base if not math.isnan(get(b.summary))]
                best = (max if higher else min)(vals) if vals else float("nan")
                v = get(r.summary)
                cells.append(
                    "-" if not best or math.isnan(best) or math.isnan(v) else f"{v / best:.2f}"
                )
            lines.append(f"| {r.config} | {rate_label(rate)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def saturation_table(results: Sequence[RunResult], min_goodput: float) -> str:
    lines = [
        f"| config | highest rate with goodput >= {min_goodput:.0%} | achieved req/s there | first failing rate |",
        "|---|---|---|---|",
    ]
    for name in dict.fromkeys(r.config for r in results):
        rs = [r for r in results if r.config == name]
        good = [r for r in rs if r.summary.goodput_frac >= min_goodput]
        bad = [r for r in rs if r.summary.goodput_frac < min_goodput]
        best = max(good, key=lambda r: r.rate or 0.0) if good else None
        lines.append(
            f"| {name} | {rate_label(best.rate) if best else 'none'} | "
            f"{f'{best.summary.req_per_s:.3f}' if best else '-'} | "
            f"{rate_label(bad[0].rate) if bad else '-'} |"
        )
    return "\n".join(lines)


def plot_all(results: Sequence[RunResult], out: Path) -> list[Path]:
    """TTFT CDF, throughput vs request rate, per-worker load over time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r.ttfts:
            xs = np.sort(np.asarray(r.ttfts))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r.key, drawstyle="steps-post")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out / "ttft_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.config for r in results):
        rs = sorted((r for r in results if r.config == name), key=lambda r: r.offered_rate)
        x = [r.offered_rate for r in rs]
        (line,) = ax.plot(
            x, [r.summary.req_per_s for r in rs], marker="o", label=f"{name} throughput"
        )
        ax.plot(
            x,
            [r.summary.goodput_per_s for r in rs],
            marker="x",
            ls="--",
            color=line.get_color(),
            label=f"{name} goodput",
        )
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("achieved (req/s)")
    ax.set_title("Throughput vs request rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(out / "throughput_vs_rate.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    n = max(1, len(results))
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n), squeeze=False, sharex=False)
    for ax, r in zip(axes[:, 0], results):
        for worker, pts in sorted(r.load_series.items()):
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=worker)
        ax.set_title(f"{r.key}: running + queued requests per worker", fontsize=9)
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since run start (s)")
    paths.append(out / "worker_load.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def report(
    spec: RunSpec,
    results: Sequence[RunResult],
    command: str,
    plots: Sequence[Path],
    machine: str,
    started: dt.datetime,
    wall_s: float,
    flags: str | None = None,
) -> str:
    space = workloads.TokenSpace.from_model(configs.model_dir(spec.resources.model_path))
    first = spec.rates[0]
    wl = workloads.build(
        dataclasses.replace(spec.workload, request_rate=first)
        if first is not None
        else spec.workload,
        space,
    )
    rel = [os.path.relpath(p, RESULTS_MD.parent) for p in plots]
    parts = [
        f"Date: {started:%Y-%m-%d %H:%M} UTC; wall time {wall_s / 60:.1f} min.",
        f"Command (from the repository root): `{command}`",
        f"Machine: {machine}.",
        f"Model: `{configs.model_dir(spec.resources.model_path).name}`. Fairness: {spec.resources.describe()}.",
        f"SGLang flags of every worker (besides model, ports and PD role): `{flags or worker_flags(spec)}`.",
        "Configurations: "
        + "; ".join(f"`{n}` = {configs.get(n).description}" for n in spec.configs)
        + ".",
        f"Workload (at the first rate; the others only rescale arrival times): {wl.describe()}."
        + (f" Notes: {'; '.join(wl.notes)}." if wl.notes else ""),
        "Rates (req/s): "
        + ", ".join(rate_label(r) for r in spec.rates)
        + f"; SLO for goodput: {spec.slo.describe()}.",
        "",
        results_table(results),
        "",
        "Ratios against the best baseline at the same rate (throughput: >1 is better; latency: <1 is better):",
        "",
        ratio_table(results),
    ]
    if spec.min_goodput is not None:
        parts += ["", "Saturation (sweep):", "", saturation_table(results, spec.min_goodput)]
    for r in results:
        if r.store_metrics:
            n = len(r.ttfts) or 1
            parts += [
                "",
                f"Global store, per-request breakdown of `{r.key}` (`/metrics` deltas over the "
                "replay; the store was emptied before it):",
                "",
                breakdown.markdown(r.store_metrics, n, r.router_metrics),
            ]
    failed = [n for n in spec.configs if not any(r.config == n for r in results)]
    if failed:
        parts += ["", f"Failed to run (see the logs): {', '.join(failed)}."]
    parts += ["", "Plots: " + ", ".join(f"[{p.name}]({q})" for p, q in zip(plots, rel))]
    return "\n".join(parts)


def worker_flags(spec: RunSpec) -> str:
    """The flags the first configuration's first worker runs with, after its port
    (the CPU layer's attention backend etc. change what the numbers mean)."""
    argv = list(configs.get(spec.configs[0]).plan(spec.resources).workers[0].argv)
    rest = argv[argv.index("--port") + 2 :]
    out: list[str] = []
    skip = False
    for a in rest:  # drop the PD role and its ports: they differ by design
        if skip:
            skip = False
            continue
        if a in (
            "--disaggregation-mode",
            "--disaggregation-transfer-backend",
            "--disaggregation-bootstrap-port",
        ):
            skip = True
            continue
        out.append(a)
    return " ".join(out)
