"""The global KV cache store against stock private prefix caches, on the Mooncake trace.

``python -m bench.bench_global_store`` replays one slice of
``bench/data/traces/mooncake_conversation_trace.jsonl`` (or ``--trace PATH``) (lengths scaled to the
model: a trace block of 512 tokens becomes ``512 * length_scale`` tokens, equal
``hash_ids`` give equal token blocks) on 2 prefill + 1 decode workers, once per
arm, one arm after the other:

- ``store-round-robin``: the global store on (storage process, index, linker),
  requests spread round-robin by our router;
- ``nostore-round-robin``: stock SGLang workers with private prefix caches
  (same page size, same router and policy): with the arm above, the store's
  own effect, routing held fixed;
- ``ours``: what ``bana_sglang.launch`` ships: the store with the load-only
  ``bana`` policy (with one global cache, where a request lands no longer
  decides its hits, so routing is by load alone);
- ``bana-cache-aware``: stock workers behind our router's prefix-affinity
  policy, the best a private cache gets from routing: with ``nostore-round-robin``,
  the stock private-cache setups ``ours`` is held against.

It prints, for every arm, the prefix hit rate (SGLang's ``cached_tokens`` /
prompt tokens), TTFT p50/p99 and throughput, and their ratios; TTFT of the
requests of the replay's opening window (``--start-fraction`` of its span: an
empty cluster's first, cold requests) apart from the rest; each arm's CPU
seconds by part over the replay; the
infinite-cache hit rate of the same slice (every page ever computed is kept
and visible to every worker; SGLang computes at least one token); and, for
one store arm (``ours`` when it ran, else ``store-round-robin``), the
per-request breakdown, the store's counters, the load bandwidth the workers reached (bytes loaded / load
time, layer by layer) against raw Mooncake bandwidth measured in the same run
on the same store with the same page size (whole pages, batched; taken on
the warmed-up cluster just before its replay, while the segment has room), and the
fraction of load time hidden under compute. The targets: a global hit
rate >= 90% of the infinite-cache rate and >= 1.5x the stock local rate.

Outputs go to ``bench/runs/global-store-<UTC time>/`` (records, summary.json,
report.md, ``hit_rates.png``); ``--write-results`` also replaces the "Global
KV store" section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bana_sglang import _cli
from bana_sglang.launch import Cluster
from bana_sglang.radix_global import summary as store_summary
from bench import breakdown, client, configs, metrics, workloads
from bench.client import ClientConfig, LoadSampler
from bench.global_store_report import ARMS, ArmResult, plot, report, split_hit, split_ttft
from bench.results import ROOT, write_results_section
from bench.sidebyside import warmup

logger = logging.getLogger("bench.global_store")


def infinite_cache_hits(
    wl: workloads.Workload, page: int, since: float | None = None, until: float | None = None
) -> tuple[int, int]:
    """(hit tokens, prompt tokens) if every page ever computed stayed visible to
    every worker: a request reuses its longest page-aligned prefix seen before,
    but never its last token (SGLang computes at least one). ``since``/``until``:
    count only the requests that arrive in that window (all requests still fill
    the cache)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in sorted(wl.requests, key=lambda r: r.arrival_s):
        p = list(r.prompt)
        n = 0
        while (n + 1) * page <= len(p) - 1 and tuple(p[: (n + 1) * page]) in seen:
            n += 1
        if (since is None or r.arrival_s >= since) and (until is None or r.arrival_s < until):
            total += len(p)
            hit += n * page
        for k in range(1, len(p) // page + 1):
            seen.add(tuple(p[: k * page]))
    return hit, total


def conversation_slice(
    n: int, scan_rows: int, per_conversation: int, out: Path, trace: Path = workloads.MOONCAKE_TRACE
) -> Path:
    """A slice of the trace dense in conversations: rows whose conversation (trace
    block 1, the first block after the shared system block 0) occurs at least
    twice within the first ``scan_rows`` rows, whole conversations (up to
    ``per_conversation`` turns each) in order of their first turn, until ``n``
    rows; written in trace order with the original timestamps. A plain
    ``n``-row slice holds almost no reuse (4% for the first 60 rows: turns of
    one conversation lie ~600 rows apart in the trace)."""
    rows = [json.loads(line) for _, line in zip(range(scan_rows), trace.open())]
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if len(r["hash_ids"]) >= 2:
            groups.setdefault(r["hash_ids"][1], []).append(i)
    chosen: list[int] = []
    for members in sorted((g for g in groups.values() if len(g) >= 2), key=lambda g: g[0]):
        chosen += members[:per_conversation]
        if len(chosen) >= n:
            break
    path = out / "conversation-slice.jsonl"
    with path.open("w") as f:
        for i in sorted(chosen)[:n]:
            f.write(json.dumps(rows[i]) + "\n")
    return path


def run_arm(
    name: str,
    wl: workloads.Workload,
    res: configs.Resources,
    space: workloads.TokenSpace,
    out: Path,
    raw_mb: int,
    start_s: float = 0.0,
) -> ArmResult:
    cfg = configs.get(name)
    plan = cfg.plan(res)
    urls = configs.worker_urls(plan)
    t0 = time.monotonic()
    with Cluster(plan, log_dir=out / "logs" / name, startup_timeout=900) as cluster:
        logger.info("%s up in %.0fs", name, time.monotonic() - t0)
        ccfg = ClientConfig(
            endpoint=plan.endpoint, model=plan.served_model_name, space=space, timeout_s=600
        )
        warmup(ccfg, space, 2)
        # before the replay: its pages would leave the probe no room in a full segment
        raw = probe_raw(name, plan, raw_mb)
        sampler = LoadSampler(urls, 0.5)
        before, rbefore = breakdown.scrape(urls), breakdown.router_metrics(plan.endpoint)
        cpu0 = breakdown.cpu_of_parts(cluster.procs)
        logger.info("%s: replaying %s", name, wl.describe())
        records = client.replay(ccfg, wl, sampler)
        time.sleep(1.0)  # publishing is asynchronous
        cpu1 = breakdown.cpu_of_parts(cluster.procs)
        cpu_s = breakdown.cpu_columns({k: v - cpu0[k] for k, v in cpu1.items() if k in cpu0})
        deltas = breakdown.delta(breakdown.scrape(urls), before)
        rdelta = {
            k: v - rbefore.get(k, 0.0) for k, v in breakdown.router_metrics(plan.endpoint).items()
        }
        summ = metrics.summarize(records, metrics.SLO(), sampler.samples)
        with (out / f"{name}.records.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps(r.to_json()) + "\n")
        print(metrics.format_summary(name, summ), flush=True)
        result = ArmResult(name, summ, {w: store_summary.scrape(u) for w, u in urls.items()})
        result.metrics, result.router, result.requests = deltas, rdelta, len(records)
        result.cpu_s = cpu_s
        result.start_ttft, result.after_ttft = split_ttft(records, start_s)
        result.start_hit, result.after_hit = split_hit(records, start_s)
        result.page_nbytes, result.raw_put_mbps, result.raw_get_mbps, result.raw_error = raw
    return result


def probe_raw(
    name: str, plan, raw_mb: int
) -> tuple[int | None, float | None, float | None, str | None]:
    """(page bytes, raw put MB/s, raw get MB/s, why not measured) of a store arm's
    Mooncake store, taken on the quiet cluster; all None for an arm without the store.
    A failure is kept as its reason, and the arm's replay still runs."""
    if not (plan.store and plan.master is not None):
        return None, None, None, None
    page = breakdown.page_nbytes(plan)
    try:
        put, get = breakdown.raw_bandwidth(breakdown.master_addr(plan), page, raw_mb)
    except Exception as e:  # noqa: BLE001
        logger.warning("%s: the raw bandwidth probe failed: %s", name, e)
        return page, None, None, f"{type(e).__name__}: {e}"
    return page, put, get, None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_global_store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="small", help="embedded model name or folder")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--trace-offset", type=int, default=0, help="with --slice plain: the first row")
    p.add_argument(
        "--slice",
        choices=("conversations", "plain"),
        default="conversations",
        help="conversations: whole multi-turn conversations from the first --scan-rows rows "
        "(see conversation_slice); plain: --num-requests rows from --trace-offset",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=workloads.MOONCAKE_TRACE,
        metavar="PATH",
        help="the Mooncake conversation trace (default: the shipped copy)",
    )
    p.add_argument("--scan-rows", type=int, default=3000)
    p.add_argument("--turns", type=int, default=4, help="at most this many turns per conversation")
    p.add_argument(
        "--rate", type=float, default=1.0, help="mean request rate of the replay (req/s)"
    )
    p.add_argument("--length-scale", type=float, default=1 / 16)
    p.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated, from: " + ", ".join(ARMS)
    )
    p.add_argument(
        "--start-fraction",
        type=float,
        default=0.1,
        help="the report also splits TTFT at this fraction of the replay's span: the opening "
        "window, from an empty cluster, and the rest (0: no split)",
    )
    p.add_argument("--kv-tokens-total", type=int, default=3 * 16384)
    p.add_argument("--raw-mb", type=int, default=32, help="bytes moved by the raw bandwidth probe")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--write-results", action="store_true", help="replace the section in docs/RESULTS.md"
    )
    p.add_argument("--log-level", default="INFO")
    args, _ = _cli.parse(p, list(argv) if argv is not None else None, lambda a: None)
    _cli.exit_on_sigterm()  # a SIGTERM still stops the arm's cluster
    arms = tuple(a for a in args.arms.split(",") if a)
    for a in arms:
        if a not in ARMS:
            p.error(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    out = args.out or ROOT / "bench" / "runs" / time.strftime(
        "global-store-%Y%m%d-%H%M%S", time.gmtime()
    )
    out.mkdir(parents=True, exist_ok=True)
    model_path = str(configs.model_dir(args.model))
    space = workloads.TokenSpace.from_model(model_path)
    spec = workloads.WorkloadSpec(
        name="mooncake",
        num_requests=args.num_requests,
        request_rate=args.rate,
        trace_offset=args.trace_offset if args.slice == "plain" else 0,
        length_scale=args.length_scale,
        trace=str(args.trace),
    )
    if args.slice == "plain":
        wl = workloads.build(spec, space)
    else:
        wl = workloads.mooncake_trace(
            spec,
            space,
            conversation_slice(args.num_requests, args.scan_rows, args.turns, out, args.trace),
        )
    hit, total = infinite_cache_hits(wl, 16)
    inf = hit / total if total else 0.0
    logger.info("infinite-cache hit rate of the slice: %.1f%%", 100 * inf)
    res = configs.Resources(model_path=model_path, kv_tokens_total=args.kv_tokens_total)
    if not 0.0 <= args.start_fraction < 1.0:
        p.error("--start-fraction must be in [0, 1)")
    start_s = args.start_fraction * max((r.arrival_s for r in wl.requests), default=0.0)
    results = []
    for name in arms:
        try:
            results.append(run_arm(name, wl, res, space, out, args.raw_mb, start_s))
        except Exception:  # one broken arm must not lose the other's numbers
            logger.exception("arm %s failed", name)
    command = "python -m bench.bench_global_store " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    windows = [
        infinite_cache_hits(wl, 16, until=start_s),
        infinite_cache_hits(wl, 16, since=start_s),
    ]
    split = tuple(h / t if t else 0.0 for h, t in windows) if start_s > 0 else None
    text = report(results, inf, wl, command.strip(), start_s, split)
    pic = plot(results, inf, out)
    # the picture as each document sees it: the run's report.md beside it, RESULTS.md in docs/
    here = f"\n\n![hit rates and TTFT]({pic.name})" if pic else ""
    in_docs = (
        f"\n\n![hit rates and TTFT](../{pic.resolve().relative_to(ROOT)})"
        if pic and pic.resolve().is_relative_to(ROOT)
        else ""
    )
    (out / "report.md").write_text(text + here + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            dict(
                infinite_cache_hit_rate=inf,
                arms=[
                    dict(
                        name=a.name,
                        summary=a.summary.to_json(),
                        store=a.store,
                        raw_put_mbps=a.raw_put_mbps,
                        raw_get_mbps=a.raw_get_mbps,
                        raw_error=a.raw_error,
                        cpu_s=a.cpu_s,
                        start_ttft=a.start_ttft,
                        after_ttft=a.after_ttft,
                        start_hit=a.start_hit,
                        after_hit=a.after_hit,
                    )
                    for a in results
                ],
            ),
            indent=1,
            default=str,
        )
    )
    print(text + here)
    if args.write_results:
        write_results_section("Global KV store", "Global KV store", text + in_docs)
    return 0 if len(results) == len(arms) else 1


if __name__ == "__main__":
    sys.exit(main())
