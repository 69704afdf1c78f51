"""Live request migration: how long a streamed request's client waits while the
request moves to another decode worker, against the size of its KV, with the
baselines measured in the same run.

``python -m bench.bench_request_migrate`` starts a 1P2D cluster with the
global store (``--model``, default ``tiny``). For each context length in
``--contexts`` (prompt tokens) it streams one greedy ``/generate`` request of
``--decode-tokens`` tokens through the router, ``--repeats`` times each:

- **plain**: no migration. Its inter-token gaps are the reference for the
  stall, and its time to first token (a cold prefill of the whole prompt)
  is what restarting the request elsewhere from scratch would cost at least.
- **moved**: the same request, moved to the other decode worker (admin API,
  ``"request": true``) once ``--move-after`` tokens have arrived.

Reported per context: the KV the request held when it moved (tokens, MB);
the client's stall (the largest inter-token gap of the moved run, and the
router's own measure: handoff seen -> first byte of the continuation) next
to the plain run's largest gap and its TTFT; the continuation prefill's
cached and computed tokens (from the global store vs recomputed); and
whether the tokens equal the plain run's.

Outputs: ``bench/runs/request-migrate-<UTC time>/summary.json`` and
``report.md``; ``--write-results`` replaces the "Live request migration
(MODEL model)" section of docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bana_sglang import envs
from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bench import configs
from bench.bench_migrate import _agents
from bench.results import (
    ROOT,
    machine_description,
    parse_cluster_bench_args,
    write_results_section,
)

logger = logging.getLogger("bench.request_migrate")


def stream(router: str, ids: list[int], tokens: int, move_after: int | None) -> dict:
    """One streamed request; with ``move_after``, moved once that many tokens arrived."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True},
    }
    times, last, moved = [], None, {}
    t0 = time.perf_counter()

    def move(worker: str) -> None:
        tag = f"bench-{random.getrandbits(32):08x}"
        r = httpx.post(
            router + "/bana/admin/migrations",
            timeout=60,
            json={"worker": worker, "request": True, "id": tag},
        )
        moved.update(status=r.status_code, tag=tag, worker=worker, at=time.perf_counter() - t0)

    mover = None
    with httpx.stream("POST", router + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            times.append(time.perf_counter() - t0)
            last = json.loads(line[5:])
            if move_after is not None and mover is None and len(times) >= move_after:
                worker = next(w for w, a in _agents(router).items() if a.get("movable"))
                mover = threading.Thread(target=move, args=(worker,))
                mover.start()
    if mover is not None:
        mover.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "ttft_s": times[0],
        "gaps": gaps,
        "max_gap_s": max(gaps),
        "median_gap_s": statistics.median(gaps),
        "output_ids": last["output_ids"],
        "e2e_s": times[-1],
        "moved": moved,
    }


def _stall_sum(router: str) -> tuple[float, float]:
    text = httpx.get(router + "/metrics", timeout=30).text
    get = {
        ln.split()[0]: float(ln.split()[1])
        for ln in text.splitlines()
        if ln.startswith("bana_router_request_migration_stall_seconds_")
    }
    return get.get("bana_router_request_migration_stall_seconds_sum", 0.0), get.get(
        "bana_router_request_migration_stall_seconds_count", 0.0
    )


_PREFILL = re.compile(r"Prefill batch.*#new-token: (\d+), #cached-token: (\d+)")


def _last_prefill(log: Path) -> tuple[int, int]:
    hits = _PREFILL.findall(log.read_text(errors="replace")) if log.exists() else []
    return (int(hits[-1][0]), int(hits[-1][1])) if hits else (-1, -1)


def run_context(
    router: str,
    log_dir: Path,
    ctx: int,
    tokens: int,
    move_after: int,
    repeats: int,
    rng: random.Random,
) -> dict:
    rows = []
    for rep in range(repeats):
        ids = [rng.randrange(10, 1000) for _ in range(ctx)]
        plain = stream(router, ids, tokens, None)
        before = _stall_sum(router)
        moved = stream(router, ids, tokens, move_after)
        after = _stall_sum(router)
        new, cached = _last_prefill(log_dir / "prefill-0.log")
        mig = next(
            (
                x
                for a in _agents(router).values()
                for x in a["migrations"]
                if x["migration"] == moved["moved"].get("tag")
            ),
            {},
        )
        count = after[1] - before[1]
        rows.append(
            {
                "repeat": rep,
                "same_tokens": plain["output_ids"] == moved["output_ids"],
                "handed_off": mig.get("state") == "handed_off",
                "kv_bytes": mig.get("bytes_total", 0),
                "detail": mig.get("detail", ""),
                "plain_ttft_ms": 1e3 * plain["ttft_s"],
                "plain_max_gap_ms": 1e3 * plain["max_gap_s"],
                "plain_median_gap_ms": 1e3 * plain["median_gap_s"],
                "moved_max_gap_ms": 1e3 * moved["max_gap_s"],
                "moved_median_gap_ms": 1e3 * moved["median_gap_s"],
                "router_stall_ms": 1e3 * (after[0] - before[0]) / count if count else float("nan"),
                "cont_new_tokens": new,
                "cont_cached_tokens": cached,
                "plain_e2e_s": plain["e2e_s"],
                "moved_e2e_s": moved["e2e_s"],
            }
        )
        logger.info(
            "context %d #%d: stall %.0f ms (router %.0f ms) vs plain max gap %.0f ms, TTFT %.0f ms; "
            "continuation computed %d, loaded %d tokens; same tokens: %s",
            ctx,
            rep,
            rows[-1]["moved_max_gap_ms"],
            rows[-1]["router_stall_ms"],
            rows[-1]["plain_max_gap_ms"],
            rows[-1]["plain_ttft_ms"],
            new,
            cached,
            rows[-1]["same_tokens"],
        )
    med = {
        k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)
    }
    return {
        "context": ctx,
        "rows": rows,
        "median": med,
        "all_same": all(r["same_tokens"] for r in rows),
        "all_handed_off": all(r["handed_off"] for r in rows),
        "kv_tokens": ctx + move_after,
        "kv_bytes": statistics.median(r["kv_bytes"] for r in rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_request_migrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="embedded model name or folder")
    p.add_argument(
        "--contexts", default="128,512,1024,2048", help="prompt lengths in tokens (comma-separated)"
    )
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument(
        "--move-after", type=int, default=32, help="tokens the client has seen when the move starts"
    )
    p.add_argument("--repeats", type=int, default=3)
    args = parse_cluster_bench_args(p, argv)
    contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    if args.move_after >= args.decode_tokens - 8:
        p.error("--move-after must leave at least 8 tokens of --decode-tokens to move")
    out = args.out or ROOT / "bench" / "runs" / time.strftime(
        "request-migrate-%Y%m%d-%H%M%S", time.gmtime()
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg = LaunchConfig(
        model_path=str(configs.model_dir(args.model)),
        num_prefill=1,
        num_decode=2,
        port=args.port,
        worker_base_port=args.port + 10,
        log_dir=out / "logs",
    )
    rng = random.Random(0)
    results = []
    with Cluster(plan_cluster(cfg), log_dir=cfg.log_dir, startup_timeout=900) as cluster:
        router = cluster.plan.endpoint
        stream(router, [rng.randrange(10, 1000) for _ in range(64)], 16, None)  # warm-up
        for ctx in contexts:
            results.append(
                run_context(
                    router, cfg.log_dir, ctx, args.decode_tokens, args.move_after, args.repeats, rng
                )
            )
    (out / "summary.json").write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(out)}, "contexts": results}, indent=2, default=str
        )
    )
    precopy = envs.BANA_REQUEST_PRECOPY_S  # the workers read it; the report states it
    precopy_s = f"{precopy.get():g}" if precopy.is_set else f"{precopy.default:g}, the default"
    report = [
        f"Run: `python -m bench.bench_request_migrate --model {args.model} --contexts {args.contexts} "
        f"--decode-tokens {args.decode_tokens} --move-after {args.move_after} --repeats {args.repeats}` "
        f"(pre-copy: BANA_REQUEST_PRECOPY_S={precopy_s}) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine_description()}.",
        "",
        f"One streamed greedy `/generate` request at a time on a 1P2D cluster with the global store, moved "
        f"to the other decode worker after {args.move_after} tokens; medians of {args.repeats} repeats. "
        "*Client stall*: the largest gap between two streamed events of the moved run; *router*: handoff "
        "event seen -> first byte of the continuation; *plain*: the same request not moved (its largest "
        "gap, and its TTFT: a cold prefill of the prompt, the least a restart from scratch would cost). "
        "*Continuation prefill*: tokens the prefill worker computed / loaded from the global store.",
        "",
        "| prompt tokens | KV moved MB | client stall ms | router stall ms | plain largest gap ms | "
        "plain median gap ms | plain TTFT ms | stall / plain TTFT | continuation prefill computed / "
        "loaded tokens | same tokens | handed off |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        md = r["median"]
        rows = r["rows"]
        report.append(
            f"| {r['context']} | {r['kv_bytes'] / 1e6:.2f} | {md['moved_max_gap_ms']:.0f} | "
            f"{md['router_stall_ms']:.0f} | {md['plain_max_gap_ms']:.0f} | {md['plain_median_gap_ms']:.0f} | "
            f"{md['plain_ttft_ms']:.0f} | {md['moved_max_gap_ms'] / md['plain_ttft_ms']:.2f} | "
            f"{statistics.median(x['cont_new_tokens'] for x in rows):.0f} / "
            f"{statistics.median(x['cont_cached_tokens'] for x in rows):.0f} | "
            f"{'yes' if r['all_same'] else 'NO'} | {sum(x['handed_off'] for x in rows)}/{len(rows)} |"
        )
    text = "\n".join(report + [""])
    (out / "report.md").write_text(text + "\n")
    print(text)
    if args.write_results:
        write_results_section(
            f"request-migrate-{Path(args.model).name}",
            f"Live request migration ({Path(args.model).name} model)",
            text,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
