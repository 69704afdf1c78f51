"""Side-by-side runs: configurations one after another on one machine.

For each configuration of a :class:`RunSpec`, in order: plan it
(:mod:`bench.configs`), start it with :class:`bana_sglang.launch.Cluster`,
warm it up with requests that share nothing with the workload, then for each
request rate flush every worker's prefix cache (and the global store, when the
configuration has one) and replay the same workload
(same seed, same prompts) while sampling the workers' ``/metrics``; stop it
(the context manager leaves no process behind) before the next one starts.
Nothing runs concurrently with a measured replay except the machine's other
tenants, which the report states.

Outputs under ``out_dir``: ``<config>@<rate>.records.jsonl`` (one request
per line), ``...load.jsonl`` (metrics samples), ``summary.json``, the three
PNG plots, the worker logs, and the markdown report (:mod:`bench.report`) that
:func:`bench.results.write_results_section` also places in ``docs/RESULTS.md``.

Sweep mode: rates ascend; a configuration stops at the first rate whose
goodput fraction falls below ``min_goodput``; its saturation throughput is
the achieved request rate at the highest rate that stayed above.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

from bana_sglang.launch import Cluster
from bench import breakdown, client, configs, metrics, workloads
from bench.client import ClientConfig, LoadSampler, RequestRecord
from bench.configs import Resources
from bench.metrics import SLO, Summary
from bench.results import ROOT
from bench.workloads import WorkloadSpec

logger = logging.getLogger(__name__)


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
    # the global store's per-request breakdown (configurations with the store only)
    store_metrics: dict | None = None
    router_metrics: dict | None = None

    @property
    def key(self) -> str:
        return f"{self.config}@{rate_label(self.rate)}"


def rate_label(rate: float | None) -> str:
    """A requested rate as the tables and file names write it: ``trace``, ``inf`` or ``0.5``."""
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
    ) as cluster:
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
            client.flush_caches(list(urls.values()), cluster.worker_headers())
            if plan.store:  # the global store too: every rate starts from an empty store
                cleared = cluster.clear_store()
                logger.info("%s: global store cleared (%s pages)", name, cleared)
            time.sleep(1.0)
            sampler = LoadSampler(urls, spec.sample_interval_s)
            before = breakdown.scrape(urls) if plan.store else None
            rbefore = breakdown.router_metrics(plan.endpoint) if plan.store else None
            logger.info("%s: replaying %s", name, wl.describe())
            records = client.replay(ccfg, wl, sampler)
            summary = metrics.summarize(records, spec.slo, sampler.samples)
            res = _save(name, rate, wl, records, sampler, summary, startup, spec.out_dir)
            if before is not None and rbefore is not None:
                time.sleep(1.0)  # publishing is asynchronous
                res = dataclasses.replace(
                    res,
                    store_metrics=breakdown.delta(breakdown.scrape(urls), before),
                    router_metrics={
                        k: v - rbefore.get(k, 0.0)
                        for k, v in breakdown.router_metrics(plan.endpoint).items()
                    },
                )
            results.append(res)
            print(metrics.format_summary(res.key, summary), flush=True)
            if spec.min_goodput is not None and summary.goodput_frac < spec.min_goodput:
                logger.info(
                    "%s saturated at %s req/s (goodput %.0f%% < %.0f%%)",
                    name,
                    rate_label(rate),
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
    stem = f"{name}@{rate_label(rate)}"
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
