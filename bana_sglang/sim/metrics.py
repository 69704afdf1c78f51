"""Per-request records and the summary of one simulation run.

Invariants: a ``SimResult`` is frozen; latencies are seconds; ``finished``
counts each request exactly once; ratios are computed from the same run's
records only.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    rid: int
    arrival: float
    first_token: float
    finish: float
    input_len: int
    output_len: int
    hbm_hit_tokens: int
    store_hit_tokens: int
    prefill_worker: str
    decode_worker: str
    floor_s: float = (
        0.0  # its TTFT alone on an idle worker without migration (Profile.lone_prefill_seconds)
    )

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (
            (self.finish - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0
        )


@dataclass(frozen=True)
class SimResult:
    system: str
    num_requests: int
    finished: int
    makespan_s: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_mean: float
    tpot_p90: float
    e2e_mean: float
    req_per_s: float
    out_tok_per_s: float
    slo_attainment: float  # share meeting both TTFT and TPOT SLOs
    hit_rate: float  # prompt tokens served from any cache tier
    store_hit_rate: float  # of which from the second tier (global store / DRAM)
    prefill_imbalance: float  # max / mean busy time over prefill-capable workers
    prefill_cv: float
    migrations: int
    migration_bytes: int
    wall_s: float
    rejected: int = 0  # requests whose KV can never fit a worker (not in the latencies)
    # mean no-wait TTFT: each request alone on an idle worker with its cache hits, no
    # migration; ttft_mean - this is queueing (and what a balancer can remove by
    # spreading load; only splitting a prompt's layers can go below it)
    ttft_floor_mean: float = math.nan
    early_recalls: int = 0  # layer leases ended early: their host needed its memory back

    def row(self) -> dict:
        return asdict(self)


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    v = sorted(xs)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarise(
    system: str,
    records: list[RequestRecord],
    n_requests: int,
    *,
    busy: list[float],
    migrations: int,
    migration_bytes: int,
    slo_ttft: float,
    slo_tpot: float,
    wall_s: float,
    rejected: int = 0,
    early_recalls: int = 0,
) -> SimResult:
    if not records:
        nan = float("nan")
        return SimResult(
            system=system,
            num_requests=n_requests,
            finished=0,
            makespan_s=0.0,
            ttft_mean=nan,
            ttft_p50=nan,
            ttft_p90=nan,
            ttft_p99=nan,
            tpot_mean=nan,
            tpot_p90=nan,
            e2e_mean=nan,
            req_per_s=0.0,
            out_tok_per_s=0.0,
            slo_attainment=0.0,
            hit_rate=0.0,
            store_hit_rate=0.0,
            prefill_imbalance=1.0,
            prefill_cv=0.0,
            migrations=migrations,
            migration_bytes=migration_bytes,
            wall_s=wall_s,
            rejected=rejected,
            early_recalls=early_recalls,
        )
    ttft = [r.ttft for r in records]
    floor = statistics.fmean(r.floor_s for r in records)
    tpot = [r.tpot for r in records if r.output_len > 1] or [0.0]
    e2e = [r.finish - r.arrival for r in records]
    start = min(r.arrival for r in records)
    end = max(r.finish for r in records)
    span = max(1e-9, end - start)
    prompt = sum(r.input_len for r in records)
    hits = sum(r.hbm_hit_tokens + r.store_hit_tokens for r in records)
    ok = sum(1 for r in records if r.ttft <= slo_ttft and r.tpot <= slo_tpot)
    b = list(busy) or [0.0]
    mean_b = statistics.fmean(b)
    return SimResult(
        system=system,
        num_requests=n_requests,
        finished=len(records),
        makespan_s=span,
        ttft_mean=statistics.fmean(ttft),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        tpot_mean=statistics.fmean(tpot),
        tpot_p90=percentile(tpot, 90),
        e2e_mean=statistics.fmean(e2e),
        req_per_s=len(records) / span,
        out_tok_per_s=sum(r.output_len for r in records) / span,
        slo_attainment=ok / n_requests,
        hit_rate=hits / max(1, prompt),
        store_hit_rate=sum(r.store_hit_tokens for r in records) / max(1, prompt),
        prefill_imbalance=max(b) / mean_b if mean_b > 0 else 1.0,
        prefill_cv=statistics.pstdev(b) / mean_b if mean_b > 0 else 0.0,
        migrations=migrations,
        migration_bytes=migration_bytes,
        wall_s=wall_s,
        rejected=rejected,
        ttft_floor_mean=floor,
        early_recalls=early_recalls,
    )
