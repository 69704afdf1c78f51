"""``python -m bench``: replay, side-by-side, sweep, cross-check, workloads, calibrate, fidelity.

Examples (from the repository root)::

    # replay a workload against any running OpenAI-compatible endpoint
    python -m bench replay --endpoint http://127.0.0.1:30000 --workload mooncake --num-requests 50 \\
        --time-scale 4 --length-scale 0.0625

    # the side-by-side table and plots (starts and stops every configuration itself)
    python -m bench side-by-side --workload shared-prefix --num-requests 24 --rates 0.5

    # saturation throughput of each configuration
    python -m bench sweep --rates 0.25,0.5,1,2 --min-goodput 0.9 --slo-ttft-ms 5000

    # agreement with SGLang's own benchmark
    python -m bench crosscheck --config colocated

    # the simulator's CPU profile fitted to the live 1P1D cluster, then checked against it
    python -m bench calibrate --model small --repeats 3
    python -m bench fidelity --requests 40 --rate 0.3 --repeats 3

Traces: the commands that read one take ``--trace PATH`` (default: the copy shipped
in ``bench/data/traces``).

Argument parsing lives here only; the commands (:mod:`bench.commands`,
:mod:`bench.calibrate`, :mod:`bench.fidelity`) build frozen configs from it.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from bana_sglang import _cli
from bana_sglang.sim.profiles import PROFILE_DIR
from bench import calibrate, commands, configs, fidelity, workloads

logger = logging.getLogger("bench")


def _add_workload(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        default="shared-prefix",
        choices=sorted(workloads.WORKLOADS),
        help="source: a trace (mooncake, azure) or a generator",
    )
    g.add_argument("--num-requests", type=int, default=24)
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="mean arrivals/s; traces: rescales the trace's own times to this mean rate "
        "(default: traces use --time-scale, generators 1.0)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--length-scale",
        type=float,
        default=1 / 16,
        help="traces: token counts x this; the Mooncake block of 512 tokens becomes 512 x this",
    )
    g.add_argument(
        "--output-scale",
        type=float,
        default=None,
        help="traces: output lengths x this (default: length scale)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="traces: inter-arrival times x this (2 = half the rate)",
    )
    g.add_argument("--trace-offset", type=int, default=0, help="traces: first row replayed")
    g.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="traces: the trace file (None: the shipped copy in bench/data/traces)",
    )
    g.add_argument(
        "--input-len", type=int, default=256, help="generators: question / prompt length (tokens)"
    )
    g.add_argument("--output-len", type=int, default=32, help="generators: output tokens")
    g.add_argument(
        "--num-groups", type=int, default=4, help="shared-prefix: number of system prompts"
    )
    g.add_argument(
        "--system-len", type=int, default=1024, help="shared-prefix: system prompt length (tokens)"
    )
    g.add_argument(
        "--zipf-alpha", type=float, default=0.0, help="shared-prefix: 0 = uniform groups, >0 Zipf"
    )
    g.add_argument("--burst-on-s", type=float, default=5.0)
    g.add_argument("--burst-off-s", type=float, default=5.0)
    g.add_argument(
        "--no-clip", action="store_true", help="do not clip requests to the model's context"
    )
    g.add_argument(
        "--model-path", default="tiny", help="model (embedded name or folder): tokens and context"
    )


def _add_slo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT (ms)")


def _add_resources(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("resources (identical for every configuration)")
    g.add_argument("--num-prefill", type=int, default=2)
    g.add_argument("--num-decode", type=int, default=1)
    g.add_argument(
        "--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of every SGLang process"
    )
    g.add_argument(
        "--kv-tokens-total",
        type=int,
        default=3 * 16384,
        help="total KV budget, split over the workers",
    )
    g.add_argument("--base-port", type=int, default=32000)
    g.add_argument(
        "--sglang-args",
        default="",
        help="extra SGLang flags for every worker of every configuration",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser(
        "replay",
        help="replay a workload against a running endpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument(
        "--endpoint", required=True, help="base URL of an OpenAI-compatible server or router"
    )
    r.add_argument(
        "--served-model-name", default=None, help="default: the first model of /v1/models"
    )
    r.add_argument(
        "--worker-metrics",
        nargs="*",
        default=[],
        metavar="NAME=URL",
        help="workers whose /metrics to sample for per-worker load",
    )
    r.add_argument(
        "--out", type=Path, default=Path("bench/runs/replay"), help="records and summary go here"
    )
    r.add_argument("--timeout-s", type=float, default=600.0)
    r.add_argument(
        "--prompt-mode",
        default="text",
        choices=["text", "ids"],
        help="text: stable-word text (works through sglang_router); ids: token-id list (plain servers)",
    )
    _add_workload(r)
    _add_slo(r)

    for name, helptext in (
        ("side-by-side", "run configurations one after another; table, ratios, plots"),
        ("sweep", "request-rate sweep: saturation throughput of each configuration"),
    ):
        s = sub.add_parser(
            name, help=helptext, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        s.add_argument(
            "--configs",
            default=",".join(configs.DEFAULT_CONFIGS),
            help=f"comma-separated, from: {', '.join(configs.CONFIGS)}",
        )
        s.add_argument(
            "--rates",
            default="trace" if name == "side-by-side" else "0.25,0.5,1,2",
            help="comma-separated request rates (req/s; 'inf' = all at once; 'trace' = the "
            "workload's own --request-rate / trace times)",
        )
        s.add_argument(
            "--out", type=Path, default=None, help="default: bench/runs/<command>-<UTC time>"
        )
        s.add_argument("--timeout-s", type=float, default=600.0)
        s.add_argument(
            "--warmup",
            type=int,
            default=2,
            help="warm-up requests per configuration (not measured)",
        )
        s.add_argument("--no-results-md", action="store_true", help="do not update docs/RESULTS.md")
        s.add_argument(
            "--from-dir",
            type=Path,
            default=None,
            help="start nothing: rebuild the table, plots and report of the finished run in DIR "
            "(give the run's own workload/resource arguments; metrics are recomputed)",
        )
        if name == "sweep":
            s.add_argument(
                "--min-goodput",
                type=float,
                default=0.9,
                help="a rate is sustained while this fraction of requests meets the SLO",
            )
        _add_workload(s)
        _add_slo(s)
        _add_resources(s)

    c = sub.add_parser(
        "crosscheck",
        help="compare with `python -m sglang.bench_serving` on the same workload",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    c.add_argument(
        "--config",
        default="single",
        help=f"one of: {', '.join(configs.CONFIGS)} (single: token-id prompts, exact lengths)",
    )
    c.add_argument("--groups", type=int, default=4)
    c.add_argument("--prompts-per-group", type=int, default=16)
    c.add_argument("--system-len", type=int, default=1024)
    c.add_argument("--question-len", type=int, default=128)
    c.add_argument("--output-len", type=int, default=32)
    c.add_argument(
        "--rate", type=float, default=math.inf, help="req/s for both tools; inf = all at once"
    )
    c.add_argument("--seed", type=int, default=1)
    c.add_argument(
        "--tol-throughput", type=float, default=0.15, help="relative tolerance on throughputs"
    )
    c.add_argument(
        "--tol-ttft", type=float, default=0.25, help="relative tolerance on mean/median TTFT"
    )
    c.add_argument("--out", type=Path, default=Path("bench/runs/crosscheck"))
    c.add_argument("--no-results-md", action="store_true")
    c.add_argument("--model-path", default="tiny")
    _add_resources(c)

    w = sub.add_parser(
        "workloads",
        help="describe a workload without sending anything",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w.add_argument("--save", type=Path, default=None, help="write the requests as JSON lines")
    _add_workload(w)
    _add_calibration(sub)
    return p


def _add_calibration(sub) -> None:
    """``calibrate`` and ``fidelity``: the simulator's CPU profile against the live cluster."""
    cal = sub.add_parser(
        "calibrate",
        help="measure the live 1P1D cluster on this machine and write a CPU profile",
        description="Start a 1P1D cluster, measure prefill, decode, host contention and joins "
        "one request at a time, and fit the simulator's CPU profile to them (bench/calibrate.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cal.add_argument("--model", default="small", help="embedded model name or folder")
    cal.add_argument(
        "--profile", default="cpu_small", help="the profile whose hardware and model it refines"
    )
    cal.add_argument(
        "--out",
        default=None,
        help="profile JSON to write (None: bana_sglang/sim/profiles/cpu_small_calibrated.json)",
    )
    cal.add_argument("--repeats", type=int, default=2, help="measurements of every point")
    cal.add_argument(
        "--measurements",
        default=None,
        help="refit the measurements of a previous run (its .fit.json) instead of measuring",
    )
    cal.add_argument("--port", type=int, default=31200, help="the router's port (workers above it)")
    cal.add_argument(
        "--log-dir", default=None, help="the cluster's logs (None: /tmp/bana-calibrate-<time>)"
    )
    cal.set_defaults(fn=calibrate.run_calibrate)
    fid = sub.add_parser(
        "fidelity",
        help="one trace slice on the live cluster and in the simulator: the errors",
        description="Replay one slice of the Mooncake conversation trace on a live 1P1D cluster "
        "and in the simulator with the calibrated profile; print the relative errors of mean and "
        "p99 TTFT, mean TPOT and throughput (bench/fidelity.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    fid.add_argument("--model", default="small", help="embedded model name or folder")
    fid.add_argument(
        "--profile-path",
        default=str(PROFILE_DIR / "cpu_small_calibrated.json"),
        help="the simulator's profile (from `python -m bench calibrate`)",
    )
    fid.add_argument("--requests", type=int, default=40, help="trace rows")
    fid.add_argument("--offset", type=int, default=0, help="first trace row")
    fid.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="the Mooncake conversation trace (None: the shipped copy in bench/data/traces)",
    )
    fid.add_argument(
        "--rate", type=float, default=0.5, help="mean request rate of the slice, req/s"
    )
    fid.add_argument(
        "--length-scale",
        type=float,
        default=1 / 16,
        help="trace token counts are multiplied by this",
    )
    fid.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="live replays, each on a fresh cluster; the simulator is compared with their mean "
        "and the runs' own spread is printed",
    )
    fid.add_argument("--port", type=int, default=31200, help="the router's port (workers above it)")
    fid.add_argument(
        "--log-dir", default=None, help="the clusters' logs (None: /tmp/bana-fidelity-<time>)"
    )
    fid.add_argument("--json", default=None, help="also write the rows here")
    fid.add_argument(
        "--write-results", action="store_true", help="replace this run's section of docs/RESULTS.md"
    )
    fid.add_argument("--results-key", default="sim-fidelity", help="its section's marker")
    fid.add_argument(
        "--results-title", default="Simulator fidelity (live vs simulated, one trace slice)"
    )
    fid.set_defaults(fn=fidelity.run_fidelity)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)

    _cli.exit_on_sigterm()  # unwinds through Cluster.__exit__: every started process stops
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.cmd in ("calibrate", "fidelity"):
        return a.fn(a)
    try:
        if a.cmd == "replay":
            return commands.cmd_replay(a)
        if a.cmd in ("side-by-side", "sweep"):
            return commands.cmd_side_by_side(a, argv)
        if a.cmd == "crosscheck":
            return commands.cmd_crosscheck(a, argv)
        return commands.cmd_workloads(a)
    except (workloads.WorkloadError, configs.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
