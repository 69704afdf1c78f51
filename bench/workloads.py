"""Workloads: real traces and generated cases, all as lists of token-id requests.

Every source yields a :class:`Workload`: a tuple of :class:`Request` sorted by
arrival time (seconds from the start of the run), each with its prompt as
token ids and an output length that the client enforces (``max_tokens`` with
``ignore_eos``).

Invariants:

- prompts are built as token ids, so a shared prefix is an exact shared
  prefix of ids (and, being stable words, of the text sent);
- in trace replay, equal ``hash_ids`` give identical token blocks and
  different ones give different blocks (each block is drawn from a generator
  seeded by ``(seed, hash_id)`` only), so the trace's prefix structure is
  preserved exactly; the block size is the trace's 512 tokens times the
  length scale;
- prompt ids are "stable words" (see :class:`TokenSpace`): never special
  tokens, and any sequence of them survives a decode/encode round trip, so
  prompts can travel as text through routers that take no token ids;
- ``prompt_len + max_tokens <= context_len - CONTEXT_MARGIN``: a longer request is clipped
  (prompt first, keeping its prefix) unless ``clip=False``, and the number
  clipped is stated in :attr:`Workload.notes`.

Sources are registered in :data:`WORKLOADS` (the trace readers of
:mod:`bench.traces`, the generators of :mod:`bench.generators`; the types they
build with are in :mod:`bench.workload_types` and importable from here); an
unknown name raises :class:`WorkloadError` listing the valid ones.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from bench.generators import bursty, long_context, mixed, shared_prefix
from bench.traces import AZURE_TRACE, MOONCAKE_TRACE, TRACES, azure_trace, mooncake_trace
from bench.workload_types import (
    CONTEXT_MARGIN,
    MOONCAKE_BLOCK,
    Request,
    TokenSpace,
    Workload,
    WorkloadError,
    WorkloadSpec,
    block_tokens,
    poisson_arrivals,
)

__all__ = [
    "AZURE_TRACE",
    "CONTEXT_MARGIN",
    "MOONCAKE_BLOCK",
    "MOONCAKE_TRACE",
    "TRACES",
    "WORKLOADS",
    "Request",
    "TokenSpace",
    "Workload",
    "WorkloadError",
    "WorkloadSpec",
    "azure_trace",
    "block_tokens",
    "build",
    "bursty",
    "long_context",
    "mixed",
    "mooncake_trace",
    "poisson_arrivals",
    "register",
    "save_jsonl",
    "shared_prefix",
]

logger = logging.getLogger(__name__)

Builder = Callable[[WorkloadSpec, TokenSpace], Workload]
WORKLOADS: dict[str, Builder] = {
    "mooncake": mooncake_trace,
    "azure": azure_trace,
    "shared-prefix": shared_prefix,
    "long-context": long_context,
    "bursty": bursty,
    "mixed": mixed,
}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: add a source to :data:`WORKLOADS` under ``name``."""

    def deco(fn: Builder) -> Builder:
        WORKLOADS[name] = fn
        return fn

    return deco


def build(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    try:
        builder = WORKLOADS[spec.name]
    except KeyError:
        raise WorkloadError(
            f"unknown workload {spec.name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    if spec.trace is not None and spec.name in ("mooncake", "azure"):
        wl = builder(spec, space, Path(spec.trace))
    else:
        wl = builder(spec, space)
    logger.info("workload %s", wl.describe())
    return wl


def save_jsonl(wl: Workload, path: Path) -> None:
    """Write the workload (one request per line) so another tool can replay it."""
    with path.open("w") as f:
        for r in wl.requests:
            f.write(
                json.dumps(
                    dict(
                        rid=r.rid,
                        arrival_s=r.arrival_s,
                        prompt=list(r.prompt),
                        max_tokens=r.max_tokens,
                        group=r.group,
                    )
                )
                + "\n"
            )
