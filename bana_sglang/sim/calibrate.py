"""Calibration of the CPU profile on the live system, and the simulator's fidelity.

``python -m bana_sglang.sim calibrate`` starts a 1P1D cluster of the embedded
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
  ``pd_handoff_s``.
It writes a profile JSON (default ``profiles/cpu_small_calibrated.json``)
whose fitted fields cite the run, and prints the fit's residuals.

``python -m bana_sglang.sim fidelity`` replays one slice of the Mooncake
conversation trace (lengths scaled by ``--length-scale``, the prefix
structure kept: one block per hash id) on the live 1P1D cluster with the
benchmark client, then the same requests (arrival, prompt and output
lengths, block hashes) in the simulator with that profile and the same system
(``bana_no_migration``: load-aware routing, global store, no balancer), and
prints the relative error of mean and p99 TTFT, mean TPOT and throughput.
With ``--repeats N`` it replays the slice N times, each on a fresh cluster
(a used one would serve the slice's prefixes from its global store), compares
the simulator with the runs' mean and prints the runs' own spread: on a
shared VM the live system's speed drifts by more than the 5.5% target, so one
live run cannot show that target met or missed. Both commands print the CPU
steal time (``/proc/stat``: time the hypervisor gave this VM's CPUs to other
guests) over what they measured.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bana_sglang.sim.profiles import PROFILE_DIR, Profile, load_profile, save_profile

logger = logging.getLogger("bana_sglang.sim.calibrate")

PREFILL_LENGTHS = (128, 512, 1024, 2048, 3072, 4096)
CHUNKED_LENGTHS = (6144, 8192)  # longer than a chunk: the later chunks attend over a cached prefix
# Decode batches (prompt lengths of requests decoding together): short prompts at
# batch 1, 4 and 8, then a large KV. The lengths are mixed, as in the trace's bursts.
# (Until 2026-12-01 the CPU kernel ran a batch like the trace's first burst
# as one padded call, several times slower than these points' per-request path, which
# made the live decode slower than the calibrated law; kernels.cpu_attention.decode_pads
# now chooses by measured cost, so both take the per-request path.)
DECODE_POINTS = ((128,), (32, 64, 96, 320), (32, 32, 64, 64, 96, 96, 160, 480),
                 (256, 512, 1024, 2304), (128, 128, 256, 256, 384, 512, 1024, 1408))
CONTENTION_PROMPT = 2048
CONTENTION_DECODE = DECODE_POINTS[-1]
# prompts that join a running decode batch (CONTENTION_DECODE) one at a time: how long
# the batch holds while each is admitted (Profile.decode_join_s / _per_token)
JOIN_PROMPTS = (256, 1024, 2048)
MIN_DECODE_FIXED_S = 1e-4
WARM_BURST = (1792, 1536, 1280, 1024, 768, 512, 256, 128)  # 7296 tokens


def _cluster(model: str, port: int, log_dir: Path):
    from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
    from bench import configs

    cfg = LaunchConfig(model_path=str(configs.model_dir(model)), num_prefill=1, num_decode=1, port=port,
                       worker_base_port=port + 10, log_dir=log_dir)
    return Cluster(plan_cluster(cfg), log_dir=log_dir, startup_timeout=900)


def _client(endpoint: str):
    import httpx

    from bench.client import ClientConfig

    model = httpx.get(endpoint + "/v1/models", timeout=60).json()["data"][0]["id"]
    return ClientConfig(endpoint=endpoint, model=model, prompt_mode="ids", progress=False)


def _replay(cfg, reqs):
    from bench.client import replay_checked

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
        prefix_s = chunked_prefill_seconds(replace(p, prefix_attention_cost=2.0), n) - at1  # its seconds at cost 1
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
        raise ValueError("the two regressors are collinear: need points that vary batch and KV apart")
    b = (suw * svv - svw * suv) / det
    c = (svw * suu - suw * suv) / det
    return my - b * m1 - c * m2, b, c


def fit_decode(p: Profile, decode: list[tuple[int, int, float]]) -> Profile:
    """Step time = fixed + per_request x batch + weights / (hbm_bw x eff) + KV bytes / kv_rate,
    fitted by least squares on (batch, KV tokens, step time); without a positive
    batch coefficient, on the KV alone; with points that do not separate them,
    only the fixed overhead is refitted (the law's other terms as they are)."""
    batches, kv_bytes = [b for b, _, _ in decode], [kv * p.kv_bytes_per_token for _, kv, _ in decode]
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
    if a - weights >= MIN_DECODE_FIXED_S:  # the weights' read stays the profile's; the rest is overhead
        return replace(p, decode_fixed_s=a - weights)
    # The intercept is shorter than reading the weights at the profile's bandwidth: on
    # this machine they are read faster (a CPU's caches can hold much of a small
    # model). Keep the measured intercept: the weights' read is what is left of it.
    return replace(p, decode_fixed_s=MIN_DECODE_FIXED_S,
                   hbm_bytes_per_s=p.weight_bytes / (p.hbm_efficiency * max(a - MIN_DECODE_FIXED_S, 1e-6)))


def calibrate(base: Profile, prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]],
              contention: dict | None = None) -> tuple[Profile, dict]:
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
        raise ValueError(f"prefill time does not grow with the prompt (slope {b}): too noisy to fit")
    mfu = 1.0 / (b * base.peak_flops)
    # Faster than the profile's peak (its FLOP count or its peak is off): the
    # fitted effective rate becomes the peak, at full efficiency.
    p = replace(base, mfu=min(1.0, mfu), peak_flops=base.peak_flops * max(1.0, mfu), prefill_fixed_s=max(0.0, a))
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
    fit = {"prefill": [{"tokens": n, "measured_s": t, "fitted_s": chunked_prefill_seconds(p, n)}
                       for n, t in prefill + chunked],
           "decode": [{"batch": bsz, "kv_tokens": kv, "measured_s": t, "fitted_s": p.decode_step_seconds(bsz, kv)}
                      for bsz, kv, t in decode]}
    if contention:
        fit["contention"] = {**contention, **factors}
        if contention.get("join_points"):  # what the profile took (its pd_handoff_s replaces the batches')
            fit["join"] = {"decode_join_s": p.decode_join_s, "decode_join_s_per_token": p.decode_join_s_per_token,
                           "pd_handoff_s": p.pd_handoff_s}
    return p, fit


def contention_factors(c: dict) -> dict[str, float]:
    """The profile's contention factors from :func:`measure_contention`'s numbers
    (never below 1: a faster run under load is noise, not help)."""
    for k in ("prefill_alone_s", "prefill_shared_s", "decode_alone_s", "decode_shared_s"):
        if not c.get(k) or c[k] <= 0:
            raise ValueError(f"contention measurement {k!r} is missing or not positive: {c.get(k)!r}")
    return {"host_contention_prefill": max(1.0, c["prefill_shared_s"] / c["prefill_alone_s"]),
            "host_contention_decode": max(1.0, c["decode_shared_s"] / c["decode_alone_s"])}


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
    from bench.workloads import Request

    return [Request(rid=rid0 + i, arrival_s=0.0, prompt=_fresh(seed + stride * i, n), max_tokens=max_tokens)
            for i, n in enumerate(lens)]


def warm_up(cfg) -> None:
    """Two fresh prompts (256 and 2048 tokens) through the cluster before anything
    is measured: the first requests after start-up pay one-off costs (connections,
    first allocations) that the profile, calibrated warm, does not model."""
    from bench.workloads import Request

    for i, n in enumerate((256, 2048)):
        _replay(cfg, [Request(rid=i, arrival_s=0.0, prompt=_fresh(900 + i, n), max_tokens=4)])
    # a burst of mixed lengths decoding together (WARM_BURST tokens of KV at once)
    _replay(cfg, _batch(WARM_BURST, 910, 16, rid0=10))


def measure(endpoint: str, repeats: int = 2) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    from bench.workloads import Request

    cfg = _client(endpoint)
    warm_up(cfg)
    prefill = []
    seed = 100
    for n in PREFILL_LENGTHS:
        for _ in range(repeats):
            seed += 1
            rec, = _replay(cfg, [Request(rid=seed, arrival_s=0.0, prompt=_fresh(seed, n), max_tokens=2)])
            prefill.append((n, rec.ttft))
            logger.info("prefill %5d tokens: TTFT %.3fs", n, rec.ttft)
    for n in CHUNKED_LENGTHS:
        seed += 1
        rec, = _replay(cfg, [Request(rid=seed, arrival_s=0.0, prompt=_fresh(seed, n), max_tokens=2)])
        prefill.append((n, rec.ttft))
        logger.info("prefill %5d tokens (chunked): TTFT %.3fs", n, rec.ttft)
    decode, handoffs = [], []
    for lens in DECODE_POINTS:
        seed += 1
        bsz = len(lens)
        recs = _replay(cfg, _batch(lens, seed * 100, 33))
        split = [steady_and_handoff(r) for r in recs]
        tpot = statistics.fmean(x[0] for x in split)
        handoffs += [x[1] for x in split]
        decode.append((bsz, sum(lens) + 16 * bsz, tpot))  # KV at the mean measured step
        logger.info("decode batch %d: TPOT %.4fs (after the second token), hand-off %.3fs", bsz, tpot,
                    statistics.fmean(x[1] for x in split))
    return prefill, decode, statistics.median(handoffs)


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
        raise ValueError(f"request {r.rid}: needs at least 3 streamed tokens to split hand-off and steps")
    steady = (r.end_s - second) / (r.output_tokens - 2)
    return steady, max(0.0, (second - r.first_token_s) - steady)


def measure_contention(endpoint: str, repeats: int = 2) -> dict:
    """A ``CONTENTION_PROMPT``-token prefill and a decode batch of
    ``CONTENTION_DECODE`` (the largest decode point: a decode with a large,
    mixed KV is the one the trace's bursts run, and it loses more to a
    concurrent prefill than a small one), each alone and then together (the
    prefill arrives 0.5 s after the batch's first tokens); means over ``repeats``."""
    from bench.workloads import Request

    cfg = _client(endpoint)
    out: dict[str, list[float]] = {}
    seed = 5000
    for _ in range(repeats):
        seed += 10
        recs = _replay(cfg, _batch(CONTENTION_DECODE, seed, 33, stride=10))
        out.setdefault("decode_alone_s", []).append(statistics.fmean(steady_and_handoff(r)[0] for r in recs))
        started = max(r.ttft for r in recs) + 0.5  # every request of the batch decoding
        rec, = _replay(cfg, [Request(rid=99, arrival_s=0.0, prompt=_fresh(seed + 5, CONTENTION_PROMPT),
                                     max_tokens=2)])
        out.setdefault("prefill_alone_s", []).append(rec.ttft)
        big = Request(rid=99, arrival_s=started, prompt=_fresh(seed + 6, CONTENTION_PROMPT), max_tokens=2)
        recs = _replay(cfg, _batch(CONTENTION_DECODE, seed + 7, 160, stride=10) + [big])
        b = next(r for r in recs if r.rid == 99)
        gaps = decode_gaps_during([r for r in recs if r.rid != 99], b.send_s, b.first_token_s)
        if not gaps:
            raise RuntimeError("no decode step fell within the prefill: the decode batch ended too early")
        out.setdefault("prefill_shared_s", []).append(b.ttft)
        out.setdefault("decode_shared_s", []).append(statistics.fmean(gaps))
        logger.info("contention: prefill %.2fs alone, %.2fs with decode; decode step %.4fs alone, %.4fs during "
                    "the prefill", out["prefill_alone_s"][-1], b.ttft, out["decode_alone_s"][-1],
                    out["decode_shared_s"][-1])
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
        raise ValueError(f"request {new.rid} joined no running batch: every request of it ended before "
                         "its second token")
    return statistics.fmean(holds), (second - first) - statistics.median(steps)


def measure_join(endpoint: str, repeats: int = 2) -> list[dict[str, float]]:
    """Each prompt of ``JOIN_PROMPTS`` joins a running batch of ``CONTENTION_DECODE``
    ``repeats`` times (arriving once every request of the batch decodes); per trial
    ``{"tokens", "hold_s", "gap_s"}`` from :func:`join_effect`."""
    from bench.workloads import Request

    cfg = _client(endpoint)
    seed = 6000
    probe = _replay(cfg, _batch(CONTENTION_DECODE, seed, 4, stride=10))
    started = max(r.ttft for r in probe) + 0.5
    points = []
    for n in JOIN_PROMPTS:
        for _ in range(repeats):
            seed += 10
            new = Request(rid=99, arrival_s=started, prompt=_fresh(seed + 5, n), max_tokens=8)
            recs = _replay(cfg, _batch(CONTENTION_DECODE, seed, 160, stride=10) + [new])
            rec = next(r for r in recs if r.rid == 99)
            hold, gap = join_effect([r for r in recs if r.rid != 99], rec)
            points.append({"tokens": n, "hold_s": hold, "gap_s": gap})
            logger.info("join of a %d-token prompt: the batch held %.3fs, its own gap %.3fs beyond a step",
                        n, hold, gap)
    return points


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
    rest = [x["gap_s"] - p.join_stall_seconds(int(x["tokens"]))
            - p.net_seconds(x["tokens"] * p.kv_bytes_per_token) * (1 - p.pd_transfer_overlap) for x in points]
    return replace(p, pd_handoff_s=max(0.0, statistics.median(rest)))


def live_metrics(live: list, duration_live: float) -> dict[str, float]:
    """One live replay's metrics, keyed as in the fidelity table."""
    from bana_sglang.sim.metrics import percentile

    ttft = [r.ttft for r in live if r.ttft is not None]
    tpot = [r.tpot for r in live if r.tpot is not None]
    return {"mean TTFT s": statistics.fmean(ttft), "p99 TTFT s": percentile(ttft, 99),
            "mean TPOT s": statistics.fmean(tpot) if tpot else 0.0,
            "throughput out tok/s": sum(r.output_tokens for r in live) / duration_live}


def fidelity_rows(runs: list[dict[str, float]], sim_result) -> list[dict]:
    """Rows (metric, live mean over ``runs``, simulated, relative error, and the
    live runs' own spread: (max - min) / mean) from per-run live metrics."""
    sim = {"mean TTFT s": sim_result.ttft_mean, "p99 TTFT s": sim_result.ttft_p99,
           "mean TPOT s": sim_result.tpot_mean, "throughput out tok/s": sim_result.out_tok_per_s}
    if not runs:
        raise ValueError("no live run to compare with")
    rows = []
    for m, sv in sim.items():
        vals = [r[m] for r in runs]
        lv = statistics.fmean(vals)
        rows.append({"metric": m, "live": lv, "sim": sv, "error": (sv - lv) / lv if lv else float("nan"),
                     "live_runs": vals, "live_spread": (max(vals) - min(vals)) / lv if lv else float("nan")})
    return rows


def fidelity_compare(live: list, sim_result, duration_live: float) -> list[dict]:
    """Rows (metric, live, simulated, relative error) from one replay's records and a SimResult."""
    return fidelity_rows([live_metrics(live, duration_live)], sim_result)


STALL_LINE = "Failed to complete transfers after"  # Mooncake: a batch waited out its transfer timeout
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
        contention = {k: v for k, v in old.get("contention", {}).items()
                      if k.endswith("_s") or k in ("prefill_result_lag", "join_points")} or None
    else:
        log_dir = Path(args.log_dir or f"/tmp/bana-calibrate-{int(time.time())}")
        with _cluster(args.model, args.port, log_dir) as cluster:
            ticks0 = cpu_steal_ticks()
            prefill, decode, handoff = measure(cluster.plan.endpoint, args.repeats)
            contention = measure_contention(cluster.plan.endpoint, args.repeats)
            contention["pd_handoff_s"] = handoff
            contention["join_points"] = measure_join(cluster.plan.endpoint, args.repeats)
            # SGLang runs its overlap event loop unless told not to (the launcher does not)
            contention["prefill_result_lag"] = not any(
                "--disable-overlap-schedule" in w.argv for w in cluster.plan.workers)
            steal = steal_share(ticks0, cpu_steal_ticks())
        print(f"CPU steal (hypervisor) during the measurements: {100 * steal:.1f}%")
        faults = store_faults(log_dir)
        print(f"Mooncake transfer faults in the cluster's logs: {faults['stalls']} batches stalled for the 60 s "
              f"timeout, {faults['failed']} failed transfers" + (
                  " (WARNING: stalls slow everything on this machine; measure again)" if faults["stalls"] else ""))
    prof, fit = calibrate(base, prefill, decode, contention)
    prof = replace(prof, name=out.stem)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    notes = {
        "description": f"{base.name} calibrated on the live 1P1D cluster ({args.model} model) on {day}: "
                       "python -m bana_sglang.sim calibrate",
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
        "host_contention_decode": f"measured {day}: mean decode step of a batch of prompts {list(CONTENTION_DECODE)} "
                                  f"during a {CONTENTION_PROMPT}-token prefill / their TPOT alone",
    }
    if prof.hbm_bytes_per_s != base.hbm_bytes_per_s:
        notes["hbm_bytes_per_s"] = (f"fitted {day}: the decode fit's intercept was shorter than reading the weights "
                                    f"at {base.name}'s {base.hbm_bytes_per_s / 1e9:g} GB/s; the rate that reads them "
                                    "in that intercept (less the minimum fixed overhead)")
    inherited = dict(x.split(": ", 1) for x in (*base.sources, *base.assumptions) if ": " in x)
    save_profile(prof, out, {**inherited, **notes})
    (out.with_suffix(".fit.json")).write_text(json.dumps(fit, indent=2))
    print(f"wrote {out}: mfu {prof.mfu:.3f}, prefill_fixed_s {prof.prefill_fixed_s:.3f}, "
          f"decode_fixed_s {prof.decode_fixed_s:.4f}")
    for row in fit["prefill"]:
        print(f"  prefill {row['tokens']:5d} tok: measured {row['measured_s']:.3f}s fitted {row['fitted_s']:.3f}s")
    for row in fit["decode"]:
        print(f"  decode batch {row['batch']}: measured {row['measured_s']:.4f}s fitted {row['fitted_s']:.4f}s")
    if "contention" in fit:
        c = fit["contention"]
        print(f"  contention: prefill {c['prefill_alone_s']:.2f}s alone, {c['prefill_shared_s']:.2f}s with decode "
              f"(x{c['host_contention_prefill']:.2f}); decode step {c['decode_alone_s']:.4f}s alone, "
              f"{c['decode_shared_s']:.4f}s during prefill (x{c['host_contention_decode']:.2f})")
        print(f"  PD hand-off {prof.pd_handoff_s:.3f}s; prefill results lag one batch: "
              f"{c.get('prefill_result_lag', False)}; a joining request holds the decode batch "
              f"{prof.decode_join_s:.3f}s + {prof.decode_join_s_per_token * 1e3:.3f}s per 1k prompt tokens")
    return 0


def _replay_live(args, wl, run: int) -> tuple[list, float, float, dict[str, int]]:
    """One replay of the slice on a fresh cluster (a used one would hold the
    slice's prefixes in its global store): (records, makespan s, CPU steal share,
    the cluster's store faults)."""
    log_dir = Path(args.log_dir) / f"run{run}"
    with _cluster(args.model, args.port, log_dir) as cluster:
        cfg = _client(cluster.plan.endpoint)
        warm_up(cfg)
        ticks0 = cpu_steal_ticks()
        t0 = time.monotonic()
        live = _replay(cfg, wl.requests)
        duration = time.monotonic() - t0
        steal = steal_share(ticks0, cpu_steal_ticks())
    makespan = max(r.end_s for r in live) - min(r.scheduled_s for r in live) if live else duration
    return live, makespan, steal, store_faults(log_dir)


def run_fidelity(args) -> int:
    from bana_sglang.sim.config import SimConfig, system_config
    from bana_sglang.sim.engine import Simulation
    from bana_sglang.sim.workloads import SimRequest
    from bench import configs
    from bench.workloads import MOONCAKE_BLOCK, TokenSpace, WorkloadSpec, build

    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    space = TokenSpace.from_model(configs.model_dir(args.model))
    spec = WorkloadSpec(name="mooncake", num_requests=args.requests, request_rate=args.rate,
                        length_scale=args.length_scale, trace_offset=args.offset)
    wl = build(spec, space)
    args.log_dir = args.log_dir or f"/tmp/bana-fidelity-{int(time.time())}"
    lives, runs, steals, faults = [], [], [], []
    for k in range(args.repeats):
        live, makespan, steal, fault = _replay_live(args, wl, k)
        lives.append(live)
        runs.append(live_metrics(live, makespan))
        steals.append(steal)
        faults.append(fault)
        logger.warning("live run %d/%d: mean TTFT %.3fs, mean TPOT %.4fs, CPU steal %.1f%%, store stalls %d, "
                       "failed transfers %d", k + 1, args.repeats, runs[-1]["mean TTFT s"], runs[-1]["mean TPOT s"],
                       100 * steal, fault["stalls"], fault["failed"])
    block = max(1, round(MOONCAKE_BLOCK * args.length_scale))
    sim_reqs = [SimRequest(rid=r.rid, arrival=r.arrival_s, input_len=len(r.prompt), output_len=r.max_tokens,
                           hashes=tuple(r.prefix_ids)) for r in wl.requests]
    # both live workers share this machine's cores: one simulated host
    sim_cfg = system_config("bana_no_migration", SimConfig(profile=str(args.profile_path), num_workers=2,
                                                           prefill_fraction=0.5, page_tokens=block,
                                                           shared_host=True))
    sim = Simulation(sim_cfg, sim_reqs, system="bana_no_migration")
    res = sim.run()
    rows = fidelity_rows(runs, res)
    n = len(runs)
    head = f"| metric | live{' (mean of %d runs)' % n if n > 1 else ''} | simulated | error |"
    lines = [f"Fidelity: {wl.describe()}", "", head, "|---|---|---|---|"]
    lines += [f"| {r['metric']} | {r['live']:.4f} | {r['sim']:.4f} | {100 * r['error']:+.1f}% |" for r in rows]
    if n > 1:
        lines += ["", "| metric | live runs | live spread (max-min)/mean | error vs each run |", "|---|---|---|---|"]
        for r in rows:
            vals = ", ".join(f"{v:.4f}" for v in r["live_runs"])
            errs = ", ".join(f"{100 * (r['sim'] - v) / v:+.1f}%" for v in r["live_runs"])
            lines.append(f"| {r['metric']} | {vals} | {100 * r['live_spread']:.1f}% | {errs} |")
    lines += ["", "CPU steal (hypervisor) during the live replays: "
              + ", ".join(f"{100 * x:.1f}%" for x in steals) + "; Mooncake store batches stalled for the 60 s "
              "transfer timeout: " + ", ".join(str(f["stalls"]) for f in faults) + "; failed store transfers: "
              + ", ".join(str(f["failed"]) for f in faults) + "."]
    clean = [r for r, f in zip(runs, faults) if not f["stalls"]]
    if 0 < len(clean) < n:
        lines += ["", f"Against the {len(clean)} run(s) without a store stall:", "",
                  "| metric | live | simulated | error |", "|---|---|---|---|"]
        lines += [f"| {r['metric']} | {r['live']:.4f} | {r['sim']:.4f} | {100 * r['error']:+.1f}% |"
                  for r in fidelity_rows(clean, res)]
    print("\n".join(lines))
    if args.write_results:
        from bench.sidebyside import machine_description, write_results_section

        prof = load_profile(args.profile_path)
        intro = [
            f"Run: `python -m bana_sglang.sim fidelity --model {args.model} --requests {args.requests} "
            f"--rate {args.rate} --repeats {n}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{machine_description()}.", "",
            f"Profile `{prof.name}` (from `python -m bana_sglang.sim calibrate`): effective prefill rate "
            f"{prof.flops_per_s / 1e9:.1f} GFLOP/s, prefill fixed {prof.prefill_fixed_s:.3f} s, decode fixed "
            f"{prof.decode_fixed_s:.4f} s, host contention x{prof.host_contention_prefill:.2f} on prefill and "
            f"x{prof.host_contention_decode:.2f} on decode while the other worker computes. The live 1P1D cluster "
            "and the simulated one (2 workers on one shared host, `bana_no_migration`) get the same requests: "
            "arrivals, prompt and output lengths, block hashes.", ""]
        write_results_section(args.results_key, args.results_title, "\n".join(intro + lines[2:] + [""]))
    if args.json:
        sim_by_id = {r.rid: r for r in sim.records}
        live_by_id = [{r.rid: r for r in live} for live in lives]
        per_request = [{"rid": r.rid, "input": r.prompt_len, "output": r.output_tokens,
                        "cached_live": r.cached_tokens, "ttft_live": r.ttft, "tpot_live": r.tpot,
                        "ttft_live_runs": [lb[r.rid].ttft if r.rid in lb else None for lb in live_by_id],
                        "tpot_live_runs": [lb[r.rid].tpot if r.rid in lb else None for lb in live_by_id],
                        "cached_sim": sim_by_id[r.rid].hbm_hit_tokens + sim_by_id[r.rid].store_hit_tokens,
                        "ttft_sim": sim_by_id[r.rid].ttft, "tpot_sim": sim_by_id[r.rid].tpot,
                        # the first run's stream: send time and (seconds after it, tokens) per chunk
                        "send_live": r.send_s, "chunks_live": [(t - r.send_s, k) for t, k in r.chunks]}
                       for r in lives[0] if r.rid in sim_by_id]
        Path(args.json).write_text(json.dumps({"workload": wl.describe(), "rows": rows, "cpu_steal": steals,
                                               "store_faults": faults,
                                               "profile": str(args.profile_path), "requests": per_request},
                                              indent=2))
    return 0
