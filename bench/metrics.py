"""Metrics over replay records: latency percentiles, throughput, goodput, load.

Definitions (all times in seconds, on the client's clock):

- TTFT: first streamed token minus send time; TPOT: (end - first token) /
  (output tokens - 1); ITL: gaps between streamed tokens; E2E: end - send.
- Duration: from the run's start (the first arrival) to the last response;
  request throughput = successful requests / duration, token throughputs
  count successful requests' prompt and output tokens.
- Goodput: successful requests that meet every given SLO (TTFT and/or TPOT),
  per second of duration; ``goodput_frac`` is their share of all requests.
- Prefix hit rate: cached prompt tokens / prompt tokens, over requests whose
  response reported ``cached_tokens`` (``--enable-cache-report``).
- Load imbalance, from the workers' ``/metrics`` samples: per worker busy
  time = wall time - scheduler idle time over the run; imbalance = max/mean of
  busy time among workers of the same role (1.0 = even; the worst role when
  there are several) and its coefficient of variation; also the
  time-averaged running + queued requests per worker. SGLang refreshes its
  decode gauges every ``--decode-log-interval`` steps, which the side-by-side
  configurations set low for this reason.

Percentiles use linear interpolation (numpy's default), like SGLang's own
benchmark, so the two agree on the same samples.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import numpy as np

from bench.client import LoadSample, RequestRecord

QUANTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft is None or r.ttft > self.ttft_s):
            return False
        if self.tpot_s is not None and r.tpot is not None and r.tpot > self.tpot_s:
            return False
        return True

    def describe(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"TTFT <= {self.ttft_s * 1000:.0f} ms")
        if self.tpot_s is not None:
            parts.append(f"TPOT <= {self.tpot_s * 1000:.0f} ms")
        return " and ".join(parts) or "none (every successful request counts)"


@dataclasses.dataclass(frozen=True)
class Dist:
    mean: float
    p50: float
    p90: float
    p99: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Dist:
        if not xs:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        a = np.asarray(xs, dtype=float)
        p50, p90, p99 = (float(np.percentile(a, q)) for q in QUANTILES)
        return cls(float(a.mean()), p50, p90, p99, len(a))


@dataclasses.dataclass(frozen=True)
class LoadStats:
    workers: tuple[str, ...]
    busy_s: tuple[float, ...]  # per worker, over the run
    mean_inflight: tuple[float, ...]  # time-averaged running + queued requests
    imbalance: float  # max/mean of busy time within a role (worst role)
    cv: float  # coefficient of variation of busy time within a role (worst role)
    hit_rate_gauge: float | None  # mean of sglang:cache_hit_rate over samples with traffic


@dataclasses.dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    errors: int
    duration_s: float
    req_per_s: float
    in_tok_per_s: float
    out_tok_per_s: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    goodput_per_s: float
    goodput_frac: float
    slo: str
    prefix_hit_rate: float | None
    load: LoadStats | None
    error_kinds: dict[str, int]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def inflight_of(values: dict[str, float]) -> float:
    """Requests a worker holds: running + queued, plus PD bootstrap/transfer queues."""
    return sum(
        v
        for k, v in values.items()
        if k in ("sglang:num_running_reqs", "sglang:num_queue_reqs")
        or (
            k.startswith(("sglang:num_prefill_", "sglang:num_decode_"))
            and k.endswith("_queue_reqs")
        )
    )


def load_stats(samples: Sequence[LoadSample]) -> LoadStats | None:
    by: dict[str, list[LoadSample]] = {}
    for s in samples:
        by.setdefault(s.worker, []).append(s)
    if not by:
        return None
    names = tuple(sorted(by))
    busy, inflight, hits = [], [], []
    for n in names:
        ss = sorted(by[n], key=lambda s: s.t)
        idle_key = "sglang:scheduler_idle_seconds_total"
        if len(ss) >= 2 and idle_key in ss[0].values and idle_key in ss[-1].values:
            wall = ss[-1].t - ss[0].t
            idle = ss[-1].values[idle_key] - ss[0].values[idle_key]
            busy.append(max(0.0, wall - idle))
        else:
            busy.append(float("nan"))
        q = [inflight_of(s.values) for s in ss]
        inflight.append(statistics.fmean(q) if q else 0.0)
        hits += [
            s.values["sglang:cache_hit_rate"]
            for s in ss
            if s.values.get("sglang:num_running_reqs", 0) > 0
            and "sglang:cache_hit_rate" in s.values
        ]
    # Imbalance is measured among workers of the same role (prefill-*, decode-*,
    # colocated-*): a prefill and a decode worker do different work.
    roles: dict[str, list[float]] = {}
    for n, b in zip(names, busy):
        if not math.isnan(b):
            roles.setdefault(n.rsplit("-", 1)[0], []).append(b)
    per_role = [
        (max(g) / statistics.fmean(g), statistics.pstdev(g) / statistics.fmean(g))
        for g in roles.values()
        if len(g) > 1 and statistics.fmean(g) > 0
    ]
    imb = max((i for i, _ in per_role), default=float("nan"))
    cv = max((c for _, c in per_role), default=float("nan"))
    return LoadStats(
        workers=names,
        busy_s=tuple(busy),
        mean_inflight=tuple(inflight),
        imbalance=imb,
        cv=cv,
        hit_rate_gauge=statistics.fmean(hits) if hits else None,
    )


def summarize(
    records: Sequence[RequestRecord], slo: SLO = SLO(), samples: Sequence[LoadSample] = ()
) -> Summary:
    ok = [r for r in records if r.ok]
    start = min((r.scheduled_s for r in records), default=0.0)
    end = max((r.end_s for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    kinds: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = r.error.split(":", 1)[0][:60]
            kinds[key] = kinds.get(key, 0) + 1
    itls = [x for r in ok for x in r.itls]
    reported = [r for r in ok if r.cached_tokens is not None]
    hit = (
        sum(r.cached_tokens or 0 for r in reported) / max(1, sum(r.prompt_len for r in reported))
        if reported
        else None
    )
    good = sum(1 for r in records if slo.met(r))
    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=len(records) - len(ok),
        duration_s=duration,
        req_per_s=len(ok) / duration,
        in_tok_per_s=sum(r.prompt_len for r in ok) / duration,
        out_tok_per_s=sum(r.output_tokens for r in ok) / duration,
        ttft=Dist.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Dist.of([r.tpot for r in ok if r.tpot is not None]),
        itl=Dist.of(itls),
        e2e=Dist.of([r.e2e for r in ok]),
        goodput_per_s=good / duration,
        goodput_frac=good / max(1, len(records)),
        slo=slo.describe(),
        prefix_hit_rate=hit,
        load=load_stats(samples),
        error_kinds=kinds,
    )


def ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.0f}"


def format_summary(name: str, s: Summary) -> str:
    """A short human-readable block for one run."""
    lines = [
        f"== {name}: {s.ok}/{s.requests} ok, {s.errors} errors {s.error_kinds or ''}, {s.duration_s:.1f}s",
        f"   throughput {s.req_per_s:.3f} req/s, {s.in_tok_per_s:.0f} in tok/s, {s.out_tok_per_s:.1f} out tok/s; "
        f"goodput {s.goodput_per_s:.3f} req/s ({s.goodput_frac:.0%}; SLO {s.slo})",
    ]
    for label, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        lines.append(
            f"   {label:<4} ms  mean {ms(d.mean):>6}  p50 {ms(d.p50):>6}  p90 {ms(d.p90):>6}  "
            f"p99 {ms(d.p99):>6}  (n={d.n})"
        )
    if s.prefix_hit_rate is not None:
        lines.append(
            f"   prefix hit rate (reported cached tokens / prompt tokens): {s.prefix_hit_rate:.1%}"
        )
    if s.load:
        per = ", ".join(
            f"{w} {b:.1f}s/{q:.1f}"
            for w, b, q in zip(s.load.workers, s.load.busy_s, s.load.mean_inflight)
        )
        lines.append(
            f"   per-worker busy s / mean in-flight: {per}; imbalance max/mean {s.load.imbalance:.2f}, "
            f"CV {s.load.cv:.2f}"
        )
    return "\n".join(lines)
