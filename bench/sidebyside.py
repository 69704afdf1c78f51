"""Side-by-side runs: configurations one after another on one machine.

For each configuration of a :class:`RunSpec`, in order: plan it
(:mod:`bench.configs`), start it with :class:`bana_sglang.launch.Cluster`,
warm it up with requests that share nothing with the workload, then for each
request rate flush every worker's prefix cache and replay the same workload
(same seed, same prompts) while sampling the workers' ``/metrics``; stop it
(the context manager leaves no process behind) before the next one starts.
Nothing runs concurrently with a measured replay except the machine's other
tenants, which the report states.

Outputs under ``out_dir``: ``<config>@<rate>.records.jsonl`` (one request
per line), ``...load.jsonl`` (metrics samples), ``summary.json``, the three
PNG plots, the worker logs, and the markdown report that
:func:`write_results_section` also places in ``docs/RESULTS.md``.

Sweep mode: rates ascend; a configuration stops at the first rate whose
goodput fraction falls below ``min_goodput``; its saturation throughput is
the achieved request rate at the highest rate that stayed above.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

from bana_sglang.launch import Cluster
from bench import client, configs, metrics, workloads
from bench.client import ClientConfig, LoadSampler, RequestRecord
from bench.configs import Resources
from bench.metrics import SLO, Summary
from bench.workloads import WorkloadSpec

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "docs" / "RESULTS.md"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    configs: tuple[str, ...]
    workload: WorkloadSpec
    resources: Resources
    rates: tuple[float | None, ...] = (None,)  # None: the workload's own arrivals
    slo: SLO = SLO()
    out_dir: Path = ROOT / "bench" / "runs" / "latest"
    warmup: int = 2
    timeout_s: float = 600.0
    sample_interval_s: float = 0.5
    min_goodput: float | None = None  # sweep mode when set
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in self.configs:
            configs.get(name)  # raises ConfigError listing the valid names
        if not self.configs:
            raise configs.ConfigError("no configuration given")


@dataclasses.dataclass(frozen=True)
class RunResult:
    config: str
    rate: float | None  # requested
    offered_rate: float  # what the workload actually offered
    summary: Summary
    records_file: str
    startup_s: float
    ttfts: tuple[float, ...]  # successful requests, for the CDF
    load_series: dict[str, list[tuple[float, float]]]  # worker -> (t, running + queued)

    @property
    def key(self) -> str:
        return f"{self.config}@{_rate_label(self.rate)}"


def _rate_label(rate: float | None) -> str:
    return "trace" if rate is None else ("inf" if math.isinf(rate) else f"{rate:g}")


def warmup(
    cfg: ClientConfig, space: workloads.TokenSpace, n: int, ready_timeout_s: float = 300.0
) -> None:
    """Wait until the endpoint serves a request, then send ``n`` more.

    A router reports healthy before it has found healthy workers (the stock
    one answers 503 "no prefill workers available" for a while), so the
    first request is retried until ``ready_timeout_s``. Warm-up prompts share
    no token with any workload prompt (their own seed)."""
    quiet = dataclasses.replace(cfg, progress=False, timeout_s=min(cfg.timeout_s, 120.0))

    def probe(i: int) -> RequestRecord:
        req = workloads.Request(
            rid=i,
            arrival_s=0.0,
            max_tokens=4,
            prompt=workloads.block_tokens(-1, ("warmup", i), 64, space),
        )
        return client.replay(quiet, [req])[0]

    deadline = time.monotonic() + ready_timeout_s
    while True:
        rec = probe(0)
        if rec.ok:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"endpoint {cfg.endpoint} not serving after {ready_timeout_s:.0f}s: {rec.error}"
            )
        logger.info("endpoint not serving yet (%s); retrying", rec.error[:120])
        time.sleep(2.0)
    recs = [probe(i) for i in range(1, n)]
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def run_config(name: str, spec: RunSpec, space: workloads.TokenSpace) -> list[RunResult]:
    """Start one configuration, replay the workload at every rate, stop it."""
    cfg = configs.get(name)
    plan = cfg.plan(spec.resources)
    urls = configs.worker_urls(plan)
    results: list[RunResult] = []
    t0 = time.monotonic()
    logger.info("starting %s: %s", name, cfg.description)
    with Cluster(
        plan, log_dir=spec.out_dir / "logs" / name, startup_timeout=spec.startup_timeout_s
    ):
        startup = time.monotonic() - t0
        logger.info("%s up in %.0fs at %s", name, startup, plan.endpoint)
        ccfg = ClientConfig(
            endpoint=plan.endpoint,
            model=plan.served_model_name,
            space=space,
            timeout_s=spec.timeout_s,
        )
        warmup(ccfg, space, spec.warmup)
        for rate in spec.rates:
            wl = workloads.build(
                dataclasses.replace(spec.workload, request_rate=rate)
                if rate is not None
                else spec.workload,
                space,
            )
            client.flush_caches(list(urls.values()))
            time.sleep(1.0)
            sampler = LoadSampler(urls, spec.sample_interval_s)
            logger.info("%s: replaying %s", name, wl.describe())
            records = client.replay(ccfg, wl, sampler)
            summary = metrics.summarize(records, spec.slo, sampler.samples)
            res = _save(name, rate, wl, records, sampler, summary, startup, spec.out_dir)
            results.append(res)
            print(metrics.format_summary(res.key, summary), flush=True)
            if spec.min_goodput is not None and summary.goodput_frac < spec.min_goodput:
                logger.info(
                    "%s saturated at %s req/s (goodput %.0f%% < %.0f%%)",
                    name,
                    _rate_label(rate),
                    100 * summary.goodput_frac,
                    100 * spec.min_goodput,
                )
                break
    return results


def _save(
    name: str,
    rate: float | None,
    wl: workloads.Workload,
    records: list[RequestRecord],
    sampler: LoadSampler,
    summary: Summary,
    startup: float,
    out: Path,
) -> RunResult:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}@{_rate_label(rate)}"
    rec_file = out / f"{stem}.records.jsonl"
    with rec_file.open("w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")
    with (out / f"{stem}.load.jsonl").open("w") as f:
        for s in sampler.samples:
            f.write(json.dumps(s.to_json()) + "\n")
    return _result(name, rate, wl.offered_rate, records, sampler, summary, startup, rec_file)


def _result(
    name: str,
    rate: float | None,
    offered: float,
    records: Sequence[RequestRecord],
    sampler: LoadSampler,
    summary: Summary,
    startup: float,
    rec_file: Path,
) -> RunResult:
    series: dict[str, list[tuple[float, float]]] = {}
    for s in sampler.samples:
        series.setdefault(s.worker, []).append((s.t, metrics.inflight_of(s.values)))
    return RunResult(
        config=name,
        rate=rate,
        offered_rate=offered,
        summary=summary,
        records_file=str(rec_file),
        startup_s=startup,
        ttfts=tuple(r.ttft for r in records if r.ok and r.ttft is not None),
        load_series=series,
    )


def run(spec: RunSpec) -> list[RunResult]:
    space = workloads.TokenSpace.from_model(configs.model_dir(spec.resources.model_path))
    all_results: list[RunResult] = []
    for name in spec.configs:
        try:
            all_results += run_config(name, spec, space)
        except Exception:  # one broken configuration must not lose the others' numbers
            logger.exception("configuration %s failed; continuing with the next", name)
    (spec.out_dir / "summary.json").write_text(
        json.dumps(
            [
                dict(
                    config=r.config,
                    rate=r.rate,
                    offered_rate=r.offered_rate,
                    startup_s=r.startup_s,
                    records=r.records_file,
                    summary=r.summary.to_json(),
                )
                for r in all_results
            ],
            indent=1,
            default=str,
        )
    )
    return all_results


def load_results(out_dir: Path, slo: SLO) -> list[RunResult]:
    """Rebuild the results of a finished run from its files (records and load
    samples), recomputing every metric, e.g. under another SLO."""
    index = json.loads((out_dir / "summary.json").read_text())
    results: list[RunResult] = []
    for item in index:
        rec_file = Path(item["records"])
        if not rec_file.exists():
            rec_file = out_dir / rec_file.name
        records = [
            RequestRecord.from_json(json.loads(line)) for line in rec_file.read_text().splitlines()
        ]
        load_file = rec_file.with_name(rec_file.name.replace(".records.jsonl", ".load.jsonl"))
        samples = (
            [client.LoadSample(**json.loads(line)) for line in load_file.read_text().splitlines()]
            if load_file.exists()
            else []
        )
        sampler = LoadSampler({})
        sampler.samples = samples
        results.append(
            _result(
                item["config"],
                item["rate"],
                item["offered_rate"],
                records,
                sampler,
                metrics.summarize(records, slo, samples),
                item["startup_s"],
                rec_file,
            )
        )
    return results


# --------------------------------------------------------------------------- tables


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
            f"| {r.config} | {_rate_label(r.rate)} | {_f(r.offered_rate)} | {s.ok}/{s.requests} | {s.req_per_s:.3f} | "
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
            lines.append(f"| {r.config} | {_rate_label(rate)} | " + " | ".join(cells) + " |")
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
            f"| {name} | {_rate_label(best.rate) if best else 'none'} | "
            f"{f'{best.summary.req_per_s:.3f}' if best else '-'} | "
            f"{_rate_label(bad[0].rate) if bad else '-'} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


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


# --------------------------------------------------------------------------- report


def machine_description() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    import sglang
    import torch

    load = os.getloadavg()
    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu}), {mem_gb:.0f} GiB RAM, no GPU used; "
        f"Linux {platform.release()}, Python {platform.python_version()}, sglang {sglang.__version__}, "
        f"torch {torch.__version__}; load average at the start {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
        f"(the machine is shared with other engineers' tests: absolute numbers are noisy)"
    )


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
        + ", ".join(_rate_label(r) for r in spec.rates)
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


def parse_cluster_bench_args(p, argv, default_port: int = 31000):
    """The options every single-cluster benchmark shares (``--port``, ``--out``,
    ``--write-results``, ``--log-level``), parsed with the project's logging set
    up; a SIGTERM ends the run cleanly (its cluster stops)."""
    from bana_sglang import _cli

    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--log-level", default="INFO")
    args, _ = _cli.parse(p, list(argv) if argv is not None else None, lambda a: None)
    _cli.exit_on_sigterm()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return args


def write_results_section(section: str, title: str, body: str, path: Path = RESULTS_MD) -> None:
    """Replace (or append) the section between this section's markers."""
    begin, end = f"<!-- bench:{section}:begin -->", f"<!-- bench:{section}:end -->"
    block = f"{begin}\n## {title}\n\n{body}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        path.read_text()
        if path.exists()
        else (
            "# Benchmark results\n\nWritten by `python -m bench` (bench/sidebyside.py), not by hand: each section "
            "is replaced by the next run of its command.\n\n"
        )
    )
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    logger.info("wrote section %s of %s", section, path)
