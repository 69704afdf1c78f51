"""The at-scale comparison: runs the simulator over the named systems and writes
``docs/SIMULATION.md`` and PNG plots. Everything in the report is produced by
this module from the runs it just made (nothing is typed in by hand except the
published anchors, which are labelled as such).

Experiments:
- A (anchor): Mooncake's setting as closely as the profiles allow: the full
  conversation trace in real time on 16 workers of a 70B model on 8x A100-class
  GPUs (``a100_llama70b_tp8``; Mooncake used 16 x 8 A800).
- B (scale): ``h100_llama3_8b`` on 16/32/64 GPUs, the trace sped up by N/4 so
  that the offered load per GPU is constant; ``bana`` and global-cache-aware again
  at 98-102% of that load (``NUDGES``), to show how much the ratio moves.
- C (throughput): 32 GPUs, arrival rate swept; a system's throughput is the
  highest rate with >= 90% of requests meeting both SLOs, found on the grid and
  then bisected ``REFINE_STEPS`` times between the last rate that meets it and
  the first that does not (1/64 of the base rate).
- D (sensitivity): anchor setting with one assumption changed at a time.
- E (generated workloads): bursty, mixed, shared-prefix, long-context.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path

from bana_sglang.sim.config import SimConfig, system_config
from bana_sglang.sim.engine import simulate
from bana_sglang.sim.grid import (
    ALL,
    C_ROWS,
    NUDGES,
    OVERLAP_ROWS,
    REFINE_STEPS,
    SWEEP,
    next_probe,
    rates,
)
from bana_sglang.sim.metrics import SimResult
from bana_sglang.sim.profiles import load_profile
from bana_sglang.sim.report import write_report
from bana_sglang.sim.workloads import get_workload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    key: tuple
    system: str
    config: SimConfig
    workload: str
    workload_kw: tuple = field(default_factory=tuple)  # sorted (name, value) pairs


@functools.lru_cache(maxsize=8)
def _load(workload: str, kw: tuple):
    return get_workload(workload, **dict(kw))


def _run(spec: RunSpec) -> tuple[tuple, SimResult]:
    return spec.key, simulate(
        spec.config, _load(spec.workload, spec.workload_kw), system=spec.system
    )


def _mk(key, system, base: SimConfig, workload="mooncake", *, trace=None, **wkw) -> RunSpec:
    if trace is not None and workload == "mooncake":  # else the shipped copy
        wkw["path"] = str(trace)
    return RunSpec(key, system, system_config(system, base), workload, tuple(sorted(wkw.items())))


def _throughput_spec(m: float, row: str, quick: bool, trace=None) -> RunSpec:
    n = 16 if quick else 32
    lim = {"limit": 1500} if quick else {}
    overlap = OVERLAP_ROWS.get(row)
    base = SimConfig(profile="h100_llama3_8b", num_workers=n, decode_overlap=overlap or 0.0)
    system = "bana" if overlap is not None else row
    return _mk(("C", m, row), system, base, trace=trace, time_scale=m * n / 4, **lim)


def refine_throughput(results: dict[tuple, SimResult], jobs: int, quick: bool, trace=None) -> int:
    """Bisect every system's C rate between its last pass and first miss, in place;
    returns the number of runs added."""
    added = 0
    for _ in range(REFINE_STEPS):
        specs = []
        for s in C_ROWS:
            m = next_probe(rates(results, s))
            if m is not None:
                specs.append(_throughput_spec(m, s, quick, trace))
        if not specs:
            break
        results.update(run_all(specs, jobs))
        added += len(specs)
    return added


def build_specs(quick: bool, trace=None) -> list[RunSpec]:
    lim = {"limit": 1500} if quick else {}
    specs: list[RunSpec] = []
    anchor = SimConfig(profile="a100_llama70b_tp8", num_workers=16)
    for s in ALL:
        specs.append(_mk(("A", s), s, anchor, trace=trace, time_scale=1.0, **lim))
    for n in (16,) if quick else (16, 32, 64):
        base = SimConfig(profile="h100_llama3_8b", num_workers=n)
        for s in ALL:
            specs.append(_mk(("B", n, s), s, base, trace=trace, time_scale=n / 4, **lim))
        for f in () if quick else NUDGES:
            for s in ("bana", "global_cache_aware"):
                specs.append(_mk(("B~", n, f, s), s, base, trace=trace, time_scale=f * n / 4))
    for m in (1.0, 2.0) if quick else SWEEP:
        specs += [_throughput_spec(m, s, quick, trace) for s in C_ROWS]
    sens = {
        "store bandwidth x0.25": dict(store_bandwidth_scale=0.25),
        "store capacity x0.25": dict(store_capacity_scale=0.25),
        "no layer-wise load overlap": dict(layerwise_load=False),
        "P:D 6:10": dict(prefill_fraction=0.375),
        "P:D 10:6": dict(prefill_fraction=0.625),
        "decode overlaps guest layers 50%": dict(decode_overlap=0.5),
    }
    for label, ch in sens.items():
        for s in ("bana", "bana_no_migration", "global_cache_aware"):
            cfg = anchor.with_(**ch)
            specs.append(_mk(("D", label, s), s, cfg, trace=trace, time_scale=1.0, **lim))
    gens = {
        "bursty": dict(n=2000, on_rate=40.0, off_rate=2.0),
        "mixed": dict(n=2000, rate=15.0),
        "shared_prefix": dict(n=2000, rate=40.0),
        "long_context": dict(n=400, rate=3.0),
    }
    gen_base = SimConfig(profile="h100_llama3_8b", num_workers=16)
    for wl, kw in gens.items():
        if quick:
            kw = {**kw, "n": min(kw["n"], 300)}
        for s in ("bana", "bana_no_migration", "sglang_cache_aware", "load_only", "colocated"):
            specs.append(_mk(("E", wl, s), s, gen_base, wl, **kw))
    return specs


def run_all(specs: list[RunSpec], jobs: int) -> dict[tuple, SimResult]:
    if jobs <= 1:
        return dict(map(_run, specs))
    # Longest first keeps both processes busy to the end.
    order = sorted(specs, key=lambda s: -s.config.num_workers)
    with mp.get_context("fork").Pool(jobs) as pool:
        return dict(pool.imap_unordered(_run, order))


def run_comparison(
    out_md: str | Path,
    img_dir: str | Path,
    jobs: int = 2,
    quick: bool = False,
    trace: str | Path | None = None,
) -> dict[tuple, SimResult]:
    """Run A-E (``trace``: the Mooncake trace file; None: the shipped copy), write the
    report and plots, and return every run's result by key."""
    t0 = time.perf_counter()
    specs = build_specs(quick, trace)
    results = run_all(specs, jobs)
    refined = refine_throughput(results, jobs, quick, trace)
    wall = time.perf_counter() - t0
    write_report(
        results,
        Path(out_md),
        Path(img_dir),
        quick=quick,
        wall_s=wall,
        anchor=load_profile("a100_llama70b_tp8"),
        scale=load_profile("h100_llama3_8b"),
    )
    logger.info(
        "comparison: %s runs (%d of them bisecting C) in %.1fs", len(specs) + refined, refined, wall
    )
    return results
