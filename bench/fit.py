"""The calibration's fits: measured points in, a profile out (pure; no cluster).

``calibrate`` fits the prefill law (``mfu``, ``prefill_fixed_s``, the prefix
attention cost of chunked prompts), the decode law (``fit_decode``: fixed,
per-request and per-KV-byte step costs), the host contention factors
(``contention_factors``) and the join hold and PD hand-off (``fit_join``) to the
numbers :mod:`bench.calibrate` measures on the live cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from bana_sglang.sim.profiles import Profile

MIN_DECODE_FIXED_S = 1e-4


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("need at least two distinct x values")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def chunked_prefill_seconds(p: Profile, n: int) -> float:
    """A fresh ``n``-token prompt prefilled alone in chunks of ``max_prefill_tokens`` (as the simulator does)."""
    return p.lone_prefill_seconds(n)


def fit_prefix_cost(p: Profile, chunked: list[tuple[int, float]]) -> float:
    """The multiplier on prefix-attention FLOPs that makes chunked prompts' predicted
    TTFT match the measured ones (least squares; the prediction is linear in it)."""
    xs, ys = [], []
    for n, t in chunked:
        at1 = chunked_prefill_seconds(replace(p, prefix_attention_cost=1.0), n)
        prefix_s = (
            chunked_prefill_seconds(replace(p, prefix_attention_cost=2.0), n) - at1
        )  # its seconds at cost 1
        xs.append(prefix_s)
        ys.append(t - (at1 - prefix_s))
    return max(1.0, sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-12))


def fit_plane(x1: list[float], x2: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x1 + c x2`` (normal equations); returns ``(a, b, c)``."""
    n = len(ys)
    m1, m2, my = sum(x1) / n, sum(x2) / n, sum(ys) / n
    u, v, w = [x - m1 for x in x1], [x - m2 for x in x2], [y - my for y in ys]
    suu, svv, suv = sum(x * x for x in u), sum(x * x for x in v), sum(x * y for x, y in zip(u, v))
    suw, svw = sum(x * y for x, y in zip(u, w)), sum(x * y for x, y in zip(v, w))
    det = suu * svv - suv * suv
    if det <= 1e-12 * max(suu * svv, 1e-300):
        raise ValueError(
            "the two regressors are collinear: need points that vary batch and KV apart"
        )
    b = (suw * svv - svw * suv) / det
    c = (svw * suu - suw * suv) / det
    return my - b * m1 - c * m2, b, c


def fit_decode(p: Profile, decode: list[tuple[int, int, float]]) -> Profile:
    """Step time = fixed + per_request x batch + weights / (hbm_bw x eff) + KV bytes / kv_rate,
    fitted by least squares on (batch, KV tokens, step time); without a positive
    batch coefficient, on the KV alone; with points that do not separate them,
    only the fixed overhead is refitted (the law's other terms as they are)."""
    batches, kv_bytes = (
        [b for b, _, _ in decode],
        [kv * p.kv_bytes_per_token for _, kv, _ in decode],
    )
    times = [t for _, _, t in decode]
    try:
        a, per_req, per_byte = fit_plane(batches, kv_bytes, times)
    except ValueError:
        a = per_req = per_byte = 0.0
    if per_req < 0 and len(set(kv_bytes)) > 1:  # no per-request cost visible: the KV alone
        (a, per_byte), per_req = fit_line(kv_bytes, times), 0.0
    if per_req < 0 or per_byte <= 0:
        rest = [t - (p.decode_step_seconds(bsz, kv) - p.decode_fixed_s) for bsz, kv, t in decode]
        return replace(p, decode_fixed_s=max(MIN_DECODE_FIXED_S, statistics.median(rest)))
    p = replace(p, kv_read_bytes_per_s=1.0 / per_byte, decode_per_request_s=per_req)
    weights = p.weight_bytes / (p.hbm_bytes_per_s * p.hbm_efficiency)
    if (
        a - weights >= MIN_DECODE_FIXED_S
    ):  # the weights' read stays the profile's; the rest is overhead
        return replace(p, decode_fixed_s=a - weights)
    # The intercept is shorter than reading the weights at the profile's bandwidth: on
    # this machine they are read faster (a CPU's caches can hold much of a small
    # model). Keep the measured intercept: the weights' read is what is left of it.
    return replace(
        p,
        decode_fixed_s=MIN_DECODE_FIXED_S,
        hbm_bytes_per_s=p.weight_bytes / (p.hbm_efficiency * max(a - MIN_DECODE_FIXED_S, 1e-6)),
    )


def calibrate(
    base: Profile,
    prefill: list[tuple[int, float]],
    decode: list[tuple[int, int, float]],
    contention: dict | None = None,
) -> tuple[Profile, dict]:
    """Fit ``mfu``/``prefill_fixed_s`` to (prompt tokens, TTFT) and ``decode_fixed_s``
    to (batch, KV tokens, TPOT); ``contention`` (from
    :func:`bench.calibrate.measure_contention`,
    optionally with ``pd_handoff_s`` and ``prefill_result_lag``) sets the host
    contention factors and the PD scheduling details. Pure: the numbers in, a
    profile out."""
    chunked = [(n, t) for n, t in prefill if n > base.max_prefill_tokens]
    prefill = [(n, t) for n, t in prefill if n <= base.max_prefill_tokens]
    xs = [base.prefill_flops(n, 0) for n, _ in prefill]
    a, b = fit_line(xs, [t for _, t in prefill])
    if b <= 0:
        raise ValueError(
            f"prefill time does not grow with the prompt (slope {b}): too noisy to fit"
        )
    mfu = 1.0 / (b * base.peak_flops)
    # Faster than the profile's peak (its FLOP count or its peak is off): the
    # fitted effective rate becomes the peak, at full efficiency.
    p = replace(
        base,
        mfu=min(1.0, mfu),
        peak_flops=base.peak_flops * max(1.0, mfu),
        prefill_fixed_s=max(0.0, a),
    )
    if chunked:
        p = replace(p, prefix_attention_cost=fit_prefix_cost(p, chunked))
    p = fit_decode(p, decode)
    factors = contention_factors(contention) if contention else {}
    if contention:
        p = replace(p, **factors)
        if "pd_handoff_s" in contention:
            p = replace(p, pd_handoff_s=max(0.0, float(contention["pd_handoff_s"])))
        if contention.get("join_points"):  # sets pd_handoff_s again, beyond the joins' hold
            p = fit_join(p, contention["join_points"])
        if "prefill_result_lag" in contention:
            p = replace(p, prefill_result_lag=bool(contention["prefill_result_lag"]))
    fit = {
        "prefill": [
            {"tokens": n, "measured_s": t, "fitted_s": chunked_prefill_seconds(p, n)}
            for n, t in prefill + chunked
        ],
        "decode": [
            {
                "batch": bsz,
                "kv_tokens": kv,
                "measured_s": t,
                "fitted_s": p.decode_step_seconds(bsz, kv),
            }
            for bsz, kv, t in decode
        ],
    }
    if contention:
        fit["contention"] = {**contention, **factors}
        if contention.get(
            "join_points"
        ):  # what the profile took (its pd_handoff_s replaces the batches')
            fit["join"] = {
                "decode_join_s": p.decode_join_s,
                "decode_join_s_per_token": p.decode_join_s_per_token,
                "pd_handoff_s": p.pd_handoff_s,
            }
    return p, fit


def contention_factors(c: dict) -> dict[str, float]:
    """The profile's contention factors from
    :func:`bench.calibrate.measure_contention`'s numbers
    (never below 1: a faster run under load is noise, not help)."""
    for k in ("prefill_alone_s", "prefill_shared_s", "decode_alone_s", "decode_shared_s"):
        if not c.get(k) or c[k] <= 0:
            raise ValueError(
                f"contention measurement {k!r} is missing or not positive: {c.get(k)!r}"
            )
    out = {
        "host_contention_prefill": max(1.0, c["prefill_shared_s"] / c["prefill_alone_s"]),
        "host_contention_decode": max(1.0, c["decode_shared_s"] / c["decode_alone_s"]),
    }
    if (
        "join_idle_hold_s" in c or "join_busy_hold_s" in c
    ):  # measure_busy_join (fits before it lack them)
        idle, busy = c.get("join_idle_hold_s"), c.get("join_busy_hold_s")
        if idle is None or busy is None or idle <= 0 or busy < 0:
            raise ValueError(
                f"busy-join measurement needs a positive idle hold and a busy one: idle {idle!r}, "
                f"busy {busy!r}"
            )
        out["host_contention_join"] = max(1.0, busy / idle)
    return out


def fit_join(p: Profile, points: list[dict[str, float]]) -> Profile:
    """``decode_join_s``/``_per_token`` (least squares of the hold on the prompt tokens,
    never negative) and ``pd_handoff_s``: the median of what a joining request's own
    gap has beyond the hold, its KV transfer and a step (the simulator adds those)."""
    tokens = [float(x["tokens"]) for x in points]
    holds = [float(x["hold_s"]) for x in points]
    if len(set(tokens)) >= 2:
        a, b = fit_line(tokens, holds)
    else:
        a, b = statistics.fmean(holds), 0.0
    if b < 0:
        a, b = statistics.fmean(holds), 0.0
    p = replace(p, decode_join_s=max(0.0, a), decode_join_s_per_token=b)
    rest = [
        x["gap_s"]
        - p.join_stall_seconds(int(x["tokens"]))
        - p.net_seconds(x["tokens"] * p.kv_bytes_per_token) * (1 - p.pd_transfer_overlap)
        for x in points
    ]
    return replace(p, pd_handoff_s=max(0.0, statistics.median(rest)))
