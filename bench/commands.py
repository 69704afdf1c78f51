"""The commands of ``python -m bench`` (replay, side-by-side, sweep, crosscheck,
workloads): each turns the parsed arguments into frozen configs, runs, prints
and writes its results. The parser itself is :mod:`bench.__main__`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import sys
import time
from pathlib import Path

from bench import client, configs, crosscheck, metrics, report, sidebyside, workloads
from bench.results import machine_description, write_results_section


def parse_rates(text: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        out.append(
            None if item in ("trace", "none") else (math.inf if item == "inf" else float(item))
        )
    return tuple(out)


def workload_spec(a: argparse.Namespace) -> workloads.WorkloadSpec:
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


def slo(a: argparse.Namespace) -> metrics.SLO:
    return metrics.SLO(
        ttft_s=a.slo_ttft_ms / 1000 if a.slo_ttft_ms else None,
        tpot_s=a.slo_tpot_ms / 1000 if a.slo_tpot_ms else None,
    )


def resources(a: argparse.Namespace) -> configs.Resources:
    return configs.Resources(
        model_path=a.model_path,
        num_prefill=a.num_prefill,
        num_decode=a.num_decode,
        omp_threads=a.omp_threads,
        kv_tokens_total=a.kv_tokens_total,
        base_port=a.base_port,
        extra_sglang_args=tuple(shlex.split(a.sglang_args)),
    )


def command_line(argv: list[str]) -> str:
    return "python -m bench " + shlex.join(argv)


def cmd_replay(a: argparse.Namespace) -> int:
    space = workloads.TokenSpace.from_model(configs.model_dir(a.model_path))
    wl = workloads.build(workload_spec(a), space)
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
    summary = metrics.summarize(records, slo(a), sampler.samples if sampler else ())
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
    machine = machine_description()  # before anything starts: the load average is the others'
    rates = parse_rates(a.rates)
    if a.cmd == "sweep":
        if None in rates:
            raise configs.ConfigError("a sweep needs numeric --rates")
        rates = tuple(sorted(rates))  # ascending: a configuration stops at its first failing rate
    spec = sidebyside.RunSpec(
        configs=tuple(x.strip() for x in a.configs.split(",") if x.strip()),
        workload=workload_spec(a),
        resources=resources(a),
        rates=rates,
        slo=slo(a),
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
    plots = report.plot_all(results, out)
    command = command_line(argv)
    if a.from_dir is not None:  # state the measuring command, and how this report was made from it
        i = next(k for k, x in enumerate(argv) if x.startswith("--from-dir"))
        measuring = argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]
        command = command_line(measuring)
    text = report.report(spec, results, command, plots, machine, started, wall, flags)
    (out / "report.md").write_text(text + "\n")
    print("\n" + text)
    if not a.no_results_md:
        write_results_section(
            a.cmd, "Side-by-side" if a.cmd == "side-by-side" else "Request-rate sweep", text
        )
    return 0 if results else 1


def cmd_crosscheck(a: argparse.Namespace, argv: list[str]) -> int:
    started = dt.datetime.now(dt.UTC)
    machine = machine_description()
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
    res = resources(a)
    comps, theirs, ours, their_argv = crosscheck.run(spec, res)
    verdict = "AGREE" if all(c.ok for c in comps) else "DISAGREE"
    text = "\n".join(
        [
            f"Date: {started:%Y-%m-%d %H:%M} UTC. Command: `{command_line(argv)}`",
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
        write_results_section("crosscheck", "Cross-check against sglang.bench_serving", text)
    return 0 if verdict == "AGREE" else 2


def cmd_workloads(a: argparse.Namespace) -> int:
    wl = workloads.build(
        workload_spec(a), workloads.TokenSpace.from_model(configs.model_dir(a.model_path))
    )
    print(wl.describe(), *wl.notes, sep="\n")
    if a.save:
        workloads.save_jsonl(wl, a.save)
    return 0
