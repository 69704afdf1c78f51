"""``python -m bana_sglang.sim``: run one simulated configuration, or the comparison.

    python -m bana_sglang.sim run --system bana --workers 64 --time-scale 16
    python -m bana_sglang.sim run --routing cache_aware --store local --workload shared_prefix
    python -m bana_sglang.sim compare            # writes docs/SIMULATION.md + docs/img/sim_*.png
    python -m bana_sglang.sim report             # re-render it from docs/img/sim_results.json
    python -m bana_sglang.sim profiles           # list the cost-model profiles

Fitting a CPU profile to the live cluster and checking the simulator against it
start live clusters, so they live with the benchmarks: ``python -m bench calibrate``
and ``python -m bench fidelity``.

argparse lives here only; everything below takes frozen configs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from bana_sglang.balancer.policy import BALANCERS
from bana_sglang.router.policy import POLICIES
from bana_sglang.sim.compare import run_comparison
from bana_sglang.sim.config import STORES, SYSTEMS, SimConfig, system_config
from bana_sglang.sim.engine import simulate
from bana_sglang.sim.profiles import list_profiles, load_profile
from bana_sglang.sim.report import load_results, write_report
from bana_sglang.sim.workloads import WORKLOADS, get_workload


def _workload(args) -> list:
    kw: dict = {}
    if args.workload in ("mooncake", "azure"):
        kw["time_scale"] = args.time_scale
        if args.trace:
            kw["path"] = args.trace
        if args.limit:
            kw["limit"] = args.limit
    else:
        kw["seed"] = args.seed
        if args.limit:
            kw["n"] = args.limit
    return get_workload(args.workload, **kw)


def cmd_run(args) -> int:
    base = SimConfig(
        profile=args.profile,
        num_workers=args.workers,
        prefill_fraction=args.prefill_fraction,
        seed=args.seed,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
    )
    if args.system:
        cfg = system_config(args.system, base)
    else:
        cfg = base.with_(
            routing=args.routing, balancer=args.balancer, store=args.store, colocated=args.colocated
        )
    reqs = _workload(args)
    t0 = time.perf_counter()
    res = simulate(cfg, reqs, system=args.system or args.routing)
    out = res.row()
    out["wall_total_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=2))
    return 0


def cmd_compare(args) -> int:
    run_comparison(
        out_md=args.out, img_dir=args.img_dir, jobs=args.jobs, quick=args.quick, trace=args.trace
    )
    return 0


def cmd_report(args) -> int:
    results, meta = load_results(Path(args.results))
    write_report(
        results,
        Path(args.out),
        Path(args.img_dir),
        quick=bool(meta.get("quick")),
        wall_s=float(meta.get("wall_s", 0.0)),
        anchor=load_profile("a100_llama70b_tp8"),
        scale=load_profile("h100_llama3_8b"),
        when=meta.get("when"),
    )
    return 0


def cmd_profiles(_args) -> int:
    for name in list_profiles():
        p = load_profile(name)
        print(
            f"{name:22s} gpus={p.gpus} kv_capacity={p.kv_capacity_tokens} tokens "
            f"prefill~{p.prefill_tokens_per_s:,.0f} tok/s "
            f"decode step(B=32, 32x8K KV)={p.decode_step_seconds(32, 32 * 8192) * 1e3:.1f} ms"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bana_sglang.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate one configuration; prints the summary as JSON")
    r.add_argument(
        "--system",
        choices=sorted(SYSTEMS),
        help="a named system (overrides the routing/balancer/store/colocated flags)",
    )
    r.add_argument("--routing", default="bana", choices=sorted(POLICIES))
    r.add_argument("--balancer", default="none", choices=sorted(BALANCERS))
    r.add_argument("--store", default="global", choices=STORES)
    r.add_argument("--colocated", action="store_true")
    r.add_argument(
        "--profile",
        default="h100_llama3_8b",
        help=f"a profile name ({', '.join(list_profiles())}) or a JSON path",
    )
    r.add_argument("--workers", type=int, default=16)
    r.add_argument("--prefill-fraction", type=float, default=0.5)
    r.add_argument("--workload", default="mooncake", choices=sorted(WORKLOADS))
    r.add_argument("--time-scale", type=float, default=1.0, help="trace replay speed-up")
    r.add_argument("--limit", type=int, default=0, help="requests (0: whole trace / default)")
    r.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="mooncake/azure: the trace file (default: the shipped copy in bench/data/traces)",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--slo-ttft", type=float, default=10.0)
    r.add_argument("--slo-tpot", type=float, default=0.1)
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("compare", help="the at-scale comparison; writes the report and plots")
    c.add_argument("--out", default="docs/SIMULATION.md")
    c.add_argument("--img-dir", default="docs/img")
    c.add_argument("--jobs", type=int, default=2, help="parallel simulation processes")
    c.add_argument("--quick", action="store_true", help="small slices (smoke test)")
    c.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="the Mooncake conversation trace of A-D (default: the shipped copy in "
        "bench/data/traces)",
    )
    c.set_defaults(fn=cmd_compare)
    rp = sub.add_parser("report", help="re-render the report from a saved sim_results.json")
    rp.add_argument("--results", default="docs/img/sim_results.json")
    rp.add_argument("--out", default="docs/SIMULATION.md")
    rp.add_argument("--img-dir", default="docs/img")
    rp.set_defaults(fn=cmd_report)
    p = sub.add_parser("profiles", help="list profiles with derived figures")
    p.set_defaults(fn=cmd_profiles)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
