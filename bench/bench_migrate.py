"""Layer-weight migration time against bytes moved, and against raw Mooncake
transfer-engine bandwidth measured in the same run.

``python -m bench.bench_migrate`` starts a 1P1D cluster (``--model``, default
``small``) with the migration agents, then for each layer range ``[0, n)``
(``--layers 1,2,4,...``) migrates those layers' weights from ``prefill-0`` to
``decode-0`` through the router's admin API, waits until they are staged
(transferred and CRC32-verified on the peer), records the time the source
reports, and cancels (the peer frees its copy). Between migrations the same
bytes are read once with two bare transfer engines in this process (one
batched read of tensors of the same sizes, TCP on 127.0.0.1): the raw
bandwidth the migration is compared with. Each range runs ``--repeats``
times; the medians are reported.

Then, with the execution switch (``--phases``):
- ``steps``: per-step latency added by remote layers. ``--batch`` streamed
  requests decode ``--decode-tokens`` tokens each, first with every layer
  local, then with the decode worker's upper half of the layers running on
  the (idle) prefill worker, then again local after a recall. Reported: mean
  TPOT each way and the difference, and the owner's own account of a remote
  step (time inside the remote span, of which the peer computing).
- ``saturated``: a burst of ``--burst`` long prompts (``--prompt-tokens``,
  2 output tokens; fresh random ids, so no prefix cache hit) saturates the
  prefill worker; throughput (prompt tokens/s) and TTFT with every layer
  local, and with ``--move`` of the prefill worker's layers running on the
  idle decode worker. Four bursts (fresh prompts of the same lengths each)
  in the order local, moved, moved, local (``--moved-first``: the reverse);
  each setting reports the mean of its two bursts: a first burst after
  start-up was seen 20-40% slower than later ones, which a plain
  local-then-moved order credits to the migration.

Outputs: ``bench/runs/migrate-<UTC time>/summary.json`` and ``report.md``;
``--write-results`` replaces the "Layer migration" section of docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch

from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bana_sglang.migrate.agent import TransferEngine
from bench import configs
from bench.results import (
    ROOT,
    machine_description,
    parse_cluster_bench_args,
    write_results_section,
)

logger = logging.getLogger("bench.migrate")


def raw_read_seconds(sizes: list[int], repeats: int = 3) -> float:
    """Median seconds of one batched transfer-engine read of tensors of ``sizes`` bytes."""
    a, b = TransferEngine("127.0.0.1"), TransferEngine("127.0.0.1")
    src = [torch.randn(max(1, n // 4)) for n in sizes]
    dst = [torch.empty_like(t) for t in src]
    for t in src:
        a.register(t)
    for t in dst:
        b.register(t)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.read(a.session, dst, [t.data_ptr() for t in src])
        times.append(time.perf_counter() - t0)
    assert all(torch.equal(x, y) for x, y in zip(src, dst))
    return statistics.median(times)


def migrate_once(router: str, n: int, tag: str, timeout: float = 600) -> dict:
    r = httpx.post(
        router + "/bana/admin/migrations",
        timeout=60,
        json={
            "worker": "prefill-0",
            "peer": "decode-0",
            "layers": [0, n],
            "id": tag,
            "switch": False,
        },
    )
    r.raise_for_status()
    deadline = time.monotonic() + timeout
    while True:
        w = httpx.get(f"{router}/bana/admin/migrations/{tag}", timeout=60).json()
        if w["kind"] != "progress":
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"migration {tag} still {w['state']} after {timeout}s")
        time.sleep(0.05)
    if w["kind"] != "done":
        raise RuntimeError(f"migration {tag} failed: {w}")
    agents = httpx.get(router + "/bana/admin/agents", timeout=60).json()["agents"]
    src = next(
        x
        for a in agents
        for x in a.get("migrations", [])
        if x["migration"] == tag and x["side"] == "source"
    )
    guest = next(
        x
        for a in agents
        for x in a.get("migrations", [])
        if x["migration"] == tag and x["side"] == "guest"
    )
    httpx.delete(f"{router}/bana/admin/migrations/{tag}", timeout=60).raise_for_status()
    return {
        "layers": n,
        "bytes": w["bytes"],
        "seconds": w["seconds"],
        "guest_seconds": guest["seconds"],
        "tensors": len(src["tensors"]),
        "crc_equal": src["crc32"] == guest["crc32"],
    }


def _agents(router: str) -> dict[str, dict]:
    return {
        a["worker"]: a
        for a in httpx.get(router + "/bana/admin/agents", timeout=60).json()["agents"]
    }


def switch(
    router: str, worker: str, peer: str, layers: tuple[int, int], tag: str, timeout: float = 600
) -> dict:
    """Move the execution of ``layers`` of ``worker`` to ``peer``; returns the source's record."""
    r = httpx.post(
        router + "/bana/admin/migrations",
        timeout=60,
        json={"worker": worker, "peer": peer, "layers": list(layers), "id": tag, "switch": True},
    )
    r.raise_for_status()
    return _follow(router, worker, tag, ("remote",), timeout)


def recall(router: str, worker: str, tag: str, timeout: float = 600) -> dict:
    httpx.post(
        f"{router}/bana/admin/migrations/{tag}/recall", timeout=60, json={}
    ).raise_for_status()
    return _follow(router, worker, tag, ("home",), timeout)


def _follow(router: str, worker: str, tag: str, want: tuple[str, ...], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        x = next(m for m in _agents(router)[worker]["migrations"] if m["migration"] == tag)
        if x["state"] in want:
            return x
        if x["state"] in ("failed", "cancelled", "restored") or time.monotonic() > deadline:
            raise RuntimeError(f"migration {tag}: {x['state']} {x['reason']} {x['detail']}")
        time.sleep(0.1)


def _burst(router: str, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    from bench.client import ClientConfig, replay_checked
    from bench.workloads import Request

    reqs = [
        Request(rid=i, arrival_s=0.0, prompt=tuple(p), max_tokens=max_tokens)
        for i, p in enumerate(prompts)
    ]
    return replay_checked(
        ClientConfig(endpoint=router, model=model, prompt_mode="ids", progress=False), reqs
    )


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n, length), generator=g).tolist()


def step_latency(router: str, model: str, num_layers: int, batch: int, tokens: int) -> dict:
    """Mean TPOT of a decode batch with every layer local, with the upper half of
    the decode worker's layers on the prefill worker, and local again."""
    half = (num_layers // 2, num_layers)
    prompts = _prompts(7, batch, 64)

    def tpot() -> float:
        return statistics.mean(
            r.tpot for r in _burst(router, model, prompts, tokens) if r.tpot is not None
        )

    tpot()  # warm-up: a whole run, discarded (the first one after start-up is slower)
    local = tpot()
    src = switch(router, "decode-0", "prefill-0", half, "bench-steps")
    steps0, remote0, guest0 = src["steps"], src["remote_seconds"], src["guest_seconds"]
    remote = tpot()
    x = next(
        m for m in _agents(router)["decode-0"]["migrations"] if m["migration"] == "bench-steps"
    )
    n = max(x["steps"] - steps0, 1)
    recall(router, "decode-0", "bench-steps")
    back = tpot()
    return {
        "layers": list(half),
        "batch": batch,
        "tokens": tokens,
        "tpot_local_ms": 1e3 * local,
        "added_vs_mean_local_ms": 1e3 * (remote - (local + back) / 2),
        "tpot_remote_ms": 1e3 * remote,
        "tpot_after_recall_ms": 1e3 * back,
        "added_ms": 1e3 * (remote - local),
        "remote_steps": n,
        "span_ms_per_step": 1e3 * (x["remote_seconds"] - remote0) / n,
        "peer_compute_ms_per_step": 1e3 * (x["guest_seconds"] - guest0) / n,
        "released_bytes": x["released_bytes"],
    }


def saturated_prefill(
    router: str,
    model: str,
    num_layers: int,
    burst: int,
    length: int,
    move: int,
    moved_first: bool = False,
) -> dict:
    """A burst of long prompts on the prefill worker, with and without moving
    ``move`` of its layers (the upper ones) to the idle decode worker."""

    def run(seed: int) -> dict:
        t0 = time.perf_counter()
        recs = _burst(router, model, _prompts(seed, burst, length), 2)
        wall = time.perf_counter() - t0
        ttft = sorted(r.ttft for r in recs if r.ttft is not None)
        return {
            "wall_s": wall,
            "prompt_tok_per_s": burst * length / wall,
            "ttft_mean_s": statistics.mean(ttft),
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        }

    run(99)  # warm-up: a whole burst (the first one after start-up runs 20-40% slower), discarded
    layers = (num_layers - move, num_layers)
    # ABBA (or BAAB with moved_first): each setting runs once early and once late,
    # so a drift of the machine (or a slow first burst) does not favour either.
    order = (
        ["moved", "local", "local", "moved"]
        if moved_first
        else ["local", "moved", "moved", "local"]
    )
    results: dict[str, list[dict]] = {"local": [], "moved": []}
    placed = False
    for k, which in enumerate(order):
        if which == "moved" and not placed:
            switch(router, "prefill-0", "decode-0", layers, f"bench-saturated-{k}")
            placed, tag = True, f"bench-saturated-{k}"
        elif which == "local" and placed:
            recall(router, "prefill-0", tag)
            placed = False
        results[which].append(run(100 + k))
    if placed:
        recall(router, "prefill-0", tag)

    def mean(rs: list[dict]) -> dict:
        return {key: statistics.fmean(r[key] for r in rs) for key in rs[0]}

    local, moved = mean(results["local"]), mean(results["moved"])
    return {
        "burst": burst,
        "prompt_tokens": length,
        "moved_layers": list(layers),
        "order": order,
        "runs": results,
        "local": local,
        "moved": moved,
        "throughput_ratio": moved["prompt_tok_per_s"] / local["prompt_tok_per_s"],
        "ttft_mean_ratio": moved["ttft_mean_s"] / local["ttft_mean_s"],
    }


def tensor_sizes(model_path: str, n: int) -> list[int]:
    """Bytes of each parameter of layers [0, n) as SGLang holds them (q/k/v and gate/up fused)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    d = cfg.get("head_dim") or h // heads
    one = [(heads + 2 * kv) * d * h, h * heads * d, 2 * inter * h, h * inter, h, h]
    return [4 * x for _ in range(n) for x in one]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_migrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="small", help="embedded model name or folder")
    p.add_argument(
        "--layers", default="1,2,4", help="comma-separated layer counts n: migrate [0, n)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--phases",
        default="staging,steps,saturated",
        help="which measurements: staging (weights), steps (per-step latency of remote layers), "
        "saturated (a prefill burst with and without moving layers)",
    )
    p.add_argument("--batch", type=int, default=4, help="steps: concurrent decoding requests")
    p.add_argument("--decode-tokens", type=int, default=48, help="steps: output tokens per request")
    p.add_argument("--burst", type=int, default=8, help="saturated: prompts in the burst")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="saturated: tokens per prompt")
    p.add_argument(
        "--moved-first",
        action="store_true",
        help="saturated: run the burst with the layers moved first, then all local (order check)",
    )
    p.add_argument(
        "--move",
        type=int,
        default=None,
        help="saturated: how many of the prefill worker's (upper) layers move (default: half)",
    )
    args = parse_cluster_bench_args(p, argv)
    out = args.out or ROOT / "bench" / "runs" / time.strftime(
        "migrate-%Y%m%d-%H%M%S", time.gmtime()
    )
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(configs.model_dir(args.model))
    counts = [int(x) for x in args.layers.split(",") if x]
    cfg = LaunchConfig(
        model_path=model_path,
        num_prefill=1,
        num_decode=1,
        port=args.port,
        worker_base_port=args.port + 10,
        global_store=False,
        log_dir=out / "logs",
    )
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    unknown = phases - {"staging", "steps", "saturated"}
    if unknown:
        p.error(f"unknown phases: {', '.join(sorted(unknown))}")
    num_layers = json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"]
    rows, steps, saturated = [], None, None
    with Cluster(plan_cluster(cfg), log_dir=cfg.log_dir, startup_timeout=900) as cluster:
        router = cluster.plan.endpoint
        model = httpx.get(router + "/v1/models", timeout=60).json()["data"][0]["id"]
        for n in counts if "staging" in phases else []:
            runs = [migrate_once(router, n, f"bench-{n}-{i}") for i in range(args.repeats)]
            raw = raw_read_seconds(tensor_sizes(model_path, n), args.repeats)
            mig = statistics.median(r["seconds"] for r in runs)
            moved = runs[0]["bytes"]
            row = {
                "layers": n,
                "bytes": moved,
                "tensors": runs[0]["tensors"],
                "migration_s": mig,
                "guest_s": statistics.median(r["guest_seconds"] for r in runs),
                "raw_read_s": raw,
                "migration_MBps": moved / mig / 1e6,
                "raw_MBps": moved / raw / 1e6,
                "fraction_of_raw": raw / mig,
                "checksums_equal": all(r["crc_equal"] for r in runs),
            }
            logger.info(
                "layers [0,%d): %.1f MB staged in %.3fs (%.0f MB/s) vs raw %.3fs (%.0f MB/s): %.2f of raw",
                n,
                moved / 1e6,
                mig,
                row["migration_MBps"],
                raw,
                row["raw_MBps"],
                row["fraction_of_raw"],
            )
            rows.append(row)
        if "steps" in phases:
            steps = step_latency(router, model, num_layers, args.batch, args.decode_tokens)
            logger.info(
                "per-step: TPOT %.1f ms local, %.1f ms with layers %s remote (+%.1f ms)",
                steps["tpot_local_ms"],
                steps["tpot_remote_ms"],
                steps["layers"],
                steps["added_ms"],
            )
        if "saturated" in phases:
            saturated = saturated_prefill(
                router,
                model,
                num_layers,
                args.burst,
                args.prompt_tokens,
                args.move if args.move is not None else num_layers // 2,
                moved_first=args.moved_first,
            )
            logger.info(
                "saturated prefill: throughput x%.2f, mean TTFT x%.2f with layers %s moved",
                saturated["throughput_ratio"],
                saturated["ttft_mean_ratio"],
                saturated["moved_layers"],
            )
    lines = [
        "| layers | MB | tensors | migration s | of which on the peer s | raw TE read s | migration MB/s | "
        "raw MB/s | fraction of raw | checksums equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| [0,{r['layers']}) | {r['bytes'] / 1e6:.1f} | {r['tensors']} | {r['migration_s']:.3f} | "
        f"{r['guest_s']:.3f} | {r['raw_read_s']:.3f} | {r['migration_MBps']:.0f} | {r['raw_MBps']:.0f} | "
        f"{r['fraction_of_raw']:.2f} | {r['checksums_equal']} |"
        for r in rows
    ]
    report = [
        f"Run: `python -m bench.bench_migrate --model {args.model} --layers {args.layers} --repeats {args.repeats} "
        f"--phases {args.phases} --batch {args.batch} --decode-tokens {args.decode_tokens} --burst {args.burst} "
        f"--prompt-tokens {args.prompt_tokens}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{machine_description()}.",
        "",
    ]
    if rows:
        report += [
            "**Weight staging.** Layer weights of `prefill-0` staged on `decode-0` (transfer-engine reads into a "
            "guest area, CRC32 verified on both sides) against one batched raw transfer-engine read of the same "
            "tensor sizes in this process (TCP on 127.0.0.1). Medians of the repeats. Migration time is what the "
            "source reports from accepting the command to seeing the peer's verification (its own CRC32 pass, "
            "the offer, the peer's reads and CRC32 pass, and the source's polling); the peer's part is the "
            "time from its accepting the offer to its verification.",
            "",
            *lines,
            "",
        ]
    if steps:
        st = steps
        report += [
            f"**Per-step latency of remote layers.** {st['batch']} streamed requests decode {st['tokens']} tokens "
            f"each on `decode-0`, with every layer local, then with layers [{st['layers'][0]}, {st['layers'][1]}) "
            "running on the idle `prefill-0` (hidden state, residual and KV rows through the transfer engine "
            "each step), then local again after a recall; one discarded warm-up run first.",
            "",
            "| TPOT local ms | TPOT remote ms | TPOT local after recall ms | added ms/step (vs the mean of the two "
            "local runs) | remote steps | span ms/step (owner's view) | of which the peer computing ms | "
            "weights released MB |",
            "|---|---|---|---|---|---|---|---|",
            f"| {st['tpot_local_ms']:.1f} | {st['tpot_remote_ms']:.1f} | {st['tpot_after_recall_ms']:.1f} | "
            f"{st['added_vs_mean_local_ms']:+.1f} | {st['remote_steps']} | {st['span_ms_per_step']:.1f} | "
            f"{st['peer_compute_ms_per_step']:.1f} | {st['released_bytes'] / 1e6:.1f} |",
            "",
        ]
    if saturated:
        sa = saturated
        report += [
            f"**Saturated prefill.** A burst of {sa['burst']} prompts of {sa['prompt_tokens']} tokens (fresh ids, "
            f"2 output tokens) at once, with every layer of `prefill-0` local, and with its layers "
            f"[{sa['moved_layers'][0]}, {sa['moved_layers'][1]}) running on the idle `decode-0` "
            f"(after a discarded warm-up burst, bursts in the order {', '.join(sa['order'])}; each row is the "
            "mean of its two bursts, so a drift of the machine does not favour either).",
            "",
            "| burst | " + " | ".join(sa["order"]) + " |",
            "|---|" + "---|" * len(sa["order"]),
            "| prompt tokens/s | "
            + " | ".join(
                f"{sa['runs'][w][sa['order'][:k].count(w)]['prompt_tok_per_s']:.0f}"
                for k, w in enumerate(sa["order"])
            )
            + " |",
            "",
            "| run | wall s | prompt tokens/s | mean TTFT s | p90 TTFT s |",
            "|---|---|---|---|---|",
            *[
                f"| {name} | {r['wall_s']:.2f} | {r['prompt_tok_per_s']:.0f} | {r['ttft_mean_s']:.2f} | "
                f"{r['ttft_p90_s']:.2f} |"
                for name, r in (("all local", sa["local"]), ("layers moved", sa["moved"]))
            ],
            "",
            f"Throughput ratio moved/local: {sa['throughput_ratio']:.2f}; mean TTFT ratio: "
            f"{sa['ttft_mean_ratio']:.2f}. Read it with the per-burst row: a rise from burst to burst "
            "whatever the setting is the machine drifting, not the migration. Here both workers share "
            "the same cores and each remote step is synchronous (the owner waits while the peer computes), "
            "so no gain is expected on this machine.",
            "",
        ]
    report = "\n".join(report)
    (out / "summary.json").write_text(
        json.dumps({"rows": rows, "steps": steps, "saturated": saturated}, indent=2)
    )
    (out / "report.md").write_text(report + "\n")
    print(report)
    if args.write_results:
        write_results_section("layer-migration", "Layer migration (weight staging)", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
