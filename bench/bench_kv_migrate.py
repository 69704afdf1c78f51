"""KV-block migration: what a decode step pays for attention over pages held by
a peer, and what the freed pages buy when the decode worker's KV pool is the
bottleneck. Baselines are measured in the same run.

``python -m bench.bench_kv_migrate`` starts a 2P1D cluster (``--model``,
default ``tiny``; the decode worker's pool limited to ``--max-total-tokens``)
and runs, through the router's admin API:

- ``steps``: ``--batch`` requests of ``--prompt-tokens`` decode
  ``--decode-tokens`` tokens each, three times: every page local; with the
  oldest complete pages of every request moved to ``prefill-1`` as soon as all
  of them decode (one ``MigrateKV``); local again. Reported: mean TPOT of each
  run, pages and bytes moved, the decode stall of the copy, and the lender's
  own account per attention call (its wait for the host, of which the host
  computing).
- ``capacity``: ``--requests`` such requests sent at once, which the limited
  pool cannot hold together, once without migration and once with a pressure
  loop in this process that moves pages whenever the decode worker's free KV
  falls below ``--low-water`` tokens. Reported: the largest running batch the
  decode worker reached (its agent's status, polled), decode tokens/s over
  the burst, how many requests ended with an error, and pages moved.

Outputs: ``bench/runs/kv-migrate-<UTC time>/summary.json`` and ``report.md``;
``--write-results`` replaces the "KV-block migration" section of docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from collections.abc import Sequence

import httpx

from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bench import configs
from bench.bench_migrate import _agents, _burst, _prompts
from bench.results import (
    ROOT,
    machine_description,
    parse_cluster_bench_args,
    write_results_section,
)

logger = logging.getLogger("bench.kv_migrate")


def _decode(router: str) -> dict:
    return _agents(router)["decode-0"]


def migrate_kv(router: str, tag: str, pages: int, timeout: float = 120) -> dict:
    r = httpx.post(
        router + "/bana/admin/migrations",
        timeout=60,
        json={"worker": "decode-0", "peer": "prefill-1", "kv_pages": pages, "id": tag},
    )
    r.raise_for_status()
    deadline = time.monotonic() + timeout
    while True:
        x = next(m for m in _decode(router)["migrations"] if m["migration"] == tag)
        if x["state"] not in ("accepted", "offered", "transferring"):
            return x
        if time.monotonic() > deadline:
            raise TimeoutError(f"KV migration {tag} still {x['state']}")
        time.sleep(0.02)


def _wait_settled(router: str, tags: list[str], timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        mine = [m for m in _decode(router)["migrations"] if m["migration"] in tags]
        if (
            all(m["state"] not in ("remote", "recalling") for m in mine)
            or time.monotonic() > deadline
        ):
            return mine
        time.sleep(0.2)


def _burst_any(router: str, model: str, prompts, tokens: int) -> list:
    """A burst whose failed requests are recorded (``ok=False``), not raised."""
    from bench.client import ClientConfig, replay
    from bench.workloads import Request

    reqs = [
        Request(rid=i, arrival_s=0.0, prompt=tuple(x), max_tokens=tokens)
        for i, x in enumerate(prompts)
    ]
    return replay(
        ClientConfig(endpoint=router, model=model, prompt_mode="ids", progress=False), reqs
    )


def _run(
    router: str, model: str, prompts, tokens: int, during=None, checked: bool = True
) -> tuple[list, float]:
    """The burst (records, wall s); ``during(stop_event)`` runs beside it."""
    stop = threading.Event()
    th = threading.Thread(target=during, args=(stop,), daemon=True) if during else None
    if th:
        th.start()
    t0 = time.monotonic()
    try:
        recs = (_burst if checked else _burst_any)(router, model, prompts, tokens)
    finally:
        stop.set()
        if th:
            th.join(timeout=60)
    return recs, time.monotonic() - t0


def step_cost(router: str, model: str, batch: int, prompt_tokens: int, tokens: int) -> dict:
    prompts = _prompts(11, batch, prompt_tokens)

    def tpot(recs) -> float:
        return statistics.mean(r.tpot for r in recs if r.tpot is not None)

    _run(router, model, prompts, tokens)  # warm-up, discarded
    local = tpot(_run(router, model, _prompts(12, batch, prompt_tokens), tokens)[0])
    moved: dict = {}

    def move(stop: threading.Event) -> None:
        # once every request decodes and has written about half its answer (the pages a request
        # owns are its answer's: its prompt's pages belong to the decode worker's radix tree)
        want = batch * (prompt_tokens + tokens // 2)
        while not stop.is_set():
            d = _decode(router)
            if (
                d["running_requests"] >= batch
                and d["kv_total_tokens"] - d["kv_free_tokens"] - max(d["kv_evictable_tokens"], 0)
                >= want
            ):
                moved.update(migrate_kv(router, "bench-steps", 100_000))
                return
            time.sleep(0.02)

    recs, _ = _run(router, model, _prompts(13, batch, prompt_tokens), tokens, move)
    remote = tpot(recs)
    if not moved:
        raise RuntimeError(
            "the burst ended before all its requests decoded together: raise --decode-tokens"
        )
    x = _wait_settled(router, ["bench-steps"])[0]
    back = tpot(_run(router, model, _prompts(14, batch, prompt_tokens), tokens)[0])
    kv = x["kv"]
    calls = max(kv.get("attend_calls", 0), 1)
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "tpot_local_ms": 1e3 * local,
        "tpot_moved_ms": 1e3 * remote,
        "tpot_local_after_ms": 1e3 * back,
        "added_vs_mean_local_ms": 1e3 * (remote - (local + back) / 2),
        "pages": kv.get("pages", 0),
        "segments": kv.get("segments", 0),
        "bytes": kv.get("bytes_out", 0),
        "move_stall_ms": 1e3 * kv.get("move_s", 0),
        "attend_calls": kv.get("attend_calls", 0),
        "attend_ms": 1e3 * kv.get("attend_s", 0) / calls,
        "host_ms": 1e3 * kv.get("host_s", 0) / calls,
        "recalled": kv.get("recalled", 0),
        "dropped": kv.get("dropped", 0),
        "state": x["state"],
        "freed_tokens": kv.get("free_after", 0) - kv.get("free_before", 0),
    }


def capacity(
    router: str, model: str, n: int, prompt_tokens: int, tokens: int, low_water: int, migrate: bool
) -> dict:
    prompts = _prompts(21 if migrate else 22, n, prompt_tokens)
    peak = {"running": 0}
    tags: list[str] = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            d = _decode(router)
            peak["running"] = max(peak["running"], d["running_requests"])
            if migrate and d["kv_free_tokens"] < low_water and d["running_requests"] > 0:
                tag = f"bench-cap-{len(tags)}"
                try:
                    x = migrate_kv(router, tag, 100_000)
                    tags.append(tag)
                    if x["state"] == "failed":
                        time.sleep(0.5)  # nothing to move right now
                except (httpx.HTTPError, TimeoutError) as e:
                    logger.warning("pressure loop: %s", e)
            time.sleep(0.05)

    recs, wall = _run(router, model, prompts, tokens, watch, checked=False)
    ok = [r for r in recs if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    migs = _wait_settled(router, tags) if tags else []
    moved = [m for m in migs if m.get("kv", {}).get("pages")]
    return {
        "requests": n,
        "migrate": migrate,
        "peak_running": peak["running"],
        "wall_s": wall,
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "decode_tok_per_s": out_tokens / wall,
        "migrations": len(moved),
        "pages": sum(m["kv"]["pages"] for m in moved),
        "dropped": sum(m["kv"].get("dropped", 0) for m in moved),
        "recalled": sum(m["kv"].get("recalled", 0) for m in moved),
        "backed_up": sum(m["kv"].get("backed_up", 0) for m in moved),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_kv_migrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="embedded model name or folder")
    p.add_argument("--phases", default="steps,capacity", help="steps, capacity (comma-separated)")
    p.add_argument("--batch", type=int, default=4, help="steps: concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=192)
    p.add_argument("--requests", type=int, default=16, help="capacity: requests sent at once")
    p.add_argument(
        "--max-total-tokens", type=int, default=4096, help="the decode worker's KV pool (tokens)"
    )
    p.add_argument(
        "--reserved-decode-tokens",
        type=int,
        default=512,
        help="the decode worker's --num-reserved-decode-tokens: SGLang's PD decode admission keeps this "
        "many free tokens per active request, whatever it uses (512, SGLang's default, binds "
        "before the pages do in a small pool: moving pages then cannot admit more)",
    )
    p.add_argument(
        "--low-water",
        type=int,
        default=512,
        help="capacity: move pages when the decode worker has fewer free KV tokens than this",
    )
    args = parse_cluster_bench_args(p, argv)
    phases = {x.strip() for x in args.phases.split(",") if x.strip()}
    if phases - {"steps", "capacity"}:
        p.error(f"unknown phases: {', '.join(sorted(phases - {'steps', 'capacity'}))}")
    out = args.out or ROOT / "bench" / "runs" / time.strftime(
        "kv-migrate-%Y%m%d-%H%M%S", time.gmtime()
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg = LaunchConfig(
        model_path=str(configs.model_dir(args.model)),
        num_prefill=2,
        num_decode=1,
        port=args.port,
        worker_base_port=args.port + 10,
        log_dir=out / "logs",
        decode_args=(
            "--max-total-tokens",
            str(args.max_total_tokens),
            "--num-reserved-decode-tokens",
            str(args.reserved_decode_tokens),
        ),
    )
    steps, cap = None, []
    with Cluster(plan_cluster(cfg), log_dir=cfg.log_dir, startup_timeout=900) as cluster:
        router = cluster.plan.endpoint
        model = httpx.get(router + "/v1/models", timeout=60).json()["data"][0]["id"]
        if "steps" in phases:
            steps = step_cost(router, model, args.batch, args.prompt_tokens, args.decode_tokens)
            logger.info(
                "steps: TPOT %.1f ms local, %.1f ms with %d pages moved, %.1f ms local again; "
                "%.1f ms per attention call (host %.1f ms)",
                steps["tpot_local_ms"],
                steps["tpot_moved_ms"],
                steps["pages"],
                steps["tpot_local_after_ms"],
                steps["attend_ms"],
                steps["host_ms"],
            )
        if "capacity" in phases:
            for migrate in (False, True, False):
                cap.append(
                    capacity(
                        router,
                        model,
                        args.requests,
                        args.prompt_tokens,
                        args.decode_tokens,
                        args.low_water,
                        migrate,
                    )
                )
                logger.info(
                    "capacity (%s): peak batch %d, %.1f decode tok/s, %d errors, %d pages moved",
                    "migrate" if migrate else "local",
                    cap[-1]["peak_running"],
                    cap[-1]["decode_tok_per_s"],
                    cap[-1]["errors"],
                    cap[-1]["pages"],
                )
    (out / "summary.json").write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(out)}, "steps": steps, "capacity": cap},
            indent=2,
            default=str,
        )
    )
    report = [
        f"Run: `python -m bench.bench_kv_migrate --model {args.model} --phases {args.phases} --batch "
        f"{args.batch} --prompt-tokens {args.prompt_tokens} --decode-tokens {args.decode_tokens} --requests "
        f"{args.requests} --max-total-tokens {args.max_total_tokens} --reserved-decode-tokens "
        f"{args.reserved_decode_tokens} --low-water {args.low_water}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine_description()}.",
        "",
    ]
    if steps:
        s = steps
        report += [
            f"**Per-step cost.** {s['batch']} requests of {s['prompt_tokens']} prompt tokens decode {s['tokens']} "
            "tokens each on `decode-0`: all pages local; with their oldest complete pages moved to `prefill-1` "
            "as soon as all of them decode; local again (one discarded warm-up run first).",
            "",
            "| TPOT local ms | TPOT with pages moved ms | TPOT local again ms | added ms (vs the mean of the "
            "local runs) | pages moved | KV MB moved | copy stall ms | ms per attention call (lender waits) | "
            "of which the host computing ms | segments recalled / dropped at request end |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {s['tpot_local_ms']:.1f} | {s['tpot_moved_ms']:.1f} | {s['tpot_local_after_ms']:.1f} | "
            f"{s['added_vs_mean_local_ms']:+.1f} | {s['pages']:.0f} | {s['bytes'] / 1e6:.2f} | "
            f"{s['move_stall_ms']:.1f} | {s['attend_ms']:.2f} | {s['host_ms']:.2f} | "
            f"{s['recalled']:.0f} / {s['dropped']:.0f} |",
            "",
        ]
    if cap:
        report += [
            f"**Capacity.** {args.requests} requests of {args.prompt_tokens} prompt tokens and "
            f"{args.decode_tokens} output tokens at once; the decode worker's pool holds "
            f"{args.max_total_tokens} tokens and SGLang's PD admission keeps {args.reserved_decode_tokens} free "
            f"tokens per active request. Runs in the order without, with, without migration (the pressure "
            f"loop moves pages whenever fewer than {args.low_water} KV tokens are free).",
            "",
            "| run | peak running batch | decode tokens/s | wall s | ok | errors | migrations | pages moved | "
            "segments recalled / in a retraction backup / dropped |",
            "|---|---|---|---|---|---|---|---|---|",
            *[
                f"| {'with migration' if c['migrate'] else 'without'} | {c['peak_running']} | "
                f"{c['decode_tok_per_s']:.1f} | {c['wall_s']:.1f} | {c['ok']} | {c['errors']} | {c['migrations']} | "
                f"{c['pages']:.0f} | {c['recalled']:.0f} / {c.get('backed_up', 0):.0f} / {c['dropped']:.0f} |"
                for c in cap
            ],
            "",
        ]
    text = "\n".join(report)
    (out / "report.md").write_text(text + "\n")
    print(text)
    if (
        args.write_results
    ):  # one section per phase set, so the two can come from runs with different pools
        name = "+".join(sorted(phases))
        write_results_section(
            f"kv-migrate-{name}", f"KV-block migration ({name.replace('+', ', ')})", text
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
