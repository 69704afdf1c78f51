"""Workloads for the simulator: the two shipped traces and four generators.

Every workload is a list of ``SimRequest`` sorted by arrival (seconds from 0).
``hashes`` are chained page hashes of ``page_size`` tokens (the Mooncake trace's
``hash_ids`` are exactly that with 512-token blocks); requests without prefix
identity get fresh hashes nobody else shares.

Invariants: loaders and generators are deterministic functions of their
arguments (seeded ``random.Random``); request ids are unique; ``input_len >= 1``
and ``output_len >= 1``; ``len(hashes) == ceil(input_len / page_size)`` when
hashes are given.
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The traces ship with the project, beside the benchmarks (their README names sources and licences).
TRACE_DIR = Path(__file__).resolve().parents[2] / "bench" / "data" / "traces"
MOONCAKE_TRACE = TRACE_DIR / "mooncake_conversation_trace.jsonl"
AZURE_TRACE = TRACE_DIR / "azure_llm_2023_conv.csv"
PAGE = 512


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    arrival: float  # seconds
    input_len: int
    output_len: int
    hashes: tuple[int, ...] = ()


class WorkloadError(ValueError):
    """A trace is missing or a generator got invalid parameters."""


def _fresh_hashes(counter: itertools.count, n_tokens: int) -> tuple[int, ...]:
    # Negative ids never collide with the traces' non-negative hash ids.
    return tuple(-next(counter) - 1 for _ in range(math.ceil(n_tokens / PAGE)))


def mooncake(
    path: Path | str = MOONCAKE_TRACE,
    *,
    time_scale: float = 1.0,
    limit: int | None = None,
    start: int = 0,
) -> list[SimRequest]:
    """The Mooncake conversation trace; ``time_scale`` > 1 replays faster
    (arrival / time_scale). ``start``/``limit`` select a slice of rows."""
    if time_scale <= 0:
        raise WorkloadError(f"time_scale must be positive, got {time_scale}")
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"trace not found: {p} (pass its path with --trace)")
    out: list[SimRequest] = []
    t0 = None
    with p.open() as f:
        for i, line in enumerate(
            itertools.islice(f, start, None if limit is None else start + limit)
        ):
            row = json.loads(line)
            ts = row["timestamp"] / 1000.0
            t0 = ts if t0 is None else t0
            out.append(
                SimRequest(
                    rid=i,
                    arrival=(ts - t0) / time_scale,
                    input_len=max(1, int(row["input_length"])),
                    output_len=max(1, int(row["output_length"])),
                    hashes=tuple(row["hash_ids"]),
                )
            )
    out.sort(key=lambda r: (r.arrival, r.rid))
    return out


def azure(
    path: Path | str = AZURE_TRACE, *, time_scale: float = 1.0, limit: int | None = None
) -> list[SimRequest]:
    """Azure LLM 2023 conversation trace: lengths and arrivals only (no sharing)."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"trace not found: {p} (pass its path with --trace)")
    fresh = itertools.count()
    out: list[SimRequest] = []
    t0 = None
    with p.open() as f:
        for i, row in enumerate(itertools.islice(csv.DictReader(f), limit)):
            stamp = row["TIMESTAMP"].strip()
            head, _, frac = stamp.partition(".")
            ts = dt.datetime.fromisoformat(head).timestamp() + float("0." + (frac or "0"))
            t0 = ts if t0 is None else t0
            n_in = max(1, int(row["ContextTokens"]))
            out.append(
                SimRequest(
                    i,
                    (ts - t0) / time_scale,
                    n_in,
                    max(1, int(row["GeneratedTokens"])),
                    _fresh_hashes(fresh, n_in),
                )
            )
    out.sort(key=lambda r: (r.arrival, r.rid))
    return out


def _poisson_times(rng: random.Random, rate: float, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def long_context(
    n: int = 500,
    *,
    rate: float = 1.0,
    min_len: int = 16_000,
    max_len: int = 120_000,
    output_len: int = 256,
    seed: int = 0,
) -> list[SimRequest]:
    """Prompts near a long context window, short outputs, Poisson arrivals."""
    rng, fresh = random.Random(seed), itertools.count()
    out = []
    for i, t in enumerate(_poisson_times(rng, rate, n)):
        n_in = rng.randint(min_len, max_len)
        out.append(
            SimRequest(
                i, t, n_in, max(1, int(rng.expovariate(1 / output_len))), _fresh_hashes(fresh, n_in)
            )
        )
    return out


def bursty(
    n: int = 2000,
    *,
    on_rate: float = 20.0,
    off_rate: float = 1.0,
    on_s: float = 30.0,
    off_s: float = 60.0,
    mean_in: int = 4000,
    mean_out: int = 300,
    seed: int = 0,
) -> list[SimRequest]:
    """On/off modulated Poisson arrivals (rate ``on_rate`` for ``on_s`` seconds, then
    ``off_rate`` for ``off_s``), exponential lengths."""
    if min(on_rate, off_rate, on_s, off_s) <= 0:
        raise WorkloadError("bursty: rates and durations must be positive")
    rng, fresh = random.Random(seed), itertools.count()
    out: list[SimRequest] = []
    t, period = 0.0, on_s + off_s
    while len(out) < n:
        on = (t % period) < on_s
        t += rng.expovariate(on_rate if on else off_rate)
        n_in = max(1, int(rng.expovariate(1 / mean_in)))
        out.append(
            SimRequest(
                len(out),
                t,
                n_in,
                max(1, int(rng.expovariate(1 / mean_out))),
                _fresh_hashes(fresh, n_in),
            )
        )
    return out


def mixed(n: int = 2000, *, rate: float = 5.0, seed: int = 0) -> list[SimRequest]:
    """Half short prompts with long outputs (chat), half long prompts with short
    outputs (summarisation), interleaved at random."""
    rng, fresh = random.Random(seed), itertools.count()
    out = []
    for i, t in enumerate(_poisson_times(rng, rate, n)):
        if rng.random() < 0.5:
            n_in, n_out = rng.randint(100, 1000), rng.randint(500, 2000)
        else:
            n_in, n_out = rng.randint(8000, 32000), rng.randint(20, 200)
        out.append(SimRequest(i, t, n_in, n_out, _fresh_hashes(fresh, n_in)))
    return out


def shared_prefix(
    n: int = 2000,
    *,
    rate: float = 5.0,
    num_prefixes: int = 4,
    prefix_len: int = 8192,
    suffix_mean: int = 1024,
    mean_out: int = 200,
    zipf_s: float = 1.2,
    seed: int = 0,
) -> list[SimRequest]:
    """Many requests on a few long system prompts (Zipf popularity): the hotspot case."""
    if num_prefixes < 1 or prefix_len % PAGE:
        raise WorkloadError("shared_prefix: need num_prefixes >= 1 and page-aligned prefix_len")
    rng, fresh = random.Random(seed), itertools.count()
    weights = [1 / (k + 1) ** zipf_s for k in range(num_prefixes)]
    pages = prefix_len // PAGE
    prefixes = [
        tuple(10_000_000 + k * pages + j for j in range(pages)) for k in range(num_prefixes)
    ]
    out = []
    for i, t in enumerate(_poisson_times(rng, rate, n)):
        k = rng.choices(range(num_prefixes), weights)[0]
        suffix = max(1, int(rng.expovariate(1 / suffix_mean)))
        out.append(
            SimRequest(
                i,
                t,
                prefix_len + suffix,
                max(1, int(rng.expovariate(1 / mean_out))),
                prefixes[k] + _fresh_hashes(fresh, suffix),
            )
        )
    return out


WORKLOADS = {
    "mooncake": mooncake,
    "azure": azure,
    "long_context": long_context,
    "bursty": bursty,
    "mixed": mixed,
    "shared_prefix": shared_prefix,
}


def get_workload(name: str, **kwargs) -> list[SimRequest]:
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise WorkloadError(
            f"unknown workload {name!r}; valid: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return fn(**kwargs)
