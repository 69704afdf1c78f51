"""The comparison's PNG plots: A's mean TTFT against Mooncake's published figures,
C's SLO attainment over the arrival rate, and B's mean TTFT over the GPU count.
matplotlib is optional: without it the report has no plots.
"""

from __future__ import annotations

import logging
from pathlib import Path

from bana_sglang.sim.config import SYSTEMS
from bana_sglang.sim.grid import C_ROWS, MOONCAKE_TTFT, OVERLAP_ROWS, SLO_GOAL, rates

logger = logging.getLogger(__name__)


def plot_all(results, img: Path, scales) -> list[str]:
    """Write the three PNGs into ``img``; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        logger.warning("matplotlib missing: no plots")
        return []
    img.mkdir(parents=True, exist_ok=True)
    names = []
    a = {s: results[("A", s)] for s in SYSTEMS if ("A", s) in results}
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(list(a), [r.ttft_mean for r in a.values()], color="tab:blue", label="simulated")
    for i, s in enumerate(a):
        if s in MOONCAKE_TTFT:
            ax.plot(
                i,
                MOONCAKE_TTFT[s],
                "r_",
                markersize=30,
                mew=3,
                label="Mooncake published" if s == "global_cache_aware" else None,
            )
    ax.set_ylabel("mean TTFT (s)")
    ax.set_title("A: conversation trace, 16 x (70B on 8x A100-class), real time")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    fig.tight_layout()
    fig.savefig(img / "sim_anchor_ttft.png", dpi=110)
    plt.close(fig)
    names.append("sim_anchor_ttft.png")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for s in C_ROWS:
        pts = rates(results, s)
        if pts:
            ax.plot(
                list(pts),
                list(pts.values()),
                marker="o",
                markersize=3,
                label=s,
                ls=":" if s in OVERLAP_ROWS else "-",
            )
    ax.axhline(SLO_GOAL, color="grey", ls="--")
    ax.set_xlabel("arrival rate (x the scale experiment's rate)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("C: 32 x H100, Llama-3.1-8B")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img / "sim_throughput.png", dpi=110)
    plt.close(fig)
    names.append("sim_throughput.png")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for s in SYSTEMS:
        xs = [n for n in scales if ("B", n, s) in results]
        if xs:
            ax.plot(xs, [results[("B", n, s)].ttft_mean for n in xs], marker="o", label=s)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("mean TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("B: same load per GPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img / "sim_scale_ttft.png", dpi=110)
    plt.close(fig)
    names.append("sim_scale_ttft.png")
    return names
