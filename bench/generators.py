"""The generated workloads: shared-prefix, long-context, bursty and mixed. Each
is a deterministic function of its :class:`~bench.workload_types.WorkloadSpec`
(seeded generators; prompts from :func:`~bench.workload_types.block_tokens`).
"""

from __future__ import annotations

import random

from bench.workload_types import (
    CONTEXT_MARGIN,
    Request,
    TokenSpace,
    Workload,
    WorkloadSpec,
    assemble,
    block_tokens,
    clip_to_context,
    poisson_arrivals,
)


def _rate(spec: WorkloadSpec) -> float:
    return spec.request_rate if spec.request_rate is not None else 1.0


def shared_prefix(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """A few long system prompts (``num_groups`` x ``system_len`` tokens) shared
    by many requests, each adding a unique question of ``input_len`` tokens:
    the hotspot case. Groups uniform, or Zipf(``zipf_alpha``) when > 0."""
    rng = random.Random(f"shared-prefix:{spec.seed}")
    systems = [
        block_tokens(spec.seed, ("sys", g), spec.system_len, space) for g in range(spec.num_groups)
    ]
    weights = [1.0 / (g + 1) ** spec.zipf_alpha for g in range(spec.num_groups)]
    arrivals = poisson_arrivals(spec.num_requests, _rate(spec), rng)
    reqs, clipped = [], 0
    for i, t in enumerate(arrivals):
        g = (
            (i % spec.num_groups)
            if spec.zipf_alpha == 0
            else rng.choices(range(spec.num_groups), weights)[0]
        )
        prompt = list(systems[g]) + list(block_tokens(spec.seed, ("q", i), spec.input_len, space))
        prompt, out, c = clip_to_context(prompt, spec.output_len, space, spec.clip)
        clipped += c
        reqs.append(
            Request(
                rid=i,
                arrival_s=t,
                prompt=tuple(prompt),
                max_tokens=out,
                group=f"sys{g}",
                prefix_ids=(g,),
            )
        )
    params = dict(
        rate=_rate(spec),
        groups=spec.num_groups,
        system_len=spec.system_len,
        question_len=spec.input_len,
        output_len=spec.output_len,
        zipf_alpha=spec.zipf_alpha,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return assemble("shared-prefix", reqs, params, clipped)


def long_context(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """Unique prompts of 70-95% of the context, short outputs, Poisson arrivals."""
    rng = random.Random(f"long-context:{spec.seed}")
    arrivals = poisson_arrivals(spec.num_requests, _rate(spec), rng)
    reqs = []
    for i, t in enumerate(arrivals):
        out = spec.output_len
        n_in = int(rng.uniform(0.70, 0.95) * (space.context_len - CONTEXT_MARGIN - out))
        reqs.append(
            Request(
                rid=i,
                arrival_s=t,
                prompt=block_tokens(spec.seed, ("lc", i), n_in, space),
                max_tokens=out,
                group="long",
            )
        )
    params = dict(
        rate=_rate(spec),
        input="70-95% of context",
        output_len=spec.output_len,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return assemble("long-context", reqs, params, 0)


def bursty(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """On/off Poisson: during ``burst_on_s`` seconds requests arrive at a rate
    chosen so that the long-run mean is ``request_rate``, then ``burst_off_s``
    seconds of silence. Prompt lengths uniform in [input_len/2, 3*input_len/2]."""
    rng = random.Random(f"bursty:{spec.seed}")
    mean = _rate(spec)
    on_rate = mean * (spec.burst_on_s + spec.burst_off_s) / spec.burst_on_s
    arrivals: list[float] = []
    t = 0.0
    while len(arrivals) < spec.num_requests:
        cycle = spec.burst_on_s + spec.burst_off_s
        phase = t % cycle
        if phase >= spec.burst_on_s:  # silence: jump to the next burst
            t += cycle - phase
        arrivals.append(t)
        t += rng.expovariate(on_rate)
    reqs, clipped = [], 0
    for i, at in enumerate(arrivals):
        n_in = rng.randint(max(1, spec.input_len // 2), max(1, 3 * spec.input_len // 2))
        prompt, out, c = clip_to_context(
            list(block_tokens(spec.seed, ("b", i), n_in, space)), spec.output_len, space, spec.clip
        )
        clipped += c
        reqs.append(
            Request(rid=i, arrival_s=at, prompt=tuple(prompt), max_tokens=out, group="burst")
        )
    params = dict(
        mean_rate=mean,
        on_rate=round(on_rate, 3),
        on_s=spec.burst_on_s,
        off_s=spec.burst_off_s,
        input_len=spec.input_len,
        output_len=spec.output_len,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return assemble("bursty", reqs, params, clipped)


def mixed(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """Half short-prompt/long-output (input_len/8 in, output_len*4 out), half
    long-prompt/short-output (input_len*4 in, output_len/4 out), interleaved
    at random, Poisson arrivals."""
    rng = random.Random(f"mixed:{spec.seed}")
    arrivals = poisson_arrivals(spec.num_requests, _rate(spec), rng)
    reqs, clipped = [], 0
    for i, t in enumerate(arrivals):
        if rng.random() < 0.5:
            kind, n_in, out = "short-in/long-out", max(1, spec.input_len // 8), spec.output_len * 4
        else:
            kind, n_in, out = "long-in/short-out", spec.input_len * 4, max(1, spec.output_len // 4)
        prompt, out, c = clip_to_context(
            list(block_tokens(spec.seed, ("m", i), n_in, space)), out, space, spec.clip
        )
        clipped += c
        reqs.append(Request(rid=i, arrival_s=t, prompt=tuple(prompt), max_tokens=out, group=kind))
    params = dict(
        rate=_rate(spec),
        short=(max(1, spec.input_len // 8), spec.output_len * 4),
        long=(spec.input_len * 4, max(1, spec.output_len // 4)),
        seed=spec.seed,
        context_len=space.context_len,
    )
    return assemble("mixed", reqs, params, clipped)
