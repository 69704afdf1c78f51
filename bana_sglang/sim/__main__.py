"""``python -m bana_sglang.sim``: run one simulated configuration, or the comparison.

    python -m bana_sglang.sim run --system bana --workers 64 --time-scale 16
    python -m bana_sglang.sim run --routing cache_aware --store local --workload shared_prefix
    python -m bana_sglang.sim compare            # writes docs/SIMULATION.md + docs/img/sim_*.png
    python -m bana_sglang.sim report             # re-render it from docs/img/sim_results.json
    python -m bana_sglang.sim profiles           # list the cost-model profiles

argparse lives here only; everything below takes frozen configs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from bana_sglang import _cli
from bana_sglang.balancer.policy import BALANCERS
from bana_sglang.router.policy import POLICIES
from bana_sglang.sim.config import STORES, SYSTEMS, SimConfig, system_config
from bana_sglang.sim.engine import simulate
from bana_sglang.sim.profiles import list_profiles, load_profile
from bana_sglang.sim.workloads import WORKLOADS, get_workload


def _workload(args) -> list:
    kw: dict = {}
    if args.workload in ("mooncake", "azure"):
        kw["time_scale"] = args.time_scale
        if args.limit:
            kw["limit"] = args.limit
    else:
        kw["seed"] = args.seed
        if args.limit:
            kw["n"] = args.limit
    return get_workload(args.workload, **kw)


def cmd_run(args) -> int:
    base = SimConfig(profile=args.profile, num_workers=args.workers,
                     prefill_fraction=args.prefill_fraction, seed=args.seed,
                     slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    if args.system:
        cfg = system_config(args.system, base)
    else:
        cfg = base.with_(routing=args.routing, balancer=args.balancer, store=args.store,
                         colocated=args.colocated)
    reqs = _workload(args)
    t0 = time.perf_counter()
    res = simulate(cfg, reqs, system=args.system or args.routing)
    out = res.row()
    out["wall_total_s"] = time.perf_counter() - t0
    print(json.dumps(out, indent=2))
    return 0


def cmd_compare(args) -> int:
    from bana_sglang.sim.compare import run_comparison

    run_comparison(out_md=args.out, img_dir=args.img_dir, jobs=args.jobs, quick=args.quick)
    return 0


def cmd_report(args) -> int:
    from pathlib import Path

    from bana_sglang.sim.report import load_results, write_report

    results, meta = load_results(Path(args.results))
    write_report(results, Path(args.out), Path(args.img_dir), quick=bool(meta.get("quick")),
                 wall_s=float(meta.get("wall_s", 0.0)), anchor=load_profile("a100_llama70b_tp8"),
                 scale=load_profile("h100_llama3_8b"), when=meta.get("when"))
    return 0


def cmd_profiles(_args) -> int:
    for name in list_profiles():
        p = load_profile(name)
        print(f"{name:22s} gpus={p.gpus} kv_capacity={p.kv_capacity_tokens} tokens "
              f"prefill~{p.prefill_tokens_per_s:,.0f} tok/s "
              f"decode step(B=32, 32x8K KV)={p.decode_step_seconds(32, 32 * 8192) * 1e3:.1f} ms")
    return 0


def _lazy(module: str, name: str):
    """``bana_sglang.sim.<module>.<name>``, imported when the command runs (they load
    the live harness)."""
    def run(args) -> int:
        import importlib

        return getattr(importlib.import_module(f"bana_sglang.sim.{module}"), name)(args)

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bana_sglang.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate one configuration; prints the summary as JSON")
    r.add_argument("--system", choices=sorted(SYSTEMS), help="a named system (overrides the "
                   "routing/balancer/store/colocated flags)")
    r.add_argument("--routing", default="bana", choices=sorted(POLICIES))
    r.add_argument("--balancer", default="none", choices=sorted(BALANCERS))
    r.add_argument("--store", default="global", choices=STORES)
    r.add_argument("--colocated", action="store_true")
    r.add_argument("--profile", default="h100_llama3_8b",
                   help=f"a profile name ({', '.join(list_profiles())}) or a JSON path")
    r.add_argument("--workers", type=int, default=16)
    r.add_argument("--prefill-fraction", type=float, default=0.5)
    r.add_argument("--workload", default="mooncake", choices=sorted(WORKLOADS))
    r.add_argument("--time-scale", type=float, default=1.0, help="trace replay speed-up")
    r.add_argument("--limit", type=int, default=0, help="requests (0: whole trace / default)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--slo-ttft", type=float, default=10.0)
    r.add_argument("--slo-tpot", type=float, default=0.1)
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("compare", help="the at-scale comparison; writes the report and plots")
    c.add_argument("--out", default="docs/SIMULATION.md")
    c.add_argument("--img-dir", default="docs/img")
    c.add_argument("--jobs", type=int, default=2, help="parallel simulation processes")
    c.add_argument("--quick", action="store_true", help="small slices (smoke test)")
    c.set_defaults(fn=cmd_compare)
    rp = sub.add_parser("report", help="re-render the report from a saved sim_results.json")
    rp.add_argument("--results", default="docs/img/sim_results.json")
    rp.add_argument("--out", default="docs/SIMULATION.md")
    rp.add_argument("--img-dir", default="docs/img")
    rp.set_defaults(fn=cmd_report)
    cal = sub.add_parser("calibrate", help="measure the live 1P1D cluster on this machine and write a CPU profile")
    cal.add_argument("--model", default="small", help="embedded model name or folder")
    cal.add_argument("--profile", default="cpu_small", help="the profile whose hardware and model it refines")
    cal.add_argument("--out", default=None, help="profile JSON to write (default profiles/cpu_small_calibrated.json)")
    cal.add_argument("--repeats", type=int, default=2)
    cal.add_argument("--measurements", default=None,
                     help="refit the measurements of a previous run (its .fit.json) instead of measuring")
    cal.add_argument("--port", type=int, default=31200)
    cal.add_argument("--log-dir", default=None)
    cal.set_defaults(fn=_lazy("calibrate", "run_calibrate"))
    fid = sub.add_parser("fidelity", help="one trace slice on the live cluster and in the simulator: the errors")
    fid.add_argument("--model", default="small")
    fid.add_argument("--profile-path", default=str(Path(__file__).parent / "profiles" / "cpu_small_calibrated.json"))
    fid.add_argument("--requests", type=int, default=40, help="trace rows")
    fid.add_argument("--offset", type=int, default=0, help="first trace row")
    fid.add_argument("--rate", type=float, default=0.5, help="mean request rate of the slice, req/s")
    fid.add_argument("--length-scale", type=float, default=1 / 16, help="trace token counts are multiplied by this")
    fid.add_argument("--repeats", type=int, default=1,
                     help="live replays, each on a fresh cluster; the simulator is compared with their mean "
                          "and the runs' own spread is printed")
    fid.add_argument("--port", type=int, default=31200)
    fid.add_argument("--log-dir", default=None)
    fid.add_argument("--json", default=None, help="also write the rows here")
    fid.add_argument("--write-results", action="store_true", help="replace this run's section of docs/RESULTS.md")
    fid.add_argument("--results-key", default="sim-fidelity")
    fid.add_argument("--results-title", default="Simulator fidelity (live vs simulated, one trace slice)")
    fid.set_defaults(fn=_lazy("fidelity", "run_fidelity"))
    p = sub.add_parser("profiles", help="list profiles with derived figures")
    p.set_defaults(fn=cmd_profiles)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.cmd in ("calibrate", "fidelity"):
        # they run live clusters inside ``with``: SIGTERM must unwind it, or SGLang's
        # grandchildren outlive the command (seen: two detokenizers after a killed calibrate)
        _cli.exit_on_sigterm()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
