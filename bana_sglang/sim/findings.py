"""The report's "Reading the results" section: every sentence's figures are
computed here from the runs (``SimResult``s keyed as in ``compare``).
"""

from __future__ import annotations

import math

from bana_sglang.sim.grid import MOONCAKE_TTFT, OVERLAP_ROWS, SLO_GOAL
from bana_sglang.sim.metrics import SimResult


def nudged_ratios(results, scales) -> dict[int, dict[float, float]]:
    """{GPUs: {load factor: bana / global-cache-aware mean TTFT}}, the unnudged run as 1.0."""
    out: dict[int, dict[float, float]] = {}
    for n in scales:
        row = {}
        for k in results:
            if (
                k[0] == "B~"
                and k[1] == n
                and k[3] == "bana"
                and ("B~", n, k[2], "global_cache_aware") in results
            ):
                row[k[2]] = (
                    results[k].ttft_mean / results[("B~", n, k[2], "global_cache_aware")].ttft_mean
                )
        if row and ("B", n, "bana") in results and ("B", n, "global_cache_aware") in results:
            row[1.0] = (
                results[("B", n, "bana")].ttft_mean
                / results[("B", n, "global_cache_aware")].ttft_mean
            )
            out[n] = row
    return out


def findings(results: dict[tuple, SimResult], thr: dict[str, float | None]) -> list[str]:
    """Numbers-first reading of the runs above (every figure is computed here)."""
    L = ["## Reading the results\n"]
    a = {k[1]: r for k, r in results.items() if k[0] == "A"}
    if {"bana", "bana_no_migration", "global_cache_aware", "local_cache_aware", "load_only"} <= set(
        a
    ):
        g = a["global_cache_aware"].ttft_mean
        L.append(
            f"- Baseline ordering (A): local/global = {a['local_cache_aware'].ttft_mean / g:.2f} "
            f"(Mooncake: {MOONCAKE_TTFT['local_cache_aware'] / MOONCAKE_TTFT['global_cache_aware']:.2f}), "
            f"load-only/global = {a['load_only'].ttft_mean / g:.2f} "
            f"(Mooncake: {MOONCAKE_TTFT['load_only'] / MOONCAKE_TTFT['global_cache_aware']:.2f}); "
            f"simulated global-cache-aware mean TTFT {g:.2f} s vs 3.07 s published. The "
            "absolute agreement depends on the assumed MFU and on Mooncake's cluster split, "
            "which the paper does not state for this figure; compare orderings and ratios, not seconds."
        )
        nm = a["bana_no_migration"].ttft_mean / g
        why = (
            "With layer-wise loading a second-tier hit costs about the same on every "
            "worker, so the cost-based router has little to exploit beyond queue length and "
            "both mostly pick the least-queued worker; the gain over `load_only` comes from "
            "the global store, not from the router."
            if abs(nm - 1) < 0.05
            else "The two routers differ measurably here; see D for how the gap moves with the "
            "store's bandwidth and overlap."
        )
        L.append(
            f"- Load-only routing with the global store (`bana_no_migration`) vs "
            f"global-cache-aware routing: {nm:.2f}x TTFT. {why}"
        )
        b = a["bana"]
        L.append(
            f"- `bana` (with the balancer) vs global-cache-aware: {b.ttft_mean / g:.2f}x mean "
            f"TTFT, {b.ttft_p99 / a['global_cache_aware'].ttft_p99:.2f}x p99 TTFT, but "
            f"{b.tpot_mean / a['global_cache_aware'].tpot_mean:.2f}x mean TPOT: the TTFT gain "
            "comes from layer migrations that lend decode workers' time to the prefill tier, "
            "and in this model (strict time sharing) the decode tier pays for it. "
            f"{b.migrations} migrations, {b.migration_bytes / 1e9:.0f} GB moved."
        )
    bs = sorted({k[1] for k in results if k[0] == "B"})
    cells = []
    for n in bs:
        if ("B", n, "bana") in results and ("B", n, "global_cache_aware") in results:
            r = (
                results[("B", n, "bana")].ttft_mean
                / results[("B", n, "global_cache_aware")].ttft_mean
            )
            cells.append(f"{n} GPUs {r:.4f}x ({'met' if r <= 0.85 else 'NOT met'})")
    if cells:
        nudged = nudged_ratios(results, bs)
        spread = "; ".join(
            f"{n} GPUs {min(r.values()):.3f}-{max(r.values()):.3f}" for n, r in nudged.items()
        )
        L.append(
            "- Scale (B), `bana` / global-cache-aware mean TTFT at the same load per GPU: "
            + ", ".join(cells)
            + "."
            + (
                f" With the load nudged by up to 2% either way the ratio spans {spread}: a "
                "result within about 0.02 of the goal is on it, not clearly on either side."
                if nudged
                else ""
            )
        )
        waits = []
        for n in bs:
            g = results.get(("B", n, "global_cache_aware"))
            if g is not None and not math.isnan(g.ttft_floor_mean):
                waits.append(
                    f"{n} GPUs {g.ttft_mean:.2f} s of which {g.ttft_floor_mean:.2f} s floor, "
                    f"{g.ttft_mean - g.ttft_floor_mean:.3f} s waiting "
                    f"({(g.ttft_mean - g.ttft_floor_mean) / g.ttft_mean:.0%})"
                )
        if waits:
            L.append(
                "- What is left to balance (B): global-cache-aware's mean TTFT against its no-wait "
                "floor (each request alone on an idle worker with the same cache hits): "
                + "; ".join(waits)
                + ". More workers multiplex the bursts better, so at 32-64 GPUs "
                "nearly all of the mean is the long prompts' own compute: spreading load cannot get "
                "far below it, and what `bana` gains beyond the waiting comes from splitting long "
                "prompts' layers onto decode workers (chunks pipeline across the pair), which is why "
                "its mean can sit below the static floor."
            )
    sp = {k[2]: r for k, r in results.items() if k[0] == "E" and k[1] == "shared_prefix"}
    if "sglang_cache_aware" in sp and "bana_no_migration" in sp:
        L.append(
            f"- Hotspot (E, shared prefix): SGLang-style `cache_aware` routing has prefill "
            f"busy-time imbalance {sp['sglang_cache_aware'].prefill_imbalance:.2f} (max/mean) "
            f"and {sp['sglang_cache_aware'].ttft_p99:.2f} s p99 TTFT, load-only routing with "
            f"the global store {sp['bana_no_migration'].prefill_imbalance:.2f} and "
            f"{sp['bana_no_migration'].ttft_p99:.2f} s."
        )
    if thr and thr.get("bana") is not None:

        def at(s):
            m = thr.get(s)
            if m is None:
                return f"{s} below the lowest rate"
            r = results[("C", m, s)]
            return f"{s} x{m:.4g} (mean TTFT {r.ttft_mean:.2f} s, TPOT {r.tpot_mean * 1e3:.0f} ms there)"

        def miss(s):
            pts = {k[1]: r for k, r in results.items() if k[0] == "C" and k[2] == s}
            above = [m for m in pts if m > thr[s] and pts[m].slo_attainment < SLO_GOAL]
            if not above:
                return "none swept"
            r = pts[min(above)]
            return (
                f"x{min(above):.4g}: {r.slo_attainment:.0%} meet both SLOs, mean TTFT "
                f"{r.ttft_mean:.2f} s, TPOT {r.tpot_mean * 1e3:.0f} ms"
            )

        L.append(
            "- Throughput under SLO (C), the highest rate each system sustains: "
            + "; ".join(at(s) for s in ("bana", "bana_no_migration", "colocated", "load_only"))
            + ". `bana` holds TTFT low past the others' limits by lending decode workers' time "
            f"to prefill layers. At its first missed rate, {miss('bana')}."
            + "".join(
                f" With {ov:.0%} of a decode peer's guest-layer compute hidden under its "
                f"own steps: {at(row)}."
                for row, ov in OVERLAP_ROWS.items()
                if row in thr
            )
        )
    L.append("")
    return L
