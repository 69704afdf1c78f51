"""Cross-check the harness against SGLang's own benchmark on the same workload.

One configuration is started; on it, with every worker's prefix cache
flushed before each run:

1. this harness replays a ``shared-prefix`` workload (``groups`` system
   prompts of ``system_len`` token ids, ``prompts_per_group`` questions of
   ``question_len`` ids each, ``output_len`` output tokens, ``ignore_eos``);
2. ``python -m sglang.bench_serving --backend sglang|sglang-oai --dataset-name
   generated-shared-prefix`` runs the same shape (same counts, lengths fixed
   with ``--gsp-range-ratio 1``, its own random tokens and order) at the same
   request rate, no warm-up of its own, and writes its JSON result.

Before either, the server gets the usual warm-up plus one untimed run of the
same shape with other tokens, so neither tool meets the first large batches
of a fresh server. On the default configuration ``single`` (one plain
server, no router) both tools send token ids: the prompt lengths are exactly
equal (bench_serving takes ``--tokenize-prompt`` only with ``--backend
sglang``, i.e. SGLang's native ``/generate`` with ``input_ids``, while this
harness uses ``/v1/completions``: the same server work behind two APIs). Behind the stock router (which rejects
token-id prompts) both send text; bench_serving's random tokens then
re-tokenize to about 25% longer prompts than nominal, and the report shows
both tools' input totals.

Then request throughput, output token throughput and mean/median TTFT are
compared; each pair must agree within a stated relative tolerance. With
``rate=inf`` (the default) both send everything at once, so both measure the
server's capacity and queueing rather than two different random arrival
sequences.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

from bana_sglang import compat
from bana_sglang.launch import Cluster
from bench import client, configs, metrics, workloads
from bench.client import ClientConfig
from bench.configs import Resources
from bench.sidebyside import warmup

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CrossCheckSpec:
    config: str = "single"
    groups: int = 4
    prompts_per_group: int = 16
    system_len: int = 1024
    question_len: int = 128
    output_len: int = 32
    rate: float = math.inf
    seed: int = 1
    tol_throughput: float = 0.15  # relative
    tol_ttft: float = 0.25  # relative
    out_dir: Path = Path("bench/runs/crosscheck")
    timeout_s: float = 900.0

    @property
    def num_requests(self) -> int:
        return self.groups * self.prompts_per_group


@dataclasses.dataclass(frozen=True)
class Comparison:
    metric: str
    harness: float
    sglang: float
    tolerance: float

    @property
    def rel_diff(self) -> float:
        return abs(self.harness - self.sglang) / max(abs(self.sglang), 1e-12)

    @property
    def ok(self) -> bool:
        return self.rel_diff <= self.tolerance


def _ids_ok(config: str) -> bool:
    """Token-id prompts reach the server only without the stock router in front."""
    return configs.get(config).name == "single"


def _bench_serving_argv(
    spec: CrossCheckSpec, endpoint: str, model: str, model_path: str, out: Path
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang" if _ids_ok(spec.config) else "sglang-oai",
        "--base-url",
        endpoint,
        "--model",
        model,
        "--tokenizer",
        model_path,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        str(spec.groups),
        "--gsp-prompts-per-group",
        str(spec.prompts_per_group),
        "--gsp-system-prompt-len",
        str(spec.system_len),
        "--gsp-question-len",
        str(spec.question_len),
        "--gsp-output-len",
        str(spec.output_len),
        "--gsp-range-ratio",
        "1.0",
        "--num-prompts",
        str(spec.num_requests),
        "--request-rate",
        str(spec.rate),
        "--seed",
        str(spec.seed),
        "--warmup-requests",
        "0",
        "--output-file",
        str(out),
        "--disable-tqdm",
    ]
    return argv + (["--tokenize-prompt"] if _ids_ok(spec.config) else [])


def run(
    spec: CrossCheckSpec, res: Resources
) -> tuple[list[Comparison], dict, metrics.Summary, list[str]]:
    space = workloads.TokenSpace.from_model(configs.model_dir(res.model_path))
    wl_spec = workloads.WorkloadSpec(
        name="shared-prefix",
        num_requests=spec.num_requests,
        request_rate=spec.rate,
        seed=spec.seed,
        num_groups=spec.groups,
        system_len=spec.system_len,
        input_len=spec.question_len,
        output_len=spec.output_len,
    )
    wl = workloads.build(wl_spec, space)
    plan = configs.get(spec.config).plan(res)
    urls = list(configs.worker_urls(plan).values())
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    out_file = spec.out_dir / "sglang_bench_serving.jsonl"
    out_file.unlink(missing_ok=True)
    with Cluster(plan, log_dir=spec.out_dir / "logs", startup_timeout=600) as cluster:
        ccfg = ClientConfig(
            endpoint=plan.endpoint,
            model=plan.served_model_name,
            space=space,
            prompt_mode="ids" if _ids_ok(spec.config) else "text",
            timeout_s=spec.timeout_s,
        )
        warmup(ccfg, space, 2)  # the same warm-up as a side-by-side run
        # ... plus one untimed run of the same shape (other tokens), so that neither
        # tool meets the first large batches of a fresh server (order bias)
        client.replay(
            dataclasses.replace(ccfg, progress=False),
            workloads.build(dataclasses.replace(wl_spec, seed=spec.seed + 1000), space),
        )
        client.flush_caches(urls, cluster.worker_headers())
        time.sleep(1.0)
        sampler = client.LoadSampler(configs.worker_urls(plan))
        records = client.replay(ccfg, wl, sampler)
        ours = metrics.summarize(records, metrics.SLO(), sampler.samples)
        with (spec.out_dir / "harness.records.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps(r.to_json()) + "\n")
        print(metrics.format_summary("harness", ours), flush=True)
        client.flush_caches(urls, cluster.worker_headers())
        time.sleep(1.0)
        argv = _bench_serving_argv(
            spec, plan.endpoint, plan.served_model_name, plan.model_path, out_file
        )
        logger.info("running %s", " ".join(argv))
        proc = subprocess.run(
            argv, env=compat.child_env(), capture_output=True, text=True, timeout=spec.timeout_s
        )
        (spec.out_dir / "sglang_bench_serving.log").write_text(proc.stdout + "\n" + proc.stderr)
        if proc.returncode != 0 or not out_file.exists():
            raise RuntimeError(
                f"sglang.bench_serving failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
    theirs = json.loads(out_file.read_text().strip().splitlines()[-1])
    comps = [
        Comparison(
            "request throughput (req/s)",
            ours.req_per_s,
            theirs["request_throughput"],
            spec.tol_throughput,
        ),
        Comparison(
            "output throughput (tok/s)",
            ours.out_tok_per_s,
            theirs["output_throughput"],
            spec.tol_throughput,
        ),
        Comparison("mean TTFT (ms)", ours.ttft.mean * 1000, theirs["mean_ttft_ms"], spec.tol_ttft),
        Comparison(
            "median TTFT (ms)", ours.ttft.p50 * 1000, theirs["median_ttft_ms"], spec.tol_ttft
        ),
    ]
    return comps, theirs, ours, argv


def table(comps: list[Comparison], ours: metrics.Summary, theirs: dict) -> str:
    lines = [
        "| metric | this harness | sglang.bench_serving | rel. diff | tolerance | agree |",
        "|---|---|---|---|---|---|",
    ]
    for c in comps:
        lines.append(
            f"| {c.metric} | {c.harness:.3f} | {c.sglang:.3f} | {c.rel_diff:.1%} | {c.tolerance:.0%} | "
            f"{'yes' if c.ok else 'NO'} |"
        )
    lines.append(
        f"| completed requests | {ours.ok}/{ours.requests} | {theirs.get('completed')} | | | |"
    )
    lines.append(
        f"| duration (s) | {ours.duration_s:.2f} | {theirs.get('duration', float('nan')):.2f} | | | |"
    )
    ours_in = round(ours.in_tok_per_s * ours.duration_s)
    lines.append(f"| input tokens (total) | {ours_in} | {theirs.get('total_input_tokens')} | | | |")
    ours_out = round(ours.out_tok_per_s * ours.duration_s)
    lines.append(
        f"| output tokens (total) | {ours_out} | {theirs.get('total_output_tokens')} | | | |"
    )
    return "\n".join(lines)
