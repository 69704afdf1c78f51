"""``python -m bench``: replay, side-by-side, sweep, cross-check, workloads.

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

Argument parsing lives here only; everything below takes frozen configs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import math
import shlex
import sys
import time
from pathlib import Path

from bana_sglang import _cli
from bana_sglang.sim.profiles import PROFILE_DIR
from bench import calibrate, client, configs, crosscheck, fidelity, metrics, sidebyside, workloads

logger = logging.getLogger("bench")


def _rates(text: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        out.append(
            None if item in ("trace", "none") else (math.inf if item == "inf" else float(item))
        )
    return tuple(out)


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
        help="traces: the trace file (default: the shipped copy in bench/data/traces)",
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


def _workload_spec(a: argparse.Namespace) -> workloads.WorkloadSpec:
    return workloads.WorkloadSpec(
        name=a.workload,
        num_requests=a.num_requests,
        request_rate=a.request_rate,
        seed=a.seed,
        length_scale=a.length_scale,
        output_scale=a.output_scale,
        time_scale=a.time_scale,
        trace_offset=a.trace_offset,
        trace=a.trace,
        input_len=a.input_len,
        output_len=a.output_len,
        num_groups=a.num_groups,
        system_len=a.system_len,
        zipf_alpha=a.zipf_alpha,
        burst_on_s=a.burst_on_s,
        burst_off_s=a.burst_off_s,
        clip=not a.no_clip,
    )


def _slo(a: argparse.Namespace) -> metrics.SLO:
    return metrics.SLO(
        ttft_s=a.slo_ttft_ms / 1000 if a.slo_ttft_ms else None,
        tpot_s=a.slo_tpot_ms / 1000 if a.slo_tpot_ms else None,
    )


def _resources(a: argparse.Namespace) -> configs.Resources:
    return configs.Resources(
        model_path=a.model_path,
        num_prefill=a.num_prefill,
        num_decode=a.num_decode,
        omp_threads=a.omp_threads,
        kv_tokens_total=a.kv_tokens_total,
        base_port=a.base_port,
        extra_sglang_args=tuple(shlex.split(a.sglang_args)),
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
        "calibrate", help="measure the live 1P1D cluster on this machine and write a CPU profile"
    )
    cal.add_argument("--model", default="small", help="embedded model name or folder")
    cal.add_argument(
        "--profile", default="cpu_small", help="the profile whose hardware and model it refines"
    )
    cal.add_argument(
        "--out",
        default=None,
        help="profile JSON to write (default profiles/cpu_small_calibrated.json)",
    )
    cal.add_argument("--repeats", type=int, default=2)
    cal.add_argument(
        "--measurements",
        default=None,
        help="refit the measurements of a previous run (its .fit.json) instead of measuring",
    )
    cal.add_argument("--port", type=int, default=31200)
    cal.add_argument("--log-dir", default=None)
    cal.set_defaults(fn=calibrate.run_calibrate)
    fid = sub.add_parser(
        "fidelity", help="one trace slice on the live cluster and in the simulator: the errors"
    )
    fid.add_argument("--model", default="small")
    fid.add_argument("--profile-path", default=str(PROFILE_DIR / "cpu_small_calibrated.json"))
    fid.add_argument("--requests", type=int, default=40, help="trace rows")
    fid.add_argument("--offset", type=int, default=0, help="first trace row")
    fid.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="the Mooncake conversation trace (default: the shipped copy in bench/data/traces)",
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
    fid.add_argument("--port", type=int, default=31200)
    fid.add_argument("--log-dir", default=None)
    fid.add_argument("--json", default=None, help="also write the rows here")
    fid.add_argument(
        "--write-results", action="store_true", help="replace this run's section of docs/RESULTS.md"
    )
    fid.add_argument("--results-key", default="sim-fidelity")
    fid.add_argument(
        "--results-title", default="Simulator fidelity (live vs simulated, one trace slice)"
    )
    fid.set_defaults(fn=fidelity.run_fidelity)


def _command_line(argv: list[str]) -> str:
    return "python -m bench " + shlex.join(argv)


def cmd_replay(a: argparse.Namespace) -> int:
    space = workloads.TokenSpace.from_model(configs.model_dir(a.model_path))
    wl = workloads.build(_workload_spec(a), space)
    model = a.served_model_name
    if model is None:
        import urllib.request

        with urllib.request.urlopen(a.endpoint.rstrip("/") + "/v1/models", timeout=10) as resp:
            model = json.load(resp)["data"][0]["id"]
    sampler = None
    if a.worker_metrics:
        sampler = client.LoadSampler(dict(item.split("=", 1) for item in a.worker_metrics))
    print(wl.describe(), *wl.notes, sep="\n")
    ccfg = client.ClientConfig(
        a.endpoint, model, space=space, prompt_mode=a.prompt_mode, timeout_s=a.timeout_s
    )
    records = client.replay(ccfg, wl, sampler)
    summary = metrics.summarize(records, _slo(a), sampler.samples if sampler else ())
    a.out.mkdir(parents=True, exist_ok=True)
    with (a.out / "records.jsonl").open("w") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json()) + "\n")
    (a.out / "summary.json").write_text(json.dumps(summary.to_json(), indent=1, default=str))
    print(metrics.format_summary(f"{a.workload} @ {a.endpoint}", summary))
    print(f"records: {a.out / 'records.jsonl'}")
    return 0 if summary.ok else 1


def cmd_side_by_side(a: argparse.Namespace, argv: list[str]) -> int:
    started = dt.datetime.now(dt.UTC)
    out = a.out or a.from_dir or Path("bench/runs") / f"{a.cmd}-{started:%Y%m%d-%H%M%S}"
    machine = (
        sidebyside.machine_description()
    )  # before anything starts: the load average is the others'
    rates = _rates(a.rates)
    if a.cmd == "sweep":
        if None in rates:
            raise configs.ConfigError("a sweep needs numeric --rates")
        rates = tuple(sorted(rates))  # ascending: a configuration stops at its first failing rate
    spec = sidebyside.RunSpec(
        configs=tuple(x.strip() for x in a.configs.split(",") if x.strip()),
        workload=_workload_spec(a),
        resources=_resources(a),
        rates=rates,
        slo=_slo(a),
        out_dir=out,
        warmup=a.warmup,
        timeout_s=a.timeout_s,
        min_goodput=getattr(a, "min_goodput", None),
    )
    t0 = time.monotonic()
    if a.from_dir is not None:
        results = sidebyside.load_results(a.from_dir, spec.slo)
        finished = dt.datetime.fromtimestamp((a.from_dir / "summary.json").stat().st_mtime, dt.UTC)
        try:  # the run's folder is named after its start time
            began = dt.datetime.strptime(
                a.from_dir.name.split("-", 1)[1][-15:], "%Y%m%d-%H%M%S"
            ).replace(tzinfo=dt.UTC)
        except ValueError:
            began = finished
        old = (a.from_dir / "report.md").read_text() if (a.from_dir / "report.md").exists() else ""
        line = next((x for x in old.splitlines() if x.startswith("Machine: ")), "")
        machine = (
            line[len("Machine: ") :].rstrip(".") if line else f"{machine} (load: at re-rendering)"
        ) + (
            f"; measured by the run in `{a.from_dir}`, report re-rendered from its records with `--from-dir` "
            f"at {started:%H:%M} UTC"
        )
        started, wall = began, (finished - began).total_seconds()
        mark = "SGLang flags of every worker (besides model, ports and PD role): `"
        flag_line = next((x for x in old.splitlines() if x.startswith(mark)), "")
        flags = flag_line[len(mark) :].rstrip("`.") if flag_line else "not recorded by that run"
    else:
        results = sidebyside.run(spec)
        wall, flags = time.monotonic() - t0, None
    plots = sidebyside.plot_all(results, out)
    command = _command_line(argv)
    if a.from_dir is not None:  # state the measuring command, and how this report was made from it
        i = next(k for k, x in enumerate(argv) if x.startswith("--from-dir"))
        measuring = argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]
        command = _command_line(measuring)
    text = sidebyside.report(spec, results, command, plots, machine, started, wall, flags)
    (out / "report.md").write_text(text + "\n")
    print("\n" + text)
    if not a.no_results_md:
        sidebyside.write_results_section(
            a.cmd, "Side-by-side" if a.cmd == "side-by-side" else "Request-rate sweep", text
        )
    return 0 if results else 1


def cmd_crosscheck(a: argparse.Namespace, argv: list[str]) -> int:
    started = dt.datetime.now(dt.UTC)
    machine = sidebyside.machine_description()
    spec = crosscheck.CrossCheckSpec(
        config=a.config,
        groups=a.groups,
        prompts_per_group=a.prompts_per_group,
        system_len=a.system_len,
        question_len=a.question_len,
        output_len=a.output_len,
        rate=a.rate,
        seed=a.seed,
        tol_throughput=a.tol_throughput,
        tol_ttft=a.tol_ttft,
        out_dir=a.out,
    )
    res = _resources(a)
    comps, theirs, ours, their_argv = crosscheck.run(spec, res)
    verdict = "AGREE" if all(c.ok for c in comps) else "DISAGREE"
    text = "\n".join(
        [
            f"Date: {started:%Y-%m-%d %H:%M} UTC. Command: `{_command_line(argv)}`",
            f"Machine: {machine}.",
            f"Configuration `{spec.config}` ({configs.get(spec.config).description}); "
            + (
                f"one process, OMP_NUM_THREADS={res.omp_threads}, --max-total-tokens {res.kv_tokens_total}."
                if spec.config == "single"
                else f"{res.describe()}."
            ),
            f"Workload: shared prefix, {spec.groups} groups x {spec.prompts_per_group} prompts, system "
            f"{spec.system_len} + question {spec.question_len} tokens, {spec.output_len} output tokens, rate "
            f"{spec.rate:g} req/s; each tool draws its own token ids; prefix caches flushed before each tool.",
            f"SGLang's tool: `{' '.join(Path(x).name if x == sys.executable else x for x in their_argv)}`",
            "",
            crosscheck.table(comps, ours, theirs),
            "",
            f"Verdict: {verdict} (throughput within {spec.tol_throughput:.0%}, TTFT within {spec.tol_ttft:.0%}).",
        ]
    )
    print("\n" + text)
    if not a.no_results_md:
        sidebyside.write_results_section(
            "crosscheck", "Cross-check against sglang.bench_serving", text
        )
    return 0 if verdict == "AGREE" else 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)

    _cli.exit_on_sigterm()  # unwinds through Cluster.__exit__: every started process stops
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.cmd in ("calibrate", "fidelity"):
        return a.fn(a)
    try:
        if a.cmd == "replay":
            return cmd_replay(a)
        if a.cmd in ("side-by-side", "sweep"):
            return cmd_side_by_side(a, argv)
        if a.cmd == "crosscheck":
            return cmd_crosscheck(a, argv)
        wl = workloads.build(
            _workload_spec(a), workloads.TokenSpace.from_model(configs.model_dir(a.model_path))
        )
        print(wl.describe(), *wl.notes, sep="\n")
        if a.save:
            workloads.save_jsonl(wl, a.save)
        return 0
    except (workloads.WorkloadError, configs.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
