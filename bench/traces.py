"""The two trace readers: the Mooncake conversation trace (prefix structure kept,
one token block per hash id) and the Azure LLM 2023 conversation trace (arrivals
and lengths only). Both read the copies shipped in ``bench/data/traces`` unless
given another path (``--trace``).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path

from bench.workload_types import (
    MOONCAKE_BLOCK,
    Request,
    TokenSpace,
    Workload,
    WorkloadError,
    WorkloadSpec,
    assemble,
    block_tokens,
    clip_to_context,
)

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "bench" / "data" / "traces"  # shipped with the project (README there)
MOONCAKE_TRACE = TRACES / "mooncake_conversation_trace.jsonl"
AZURE_TRACE = TRACES / "azure_llm_2023_conv.csv"


def mooncake_trace(spec: WorkloadSpec, space: TokenSpace, path: Path = MOONCAKE_TRACE) -> Workload:
    """Mooncake conversation trace rows ``[trace_offset, +num_requests)``.

    Arrivals: trace timestamps (ms) times ``time_scale``; with ``request_rate``
    the time scale is chosen so that the slice's mean rate equals it.
    Prompts: one block of ``round(512 * length_scale)`` tokens per hash id,
    cut to ``round(input_length * length_scale)`` tokens.
    """
    if not path.exists():
        raise WorkloadError(f"trace not found: {path} (pass its path with --trace)")
    rows: list[dict] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i < spec.trace_offset:
                continue
            if len(rows) >= spec.num_requests:
                break
            rows.append(json.loads(line))
    if not rows:
        raise WorkloadError(f"no rows at offset {spec.trace_offset} in {path}")
    block = max(1, round(MOONCAKE_BLOCK * spec.length_scale))
    t0 = rows[0]["timestamp"]
    span = (rows[-1]["timestamp"] - t0) / 1000.0
    time_scale = spec.time_scale
    if spec.request_rate is not None and span > 0:
        time_scale = (len(rows) - 1) / spec.request_rate / span
    reqs, clipped = [], 0
    for i, row in enumerate(rows):
        hashes = tuple(int(h) for h in row["hash_ids"])
        n_in = max(1, min(round(row["input_length"] * spec.length_scale), block * len(hashes)))
        prompt: list[int] = []
        for h in hashes:
            if len(prompt) >= n_in:
                break
            prompt.extend(block_tokens(spec.seed, ("mc", h), block, space))
        prompt = prompt[:n_in]
        out = max(1, round(row["output_length"] * spec.out_scale))
        prompt, out, c = clip_to_context(prompt, out, space, spec.clip)
        clipped += c
        reqs.append(
            Request(
                rid=i,
                arrival_s=(row["timestamp"] - t0) / 1000.0 * time_scale,
                prompt=tuple(prompt),
                max_tokens=out,
                group=f"h{hashes[0]}" if hashes else "",
                prefix_ids=hashes,
            )
        )
    params = dict(
        trace=path.name,
        offset=spec.trace_offset,
        n=len(rows),
        time_scale=round(time_scale, 4),
        length_scale=spec.length_scale,
        output_scale=spec.out_scale,
        block_tokens=block,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return assemble("mooncake", reqs, params, clipped)


def _azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than fromisoformat takes on 3.11
    head, _, frac = text.strip().partition(".")
    base = dt.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def azure_trace(spec: WorkloadSpec, space: TokenSpace, path: Path = AZURE_TRACE) -> Workload:
    """Azure LLM 2023 conversation trace: real bursty arrivals and lengths;
    prompts are unique random blocks (the trace has no prefix identity)."""
    if not path.exists():
        raise WorkloadError(f"trace not found: {path} (pass its path with --trace)")
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        for i, rec in enumerate(csv.DictReader(f)):
            if i < spec.trace_offset:
                continue
            if len(rows) >= spec.num_requests:
                break
            rows.append(
                (
                    _azure_time(rec["TIMESTAMP"]),
                    int(rec["ContextTokens"]),
                    int(rec["GeneratedTokens"]),
                )
            )
    if not rows:
        raise WorkloadError(f"no rows at offset {spec.trace_offset} in {path}")
    t0, span = rows[0][0], rows[-1][0] - rows[0][0]
    time_scale = spec.time_scale
    if spec.request_rate is not None and span > 0:
        time_scale = (len(rows) - 1) / spec.request_rate / span
    reqs, clipped = [], 0
    for i, (ts, n_in, n_out) in enumerate(rows):
        prompt = list(
            block_tokens(
                spec.seed,
                ("az", spec.trace_offset + i),
                max(1, round(n_in * spec.length_scale)),
                space,
            )
        )
        out = max(1, round(n_out * spec.out_scale))
        prompt, out, c = clip_to_context(prompt, out, space, spec.clip)
        clipped += c
        reqs.append(
            Request(
                rid=i,
                arrival_s=(ts - t0) * time_scale,
                prompt=tuple(prompt),
                max_tokens=out,
                group="azure",
            )
        )
    params = dict(
        trace=path.name,
        offset=spec.trace_offset,
        n=len(rows),
        time_scale=round(time_scale, 4),
        length_scale=spec.length_scale,
        output_scale=spec.out_scale,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return assemble("azure", reqs, params, clipped)
