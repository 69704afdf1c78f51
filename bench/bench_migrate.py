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

What it does not measure yet: the per-step latency added by remote layers
and the saturated-prefill run with and without moving layers, because the
execution switch to staged layers is not built (see issue 7's note).

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

from bana_sglang import _cli
from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bana_sglang.migrate.agent import TransferEngine
from bench import configs
from bench.sidebyside import ROOT, machine_description, write_results_section

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
    r = httpx.post(router + "/bana/admin/migrations", timeout=60,
                   json={"worker": "prefill-0", "peer": "decode-0", "layers": [0, n], "id": tag})
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
    src = next(x for a in agents for x in a.get("migrations", []) if x["migration"] == tag and x["side"] == "source")
    guest = next(x for a in agents for x in a.get("migrations", []) if x["migration"] == tag and x["side"] == "guest")
    httpx.delete(f"{router}/bana/admin/migrations/{tag}", timeout=60).raise_for_status()
    return {"layers": n, "bytes": w["bytes"], "seconds": w["seconds"], "guest_seconds": guest["seconds"],
            "tensors": len(src["tensors"]), "crc_equal": src["crc32"] == guest["crc32"]}


def tensor_sizes(model_path: str, n: int) -> list[int]:
    """Bytes of each parameter of layers [0, n) as SGLang holds them (q/k/v and gate/up fused)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    one = [(heads + 2 * kv) * d * h, h * heads * d, 2 * inter * h, h * inter, h, h]
    return [4 * x for _ in range(n) for x in one]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_migrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="embedded model name or folder")
    p.add_argument("--layers", default="1,2,4", help="comma-separated layer counts n: migrate [0, n)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--log-level", default="INFO")
    args, _ = _cli.parse(p, list(argv) if argv is not None else None, lambda a: None)
    _cli.exit_on_sigterm()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = args.out or ROOT / "bench" / "runs" / time.strftime("migrate-%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(configs.model_dir(args.model))
    counts = [int(x) for x in args.layers.split(",") if x]
    cfg = LaunchConfig(model_path=model_path, num_prefill=1, num_decode=1, port=args.port,
                       worker_base_port=args.port + 10, global_store=False, log_dir=out / "logs")
    rows = []
    with Cluster(plan_cluster(cfg), log_dir=cfg.log_dir, startup_timeout=900) as cluster:
        router = cluster.plan.endpoint
        for n in counts:
            runs = [migrate_once(router, n, f"bench-{n}-{i}") for i in range(args.repeats)]
            raw = raw_read_seconds(tensor_sizes(model_path, n), args.repeats)
            mig = statistics.median(r["seconds"] for r in runs)
            moved = runs[0]["bytes"]
            row = {"layers": n, "bytes": moved, "tensors": runs[0]["tensors"], "migration_s": mig,
                   "guest_s": statistics.median(r["guest_seconds"] for r in runs), "raw_read_s": raw,
                   "migration_MBps": moved / mig / 1e6, "raw_MBps": moved / raw / 1e6,
                   "fraction_of_raw": raw / mig, "checksums_equal": all(r["crc_equal"] for r in runs)}
            logger.info("layers [0,%d): %.1f MB staged in %.3fs (%.0f MB/s) vs raw %.3fs (%.0f MB/s): %.2f of raw",
                        n, moved / 1e6, mig, row["migration_MBps"], raw, row["raw_MBps"], row["fraction_of_raw"])
            rows.append(row)
    lines = ["| layers | MB | tensors | migration s | of which on the peer s | raw TE read s | migration MB/s | "
             "raw MB/s | fraction of raw | checksums equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| [0,{r['layers']}) | {r['bytes'] / 1e6:.1f} | {r['tensors']} | {r['migration_s']:.3f} | "
              f"{r['guest_s']:.3f} | {r['raw_read_s']:.3f} | {r['migration_MBps']:.0f} | {r['raw_MBps']:.0f} | "
              f"{r['fraction_of_raw']:.2f} | {r['checksums_equal']} |" for r in rows]
    report = "\n".join([
        f"Run: `python -m bench.bench_migrate --model {args.model} --layers {args.layers} --repeats {args.repeats}` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine_description()}.", "",
        "Layer weights of `prefill-0` staged on `decode-0` (transfer-engine reads into a guest area, "
        "CRC32 verified on both sides) against one batched raw transfer-engine read of the same tensor "
        "sizes in this process (TCP on 127.0.0.1). Medians of the repeats. Migration time is what the "
        "source reports from accepting the command to seeing the peer's verification (its own CRC32 pass, "
        "the offer, the peer's reads and CRC32 pass, and the source's polling); the peer's part is the "
        "time from its accepting the offer to its verification.",
        "", *lines, "",
        "Not measured yet: per-step latency of remote layers and the saturated-prefill run (the execution "
        "switch is not built)."])
    (out / "summary.json").write_text(json.dumps({"rows": rows}, indent=2))
    (out / "report.md").write_text(report + "\n")
    print(report)
    if args.write_results:
        write_results_section("layer-migration", "Layer migration (weight staging)", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
