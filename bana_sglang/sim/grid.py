"""The comparison's fixed grid, shared by the runs (``compare``) and the report
(``report``, ``findings``, ``plots``): Mooncake's published anchors, the SLO goal,
experiment C's rate sweep and its bisection (``max_rate``, ``next_probe``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bana_sglang.sim.config import SYSTEMS
from bana_sglang.sim.metrics import SimResult

MOONCAKE_TTFT = {"global_cache_aware": 3.07, "local_cache_aware": 3.58, "load_only": 5.27}
SLO_GOAL = 0.9
SWEEP = (0.75, 1.0, 1.25, 1.5, 2.0)
# B's load nudged by a percent or two: how far the bana/global-cache-aware ratio moves
# with arrival times alone (the policies are discrete; the comparison is not smooth)
NUDGES = (0.98, 0.99, 1.01, 1.02)
REFINE_STEPS = 4  # bisections of C's grid step (0.25 -> 1/64)
ALL = tuple(SYSTEMS)
# C only: `bana` again with part of a decode peer's guest-layer compute hidden under its
# memory-bound steps (SimConfig.decode_overlap), since every other row assumes strict time
# sharing and that assumption is what ends `bana`'s throughput (TPOT)
OVERLAP_ROWS = {"bana, decode overlap 0.5": 0.5}
C_ROWS = ALL + tuple(OVERLAP_ROWS)


def rates(results: Mapping[tuple, SimResult], row: str) -> dict[float, float]:
    """C's runs of ``row`` (grid and bisection): {rate multiplier: SLO attainment}."""
    return dict(
        sorted((k[1], r.slo_attainment) for k, r in results.items() if k[0] == "C" and k[2] == row)
    )


def _first_miss(points: Mapping[float, float]) -> float:
    return min((m for m, a in points.items() if a < SLO_GOAL), default=math.inf)


def max_rate(points: Mapping[float, float]) -> float | None:
    """``{rate multiplier: SLO attainment}`` -> the highest rate meeting ``SLO_GOAL``
    below the lowest one that misses it (None: even the lowest misses it)."""
    miss = _first_miss(points)
    ok = [m for m, a in points.items() if a >= SLO_GOAL and m < miss]
    return max(ok) if ok else None


def next_probe(points: Mapping[float, float]) -> float | None:
    """The midpoint between ``max_rate`` and the lowest missing rate above it, or None
    (nothing met the goal, or nothing missed it)."""
    lo, miss = max_rate(points), _first_miss(points)
    if lo is None or math.isinf(miss):
        return None
    return (lo + miss) / 2
