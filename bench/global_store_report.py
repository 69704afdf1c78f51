"""The report of :mod:`bench.bench_global_store`: every arm's result, the ratios
against the stock private-cache arms, the opening window apart from the rest, CPU
by part, the store's per-request breakdown and counters, the load bandwidth
against the raw get, and the picture (no cluster: the unit tests drive it with
made-up arms)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

from bana_sglang.radix_global import summary as store_summary
from bench import breakdown, metrics, workloads
from bench.results import machine_description

ARMS = ("store-round-robin", "nostore-round-robin", "ours", "bana-cache-aware")
#: the arms without the store: the stock private-cache setups the store is held against
STOCK = ("nostore-round-robin", "bana-cache-aware")


@dataclasses.dataclass
class ArmResult:
    name: str
    summary: metrics.Summary
    store: dict[str, dict[str, float] | None]
    raw_put_mbps: float | None = None
    raw_get_mbps: float | None = None
    raw_error: str | None = None  # why the raw bandwidth probe measured nothing
    page_nbytes: int | None = None
    metrics: dict | None = None  # the workers' /metrics deltas over the replay (breakdown)
    router: dict | None = None  # the router's global lookup histogram delta
    requests: int = 0
    cpu_s: dict[str, float] | None = None  # CPU seconds over the replay, by breakdown.CPU_PARTS
    # TTFTs of the requests that arrived in the replay's opening window, and of the rest
    start_ttft: list[float] = dataclasses.field(default_factory=list)
    after_ttft: list[float] = dataclasses.field(default_factory=list)
    # their prefix hit rates (reported cached tokens / prompt tokens)
    start_hit: float | None = None
    after_hit: float | None = None


def _sum(store: dict[str, dict[str, float] | None], key: str) -> float:
    return sum((m or {}).get(key, 0.0) for m in store.values())


def _hit(a: ArmResult) -> float | None:
    return a.summary.prefix_hit_rate


def _ratio(x: float | None, bases: Sequence[float | None], best) -> str:
    """``x`` over the best (``min`` or ``max``) of ``bases``, two decimals; ``n/a`` when
    ``x`` or every base is missing, NaN or zero (an arm with no successful request)."""
    ok = [b for b in bases if b is not None and b > 0 and not math.isnan(b)]
    if x is None or math.isnan(x) or not ok:
        return "n/a"
    return f"{x / best(ok):.2f}"


def ratio_rows(by: dict[str, ArmResult], inf_hit: float) -> list[str]:
    """The ratios the store is held to, for the comparisons whose arms ran: the store
    alone (``store-round-robin`` / ``nostore-round-robin``, routing held fixed) and
    as shipped (``ours`` against each stock private-cache arm that ran, and against
    the better of them for each figure: the lower TTFT, the higher hit rate)."""
    rows = [
        "| comparison | hit / infinite-cache hit | hit / stock hit | TTFT p50 | TTFT p99 | throughput |",
        "|---|---|---|---|---|---|",
    ]
    pairs: list[tuple[str, ArmResult, list[ArmResult]]] = []
    if "store-round-robin" in by and "nostore-round-robin" in by:
        pairs.append(
            (
                "store / no store, both round-robin",
                by["store-round-robin"],
                [by["nostore-round-robin"]],
            )
        )
    stock = [by[n] for n in STOCK if n in by]
    if "ours" in by:
        for s in stock:
            pairs.append((f"ours / {s.name}", by["ours"], [s]))
        if len(stock) > 1:
            pairs.append(("ours / the better stock arm", by["ours"], stock))
    if not pairs:
        return []

    for label, on, offs in pairs:
        s = on.summary
        g = _hit(on)
        cells = (
            _ratio(g, [inf_hit], max),
            _ratio(g, [_hit(o) for o in offs], max),
            _ratio(s.ttft.p50, [o.summary.ttft.p50 for o in offs], min),
            _ratio(s.ttft.p99, [o.summary.ttft.p99 for o in offs], min),
            _ratio(s.req_per_s, [o.summary.req_per_s for o in offs], max),
        )
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    rows += [
        "",
        "Targets: hit / infinite-cache hit >= 0.90; hit / stock hit >= 1.5 (against "
        "round-robin); TTFT p50 and p99 at most 0.8 of stock private caches.",
        "",
    ]
    return rows


def cpu_rows(arms: Sequence[ArmResult]) -> list[str]:
    """CPU seconds each arm's cluster spent over its replay, by part, and against the
    first stock arm (the store's cost in cores: on 2 shared cores, what a burst of
    cold requests queues behind)."""
    measured = [a for a in arms if a.cpu_s]
    if not measured:
        return []
    cols = [c for _, c in breakdown.CPU_PARTS]
    base = next((a for a in measured if a.name in STOCK), None)
    head = " | ".join(cols)
    rows = [
        "CPU seconds over the replay (user + system, every process and thread of a part, "
        "including the last second of publishing; prefill: both workers):",
        "",
        f"| arm | {head} | total | total / {base.name if base else 'stock'} |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for a in measured:
        assert a.cpu_s is not None
        cells = " | ".join(f"{a.cpu_s.get(c, 0.0):.1f}" for c in cols)
        rel = _ratio(a.cpu_s["total"], [base.cpu_s["total"] if base and base.cpu_s else None], min)
        rows.append(f"| {a.name} | {cells} | {a.cpu_s['total']:.1f} | {rel} |")
    return [*rows, ""]


def split_ttft(records, start_s: float) -> tuple[list[float], list[float]]:
    """TTFTs of the successful requests scheduled before ``start_s`` (seconds into the
    replay: the opening window, served from an empty cluster) and of those after."""
    start, after = [], []
    for r in records:
        if r.ok and r.ttft is not None:
            (start if r.scheduled_s < start_s else after).append(r.ttft)
    return start, after


def split_hit(records, start_s: float) -> tuple[float | None, float | None]:
    """Prefix hit rates (reported cached tokens / prompt tokens) of the successful
    requests scheduled before ``start_s`` and of those after (None: none reported)."""
    sums = {True: [0, 0], False: [0, 0]}
    for r in records:
        if r.ok and r.cached_tokens is not None:
            acc = sums[r.scheduled_s < start_s]
            acc[0] += r.cached_tokens
            acc[1] += r.prompt_len
    start, after = (sums[k][0] / sums[k][1] if sums[k][1] else None for k in (True, False))
    return start, after


def phase_rows(
    arms: Sequence[ArmResult],
    start_s: float,
    infinite: tuple[float, float] | None = None,
) -> list[str]:
    """TTFT and prefix hit rate of the opening window and of the rest, per arm, and
    TTFT against the stock arms: on two shared cores the first requests of an empty
    cluster, nearly all cold, queue behind each other, and with a few tens of requests
    they decide every arm's p99. ``infinite``: the infinite-cache hit rates of the two
    windows (the most prefill work any cache can save there)."""
    arms = [a for a in arms if a.start_ttft or a.after_ttft]
    if not arms or start_s <= 0:
        return []

    def pct(x: float | None) -> str:
        return f"{x:.1%}" if x is not None else "-"

    def cells(xs: list[float], hit: float | None) -> str:
        d = metrics.Dist.of(xs)
        if not d.n:
            return f"0 | {pct(hit)} | - | - | -"
        return f"{d.n} | {pct(hit)} | {d.p50:.3f} | {d.p99:.3f} | {d.mean:.3f}"

    rows = [
        f"TTFT (s) and prefix hit rate of the requests that arrived in the first "
        f"{start_s:.1f} s of the replay (from an empty cluster) and of the rest:",
        "",
        "| arm | start: n | hit | p50 | p99 | mean | after: n | hit | p50 | p99 | mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        rows.append(
            f"| {a.name} | {cells(a.start_ttft, a.start_hit)} | {cells(a.after_ttft, a.after_hit)} |"
        )
    if infinite is not None:
        rows.append(f"| infinite cache | | {pct(infinite[0])} | | | | | {pct(infinite[1])} | | | |")
    by = {a.name: a for a in arms}
    stock = [by[n] for n in STOCK if n in by and by[n].after_ttft]
    pairs = [(n, by[n]) for n in ("store-round-robin", "ours") if n in by and by[n].after_ttft]
    if stock and pairs:
        rows += [
            "",
            "| after the start: TTFT against the better stock arm | p50 | p99 |",
            "|---|---|---|",
        ]
        for n, a in pairs:
            d = metrics.Dist.of(a.after_ttft)
            base = [metrics.Dist.of(o.after_ttft) for o in stock]
            rows.append(
                f"| {n} | {_ratio(d.p50, [b.p50 for b in base], min)} | "
                f"{_ratio(d.p99, [b.p99 for b in base], min)} |"
            )
    return [*rows, ""]


def report(
    arms: Sequence[ArmResult],
    inf_hit: float,
    wl: workloads.Workload,
    command: str,
    start_s: float = 0.0,
    infinite_split: tuple[float, float] | None = None,
) -> str:
    by = {a.name: a for a in arms}
    # the store's breakdown: of the shipped arm when it ran, else of the round-robin one
    on = by.get("ours") or by.get("store-round-robin")
    lines = [
        f"Command: `{command}`",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Each arm is a cluster of "
        "its own, started for it: a store arm starts from an empty global store.",
        "",
        f"Workload: {wl.describe()}",
        "",
        f"Machine: {machine_description()}",
        "",
        "| arm | prefix hit rate | TTFT p50 (s) | TTFT p99 (s) | throughput (req/s) | out tok/s | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        s = a.summary
        hr = f"{s.prefix_hit_rate:.1%}" if s.prefix_hit_rate is not None else "n/a"
        lines.append(
            f"| {a.name} | {hr} | {s.ttft.p50:.3f} | {s.ttft.p99:.3f} | {s.req_per_s:.3f} | "
            f"{s.out_tok_per_s:.1f} | {s.errors} |"
        )
    lines += ["", f"Infinite-cache hit rate of the same slice: {inf_hit:.1%}", ""]
    lines += ratio_rows(by, inf_hit)
    lines += phase_rows(arms, start_s, infinite_split)
    lines += cpu_rows(arms)
    if on:
        loaded, load_s, wait_s = (
            _sum(on.store, k) for k in ("loaded_bytes", "load_seconds", "load_wait_seconds")
        )
        if on.metrics:
            lines += [
                "",
                f"Per-request breakdown of `{on.name}` (`/metrics` deltas over the replay):",
                "",
                breakdown.markdown(on.metrics, on.requests, on.router),
            ]
        lines += [
            "",
            f"Store counters of `{on.name}` (per worker, from `/metrics`):",
            "",
            "```",
            store_summary.table(list(on.store.items())),
            "```",
            "",
        ]
        if on.raw_error:  # said whether or not anything was loaded
            lines.append(f"- raw Mooncake bandwidth: not measured ({on.raw_error[:200]})")
        if load_s:
            bw = loaded / load_s / 1e6
            lines.append(
                f"- layer-wise load bandwidth reached: {bw:.1f} MB/s "
                f"({loaded / 1e6:.1f} MB in {load_s:.2f} s of load-thread time)"
            )
            if on.raw_get_mbps:
                lines.append(
                    f"- raw Mooncake get bandwidth, same store, {on.page_nbytes} B pages, batches of 16, "
                    f"zero copy: {on.raw_get_mbps:.1f} MB/s (put {on.raw_put_mbps:.1f} MB/s); "
                    f"ratio {bw / on.raw_get_mbps:.2f}"
                )
            lines.append(
                f"- load time hidden under compute: {1 - wait_s / load_s:.1%} "
                f"(forward waited {wait_s:.3f} s for layers to land)"
            )
    return "\n".join(x for x in lines if x is not None)


def plot(arms: Sequence[ArmResult], inf_hit: float, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [a.name for a in arms] + ["infinite cache"]
    vals = [a.summary.prefix_hit_rate or 0.0 for a in arms] + [inf_hit]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    colours = dict(
        zip(
            (*ARMS, "infinite cache"),
            ("tab:green", "tab:orange", "tab:olive", "tab:red", "tab:blue"),
        )
    )
    ax1.bar(names, vals, color=[colours.get(n, "tab:gray") for n in names])
    ax1.set_ylabel("prefix hit rate")
    ax1.set_ylim(0, 1)
    ax1.tick_params(axis="x", labelsize=7, labelrotation=20)
    for a in arms:
        recs = [json.loads(x) for x in (out / f"{a.name}.records.jsonl").read_text().splitlines()]
        ttfts = sorted(
            r["first_token_s"] - r["send_s"]
            for r in recs
            if r.get("ok") and r.get("first_token_s") is not None
        )
        if ttfts:
            ax2.plot(
                ttfts,
                [(i + 1) / len(ttfts) for i in range(len(ttfts))],
                label=a.name,
                color=colours.get(a.name),
            )
    ax2.set_xlabel("TTFT (s)")
    ax2.set_ylabel("CDF")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path = out / "hit_rates.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
