"""Calibration of the simulator's CPU profile on the live system.

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

The fits themselves are pure and live in :mod:`bench.fit`; the live harness
(cluster, client, warm-up, CPU steal, store faults) in :mod:`bench.live`, shared
with :mod:`bench.fidelity`, which replays a trace slice live and simulated with
the profile this writes.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bana_sglang.sim.profiles import PROFILE_DIR, load_profile, save_profile
from bench.fit import calibrate
from bench.live import (
    cpu_steal_ticks,
    fresh_batch,
    fresh_prompt,
    live_client,
    replay,
    start_cluster,
    steal_share,
    store_faults,
    warm_up,
)
from bench.workloads import Request

logger = logging.getLogger("bench.calibrate")

PREFILL_LENGTHS = (128, 512, 1024, 2048, 3072, 4096)
CHUNKED_LENGTHS = (6144, 8192)  # longer than a chunk: the later chunks attend over a cached prefix
# Decode batches (prompt lengths of requests decoding together): short prompts at
# batch 1, 4 and 8, then a large KV. The lengths are mixed, as in the trace's bursts, so
# that the CPU kernel takes the same path on both (bana_sglang.kernels.cpu_attention.decode_pads
# chooses a padded call or one call per request by measured cost).
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


def decode_gaps_during(decoding: list, t0: float, t1: float) -> list[float]:
    """Gaps between consecutive streamed chunks of ``decoding`` records that lie
    within ``[t0, t1]`` (client clock)."""
    gaps = []
    for r in decoding:
        ts = [t for t, _ in r.chunks]
        gaps += [b - a for a, b in zip(ts, ts[1:]) if a >= t0 and b <= t1]
    return gaps


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
                cfg, [Request(rid=seed, arrival_s=0.0, prompt=fresh_prompt(seed, n), max_tokens=2)]
            )
            prefill.append((n, rec.ttft))
            logger.info("prefill %5d tokens: TTFT %.3fs", n, rec.ttft)
    for n in CHUNKED_LENGTHS:
        seed += 1
        (rec,) = replay(
            cfg, [Request(rid=seed, arrival_s=0.0, prompt=fresh_prompt(seed, n), max_tokens=2)]
        )
        prefill.append((n, rec.ttft))
        logger.info("prefill %5d tokens (chunked): TTFT %.3fs", n, rec.ttft)
    decode = []
    for lens in DECODE_POINTS:
        seed += 1
        bsz = len(lens)
        recs = replay(cfg, fresh_batch(lens, seed * 100, 33))
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

    recs = replay(cfg, fresh_batch(CONTENTION_DECODE, seed, 33, stride=10))
    decode = statistics.fmean(steady_and_handoff(r)[0] for r in recs)
    (rec,) = replay(
        cfg,
        [
            Request(
                rid=99,
                arrival_s=0.0,
                prompt=fresh_prompt(seed + 5, CONTENTION_PROMPT),
                max_tokens=2,
            )
        ],
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
            rid=99,
            arrival_s=started,
            prompt=fresh_prompt(seed + 6, CONTENTION_PROMPT),
            max_tokens=2,
        )
        recs = replay(cfg, fresh_batch(CONTENTION_DECODE, seed + 7, 160, stride=10) + [big])
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
    probe = replay(cfg, fresh_batch(CONTENTION_DECODE, seed, 4, stride=10))
    started = max(r.ttft for r in probe) + 0.5
    points = []
    for n in JOIN_PROMPTS:
        for _ in range(repeats):
            seed += 10
            new = Request(rid=99, arrival_s=started, prompt=fresh_prompt(seed + 5, n), max_tokens=8)
            recs = replay(cfg, fresh_batch(CONTENTION_DECODE, seed, 160, stride=10) + [new])
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
    probe = replay(cfg, fresh_batch(CONTENTION_DECODE, seed, 4, stride=10))
    started = max(r.ttft for r in probe) + 0.5
    idle, busy = [], []
    for _ in range(repeats):
        pair = []
        for during in (False, True):
            seed += 10
            new = Request(
                rid=99,
                arrival_s=started,
                prompt=fresh_prompt(seed + 5, JOIN_BUSY_PROMPT),
                max_tokens=8,
            )
            big = (
                [
                    Request(
                        rid=98,
                        arrival_s=started + JOIN_BUSY_DELAY_S,
                        prompt=fresh_prompt(seed + 6, JOIN_BUSY_PREFILL),
                        max_tokens=2,
                    )
                ]
                if during
                else []
            )
            # the batch must outlast the long prefill to be there at the join
            recs = replay(
                cfg,
                fresh_batch(CONTENTION_DECODE, seed, 320 if during else 160, stride=10)
                + [new]
                + big,
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
