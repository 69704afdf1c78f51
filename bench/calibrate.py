"""Calibration of the CPU profile on the live system, and the simulator's fidelity.

``python -m bench calibrate`` starts a 1P1D cluster of the embedded
``small`` model (the launcher's defaults: global store on, load-aware router)
and measures, through the router, one request at a time:
- prefill: TTFT of fresh prompts of several lengths (2 output tokens), fitted
  to the profile's prefill law ``fixed + flops(n) / (peak_flops * mfu)`` by
  least squares (the intercept takes the per-request overheads too: router,
  PD bootstrap and transfer, the first decode step);
- decode: the mean TPOT of batches of streamed requests, from which the
  per-step overhead ``decode_fixed_s`` is what the profile's decode law
  (with the fitted ``mfu``) leaves unexplained;
- host contention (both workers share this machine's cores): a
  ``CONTENTION_PROMPT``-token prefill while ``CONTENTION_DECODE`` decodes, against each
  alone. ``host_contention_prefill`` is the prefill's TTFT with / alone,
  ``host_contention_decode`` the decode steps' mean gap during that prefill /
  the batch's TPOT alone. The fidelity run simulates one shared host with them;
- joins: a prompt of each of ``JOIN_PROMPTS`` tokens joins that batch while it
  decodes. The running requests' gaps across the join, less a step, give the
  batch's hold (``decode_join_s + decode_join_s_per_token * tokens``); the
  joining request's own gap, less a step, the hold and its KV transfer, gives
  ``pd_handoff_s``. A ``JOIN_BUSY_PROMPT``-token join with the prefill worker
  idle and one during a long prefill give ``host_contention_join``: the KV
  transfer and the admission compete with the prefill for the cores, so a
  join then holds the batch several times longer (far more than a step slows).
It writes a profile JSON (default ``profiles/cpu_small_calibrated.json``)
whose fitted fields cite the run, and prints the fit's residuals.

The live harness here (cluster, client, warm-up, CPU steal, store faults) is
shared with :mod:`bench.fidelity`, which replays a trace slice live and
simulated with the profile this writes.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bana_sglang.sim.profiles import PROFILE_DIR, Profile, load_profile, save_profile
from bench import configs
from bench.client import ClientConfig, replay_checked
from bench.workloads import Request

logger = logging.getLogger("bench.calibrate")

PREFILL_LENGTHS = (128, 512, 1024, 2048, 3072, 4096)
CHUNKED_LENGTHS = (6144, 8192)  # longer than a chunk: the later chunks attend over a cached prefix
# Decode batches (prompt lengths of requests decoding together): short prompts at
# batch 1, 4 and 8, then a large KV. The lengths are mixed, as in the trace's bursts.
# (Until 2026-12-01 the CPU kernel ran a batch like the trace's first burst
# as one padded call, several times slower than these points' per-request path, which
# made the live decode slower than the calibrated law; bana_sglang.kernels.cpu_attention.decode_pads
# now chooses by measured cost, so both take the per-request path.)
DECODE_POINTS = (
    (128,),
    (32, 64, 96, 320),
    (32, 32, 64, 64, 96, 96, 160, 480),
    (256, 512, 1024, 2304),
    (128, 128, 256, 256, 384, 512, 1024, 1408),
)
CONTENTION_PROMPT = 2048
CONTENTION_DECODE = DECODE_POINTS[-1]
# prompts that join a running decode batch (CONTENTION_DECODE) one at a time: how long
# the batch holds while each is admitted (Profile.decode_join_s / _per_token)
JOIN_PROMPTS = (256, 1024, 2048)
# a prompt of JOIN_BUSY_PROMPT tokens joins that batch with the prefill worker idle,
# then while it prefills a JOIN_BUSY_PREFILL-token prompt sent JOIN_BUSY_DELAY_S later
# (its results lag one batch, so the join falls in the long prompt's second chunk):
# Profile.host_contention_join is the ratio of the batch's holds
JOIN_BUSY_PROMPT = 1024
JOIN_BUSY_PREFILL = 8192
JOIN_BUSY_DELAY_S = 0.5
MIN_DECODE_FIXED_S = 1e-4
WARM_BURST = (1792, 1536, 1280, 1024, 768, 512, 256, 128)  # 7296 tokens


def start_cluster(model: str, port: int, log_dir: Path):

    cfg = LaunchConfig(
        model_path=str(configs.model_dir(model)),
        num_prefill=1,
        num_decode=1,
        port=port,
        worker_base_port=port + 10,
        log_dir=log_dir,
    )
    return Cluster(plan_cluster(cfg), log_dir=log_dir, startup_timeout=900)


def live_client(endpoint: str):
    import httpx

    model = httpx.get(endpoint + "/v1/models", timeout=60).json()["data"][0]["id"]
    return ClientConfig(endpoint=endpoint, model=model, prompt_mode="ids", progress=False)


def replay(cfg, reqs):

    return replay_checked(cfg, reqs)


def _fresh(seed: int, n: int) -> tuple[int, ...]:
    import random

    rng = random.Random(seed)
    return tuple(rng.randrange(10, 8000) for _ in range(n))


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
    to (batch, KV tokens, TPOT); ``contention`` (from :func:`measure_contention`,
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
    """The profile's contention factors from :func:`measure_contention`'s numbers
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


def decode_gaps_during(decoding: list, t0: float, t1: float) -> list[float]:
    """Gaps between consecutive streamed chunks of ``decoding`` records that lie
    within ``[t0, t1]`` (client clock)."""
    gaps = []
    for r in decoding:
        ts = [t for t, _ in r.chunks]
        gaps += [b - a for a, b in zip(ts, ts[1:]) if a >= t0 and b <= t1]
    return gaps


def _batch(lens, seed: int, max_tokens: int, *, stride: int = 1, rid0: int = 0) -> list:
    """Requests arriving together with fresh prompts of ``lens`` tokens (request i's
    prompt seeded ``seed + stride * i``)."""

    return [
        Request(
            rid=rid0 + i, arrival_s=0.0, prompt=_fresh(seed + stride * i, n), max_tokens=max_tokens
        )
        for i, n in enumerate(lens)
    ]


def warm_up(cfg) -> None:
    """Two fresh prompts (256 and 2048 tokens) through the cluster before anything
    is measured: the first requests after start-up pay one-off costs (connections,
    first allocations) that the profile, calibrated warm, does not model."""

    for i, n in enumerate((256, 2048)):
        replay(cfg, [Request(rid=i, arrival_s=0.0, prompt=_fresh(900 + i, n), max_tokens=4)])
    # a burst of mixed lengths decoding together (WARM_BURST tokens of KV at once)
    replay(cfg, _batch(WARM_BURST, 910, 16, rid0=10))


def measure(
    endpoint: str, repeats: int = 2
) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:

    cfg = live_client(endpoint)
    warm_up(cfg)
    prefill = []
    seed = 100
    for n in PREFILL_LENGTHS:
        for _ in range(repeats):
            seed += 1
            (rec,) = replay(
                cfg, [Request(rid=seed, arrival_s=0.0, prompt=_fresh(seed, n), max_tokens=2)]
            )
            prefill.append((n, rec.ttft))
            logger.info("prefill %5d tokens: TTFT %.3fs", n, rec.ttft)
    for n in CHUNKED_LENGTHS:
        seed += 1
        (rec,) = replay(
            cfg, [Request(rid=seed, arrival_s=0.0, prompt=_fresh(seed, n), max_tokens=2)]
        )
        prefill.append((n, rec.ttft))
        logger.info("prefill %5d tokens (chunked): TTFT %.3fs", n, rec.ttft)
    decode = []
    for lens in DECODE_POINTS:
        seed += 1
        bsz = len(lens)
        recs = replay(cfg, _batch(lens, seed * 100, 33))
        split = [steady_and_handoff(r) for r in recs]
        tpot = statistics.fmean(x[0] for x in split)
        decode.append((bsz, sum(lens) + 16 * bsz, tpot))  # KV at the mean measured step
        logger.info(
            "decode batch %d: TPOT %.4fs (after the second token), hand-off %.3fs",
            bsz,
            tpot,
            statistics.fmean(x[1] for x in split),
        )
    return prefill, decode


def steady_and_handoff(r) -> tuple[float, float]:
    """A streamed record's decode step time after its second token, and how much
    longer than a step the gap from its first token (the prefill's) to the second
    took: the PD hand-off (bootstrap, KV transfer, admission)."""
    seen, second = 0, None
    for t, n in r.chunks:
        seen += n
        if seen >= 2:
            second = t
            break
    if second is None or r.output_tokens < 3:
        raise ValueError(
            f"request {r.rid}: needs at least 3 streamed tokens to split hand-off and steps"
        )
    steady = (r.end_s - second) / (r.output_tokens - 2)
    return steady, max(0.0, (second - r.first_token_s) - steady)


def speed_point(cfg, seed: int) -> dict[str, float]:
    """The host's speed on two reference points, each alone: ``decode_alone_s``,
    the mean step of a batch of ``CONTENTION_DECODE`` (33 tokens each), and
    ``prefill_alone_s``, the TTFT of a fresh ``CONTENTION_PROMPT``-token prompt
    (``batch_started_s``: when the batch's last request had its first token)."""

    recs = replay(cfg, _batch(CONTENTION_DECODE, seed, 33, stride=10))
    decode = statistics.fmean(steady_and_handoff(r)[0] for r in recs)
    (rec,) = replay(
        cfg,
        [Request(rid=99, arrival_s=0.0, prompt=_fresh(seed + 5, CONTENTION_PROMPT), max_tokens=2)],
    )
    return {
        "decode_alone_s": decode,
        "prefill_alone_s": rec.ttft,
        "batch_started_s": max(r.ttft for r in recs),
    }


def measure_contention(endpoint: str, repeats: int = 2) -> dict:
    """A ``CONTENTION_PROMPT``-token prefill and a decode batch of
    ``CONTENTION_DECODE`` (the largest decode point: a decode with a large,
    mixed KV is the one the trace's bursts run, and it loses more to a
    concurrent prefill than a small one), each alone and then together (the
    prefill arrives 0.5 s after the batch's first tokens); means over ``repeats``."""

    cfg = live_client(endpoint)
    out: dict[str, list[float]] = {}
    seed = 5000
    for _ in range(repeats):
        seed += 10
        speed = speed_point(cfg, seed)
        out.setdefault("decode_alone_s", []).append(speed["decode_alone_s"])
        out.setdefault("prefill_alone_s", []).append(speed["prefill_alone_s"])
        started = speed["batch_started_s"] + 0.5  # every request of the batch decoding
        big = Request(
            rid=99, arrival_s=started, prompt=_fresh(seed + 6, CONTENTION_PROMPT), max_tokens=2
        )
        recs = replay(cfg, _batch(CONTENTION_DECODE, seed + 7, 160, stride=10) + [big])
        b = next(r for r in recs if r.rid == 99)
        gaps = decode_gaps_during([r for r in recs if r.rid != 99], b.send_s, b.first_token_s)
        if not gaps:
            raise RuntimeError(
                "no decode step fell within the prefill: the decode batch ended too early"
            )
        out.setdefault("prefill_shared_s", []).append(b.ttft)
        out.setdefault("decode_shared_s", []).append(statistics.fmean(gaps))
        logger.info(
            "contention: prefill %.2fs alone, %.2fs with decode; decode step %.4fs alone, %.4fs during "
            "the prefill",
            out["prefill_alone_s"][-1],
            b.ttft,
            out["decode_alone_s"][-1],
            out["decode_shared_s"][-1],
        )
    return {k: statistics.fmean(v) for k, v in out.items()}


def join_effect(running: list, new) -> tuple[float, float]:
    """``(hold, gap)`` of one request ``new`` joining the decode batch of ``running``
    (streamed records, client clock): ``hold`` is how much longer than their own
    step the running requests' gaps across the join took (the join's window: ``new``'s
    first token, from the prefill, to its second, from the decode), averaged over the
    running requests; ``gap`` is ``new``'s first-to-second token gap less one step."""
    ts_new = [t for t, _ in new.chunks]
    if len(ts_new) < 3:
        raise ValueError(f"request {new.rid}: needs at least 3 streamed chunks to time its join")
    first, second = ts_new[0], ts_new[1]
    holds, steps = [], []
    for r in running:
        ts = [t for t, _ in r.chunks]
        gaps = list(itertools.pairwise(ts))
        if len(gaps) < 3:
            continue
        step = statistics.median(b - a for a, b in gaps)
        across = [b - a for a, b in gaps if b > first and a < second]
        if across:
            holds.append(sum(across) - step * len(across))
            steps.append(step)
    if not holds:
        raise ValueError(
            f"request {new.rid} joined no running batch: every request of it ended before "
            "its second token"
        )
    return statistics.fmean(holds), (second - first) - statistics.median(steps)


def measure_join(endpoint: str, repeats: int = 2) -> list[dict[str, float]]:
    """Each prompt of ``JOIN_PROMPTS`` joins a running batch of ``CONTENTION_DECODE``
    ``repeats`` times (arriving once every request of the batch decodes); per trial
    ``{"tokens", "hold_s", "gap_s"}`` from :func:`join_effect`."""

    cfg = live_client(endpoint)
    seed = 6000
    probe = replay(cfg, _batch(CONTENTION_DECODE, seed, 4, stride=10))
    started = max(r.ttft for r in probe) + 0.5
    points = []
    for n in JOIN_PROMPTS:
        for _ in range(repeats):
            seed += 10
            new = Request(rid=99, arrival_s=started, prompt=_fresh(seed + 5, n), max_tokens=8)
            recs = replay(cfg, _batch(CONTENTION_DECODE, seed, 160, stride=10) + [new])
            rec = next(r for r in recs if r.rid == 99)
            hold, gap = join_effect([r for r in recs if r.rid != 99], rec)
            points.append({"tokens": n, "hold_s": hold, "gap_s": gap})
            logger.info(
                "join of a %d-token prompt: the batch held %.3fs, its own gap %.3fs beyond a step",
                n,
                hold,
                gap,
            )
    return points


def measure_busy_join(endpoint: str, repeats: int = 2) -> dict[str, float]:
    """``repeats`` pairs of joins of a ``JOIN_BUSY_PROMPT``-token prompt into a
    running batch of ``CONTENTION_DECODE``: one with the prefill worker idle, one
    while it prefills a ``JOIN_BUSY_PREFILL``-token prompt. Returns the batch's mean
    hold in each (``join_idle_hold_s``, ``join_busy_hold_s``, from
    :func:`join_effect`) over the pairs whose busy join fell within that prefill."""

    cfg = live_client(endpoint)
    seed = 7000
    probe = replay(cfg, _batch(CONTENTION_DECODE, seed, 4, stride=10))
    started = max(r.ttft for r in probe) + 0.5
    idle, busy = [], []
    for _ in range(repeats):
        pair = []
        for during in (False, True):
            seed += 10
            new = Request(
                rid=99, arrival_s=started, prompt=_fresh(seed + 5, JOIN_BUSY_PROMPT), max_tokens=8
            )
            big = (
                [
                    Request(
                        rid=98,
                        arrival_s=started + JOIN_BUSY_DELAY_S,
                        prompt=_fresh(seed + 6, JOIN_BUSY_PREFILL),
                        max_tokens=2,
                    )
                ]
                if during
                else []
            )
            # the batch must outlast the long prefill to be there at the join
            recs = replay(
                cfg,
                _batch(CONTENTION_DECODE, seed, 320 if during else 160, stride=10) + [new] + big,
            )
            rec = next(r for r in recs if r.rid == 99)
            try:
                hold, _ = join_effect([r for r in recs if r.rid < 90], rec)
            except ValueError as e:
                logger.warning("busy-join trial dropped: %s", e)
                break
            if during:
                b = next(r for r in recs if r.rid == 98)
                if not (b.send_s < rec.chunks[0][0] and rec.chunks[1][0] < b.first_token_s):
                    logger.warning(
                        "busy-join trial dropped: the join did not fall within the %d-token prefill",
                        JOIN_BUSY_PREFILL,
                    )
                    break
            pair.append(hold)
        if len(pair) == 2:
            idle.append(pair[0])
            busy.append(pair[1])
            logger.info(
                "join of a %d-token prompt: the batch held %.3fs with the prefill idle, %.3fs during a "
                "%d-token prefill",
                JOIN_BUSY_PROMPT,
                pair[0],
                pair[1],
                JOIN_BUSY_PREFILL,
            )
    if not idle:
        raise RuntimeError(
            f"no join fell within a {JOIN_BUSY_PREFILL}-token prefill in {repeats} trials"
        )
    return {"join_idle_hold_s": statistics.fmean(idle), "join_busy_hold_s": statistics.fmean(busy)}


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


STALL_LINE = (
    "Failed to complete transfers after"  # Mooncake: a batch waited out its transfer timeout
)
FAIL_LINE = "TRANSFER_FAIL"


def store_faults(log_dir: Path) -> dict[str, int]:
    """Mooncake transfer faults the cluster's processes logged: ``stalls`` (batches
    that waited out the transfer engine's 60 s timeout; while one waits, the
    machine's two cores do measurably less work) and ``failed`` (keys whose
    transfer failed: publishes skipped, loads missed). A run with stalls is not
    the system the profile describes."""
    out = {"stalls": 0, "failed": 0}
    for f in sorted(Path(log_dir).glob("*.log")):
        with open(f, errors="replace") as fh:
            for line in fh:
                if STALL_LINE in line:
                    out["stalls"] += 1
                elif FAIL_LINE in line:
                    out["failed"] += 1
    return out


def cpu_steal_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat: the share of time the
    hypervisor gave this VM's CPUs to someone else; (0, 0) where unreadable."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (f[7] if len(f) > 7 else 0), sum(f[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """CPU steal between two :func:`cpu_steal_ticks` readings, as a share of all CPU time."""
    return (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else 0.0


def run_calibrate(args) -> int:
    out = Path(args.out or PROFILE_DIR / "cpu_small_calibrated.json")
    base = load_profile(args.profile)
    if args.measurements:  # refit a previous run's measurements (its .fit.json)
        old = json.loads(Path(args.measurements).read_text())
        prefill = [(r["tokens"], r["measured_s"]) for r in old["prefill"]]
        decode = [(r["batch"], r["kv_tokens"], r["measured_s"]) for r in old["decode"]]
        contention = {
            k: v
            for k, v in old.get("contention", {}).items()
            if k.endswith("_s") or k in ("prefill_result_lag", "join_points")
        } or None
    else:
        log_dir = Path(args.log_dir or f"/tmp/bana-calibrate-{int(time.time())}")
        with start_cluster(args.model, args.port, log_dir) as cluster:
            ticks0 = cpu_steal_ticks()
            prefill, decode = measure(cluster.plan.endpoint, args.repeats)
            contention = measure_contention(cluster.plan.endpoint, args.repeats)
            contention["join_points"] = measure_join(cluster.plan.endpoint, args.repeats)
            contention.update(measure_busy_join(cluster.plan.endpoint, args.repeats))
            # SGLang runs its overlap event loop unless told not to (the launcher does not)
            contention["prefill_result_lag"] = not any(
                "--disable-overlap-schedule" in w.argv for w in cluster.plan.workers
            )
            steal = steal_share(ticks0, cpu_steal_ticks())
        print(f"CPU steal (hypervisor) during the measurements: {100 * steal:.1f}%")
        faults = store_faults(log_dir)
        print(
            f"Mooncake transfer faults in the cluster's logs: {faults['stalls']} batches stalled for the 60 s "
            f"timeout, {faults['failed']} failed transfers"
            + (
                " (WARNING: stalls slow everything on this machine; measure again)"
                if faults["stalls"]
                else ""
            )
        )
    prof, fit = calibrate(base, prefill, decode, contention)
    prof = replace(prof, name=out.stem)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    notes = {
        "description": f"{base.name} calibrated on the live 1P1D cluster ({args.model} model) on {day}: "
        "python -m bench calibrate",
        "mfu": f"fitted {day}: TTFT of fresh prompts {list(PREFILL_LENGTHS)} tokens x{args.repeats}, least "
        "squares on the profile's prefill FLOPs",
        "peak_flops": f"{base.name}'s, or the fitted effective FLOP/s where that is higher ({day})",
        "prefill_fixed_s": f"fitted {day}: intercept of the same fit (router, PD bootstrap and transfer, "
        "first decode step included)",
        "decode_fixed_s": f"fitted {day}: intercept of a least-squares fit of the step time (after the second "
        f"token) on batch and KV bytes, batches of mixed prompt lengths {list(DECODE_POINTS)}, "
        "less the weights' read",
        "decode_per_request_s": f"fitted {day}: the same fit's batch coefficient",
        "kv_read_bytes_per_s": f"fitted {day}: 1 / the same fit's KV-byte coefficient",
        "prefix_attention_cost": f"fitted {day}: TTFT of fresh prompts {list(CHUNKED_LENGTHS)} tokens (chunked "
        "prefill) against the law with the dense fit's rate",
        "pd_handoff_s": f"measured {day}: median over prompts of {list(JOIN_PROMPTS)} tokens joining a running "
        "decode batch of their first-to-second token gap less one step, the batch's hold and "
        "their modelled KV transfer",
        "decode_join_s": f"measured {day}: intercept of a least-squares fit, on the joining prompt's tokens, of how "
        f"much longer than a step a running batch of prompts {list(CONTENTION_DECODE)} took "
        f"across the join of a prompt of {list(JOIN_PROMPTS)} tokens",
        "decode_join_s_per_token": f"measured {day}: the same fit's slope",
        "prefill_result_lag": "SGLang's overlap event loop (its default, kept by the launcher): a prefill batch's "
        "results go out after the next batch computes",
        "host_contention_prefill": f"measured {day}: TTFT of a {CONTENTION_PROMPT}-token prompt while the batch "
        "decodes / alone (both workers on this machine's cores)",
        "host_contention_join": f"measured {day}: how long a running batch of prompts {list(CONTENTION_DECODE)} "
        f"held across the join of a {JOIN_BUSY_PROMPT}-token prompt during a "
        f"{JOIN_BUSY_PREFILL}-token prefill / with the prefill worker idle, x{args.repeats}",
        "host_contention_decode": f"measured {day}: mean decode step of a batch of prompts {list(CONTENTION_DECODE)} "
        f"during a {CONTENTION_PROMPT}-token prefill / their TPOT alone",
    }
    if prof.hbm_bytes_per_s != base.hbm_bytes_per_s:
        notes["hbm_bytes_per_s"] = (
            f"fitted {day}: the decode fit's intercept was shorter than reading the weights "
            f"at {base.name}'s {base.hbm_bytes_per_s / 1e9:g} GB/s; the rate that reads them "
            "in that intercept (less the minimum fixed overhead)"
        )
    inherited = dict(x.split(": ", 1) for x in (*base.sources, *base.assumptions) if ": " in x)
    save_profile(prof, out, {**inherited, **notes})
    (out.with_suffix(".fit.json")).write_text(json.dumps(fit, indent=2))
    print(
        f"wrote {out}: mfu {prof.mfu:.3f}, prefill_fixed_s {prof.prefill_fixed_s:.3f}, "
        f"decode_fixed_s {prof.decode_fixed_s:.4f}"
    )
    for row in fit["prefill"]:
        print(
            f"  prefill {row['tokens']:5d} tok: measured {row['measured_s']:.3f}s fitted {row['fitted_s']:.3f}s"
        )
    for row in fit["decode"]:
        print(
            f"  decode batch {row['batch']}: measured {row['measured_s']:.4f}s fitted {row['fitted_s']:.4f}s"
        )
    if "contention" in fit:
        c = fit["contention"]
        print(
            f"  contention: prefill {c['prefill_alone_s']:.2f}s alone, {c['prefill_shared_s']:.2f}s with decode "
            f"(x{c['host_contention_prefill']:.2f}); decode step {c['decode_alone_s']:.4f}s alone, "
            f"{c['decode_shared_s']:.4f}s during prefill (x{c['host_contention_decode']:.2f})"
        )
        print(
            f"  PD hand-off {prof.pd_handoff_s:.3f}s; prefill results lag one batch: "
            f"{c.get('prefill_result_lag', False)}; a joining request holds the decode batch "
            f"{prof.decode_join_s:.3f}s + {prof.decode_join_s_per_token * 1e3:.3f}s per 1k prompt tokens"
        )
        if "join_busy_hold_s" in c:
            print(
                f"  join of a {JOIN_BUSY_PROMPT}-token prompt: the batch held {c['join_idle_hold_s']:.3f}s with the "
                f"prefill idle, {c['join_busy_hold_s']:.3f}s during a prefill (x{prof.host_contention_join:.2f})"
            )
    return 0
