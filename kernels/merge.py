"""Exact merge of attention states computed over disjoint KV partitions.

Attention over a KV set ``K = K_1 ∪ K_2`` can be computed piecewise: each
partition ``i`` yields a normalised partial output ``o_i`` and the log-sum-exp
``lse_i`` of its (scaled, masked) logits. The exact result is

    lse = log(exp(lse_1) + exp(lse_2))
    o   = exp(lse_1 - lse) * o_1 + exp(lse_2 - lse) * o_2

KV-block migration uses this to combine the attention computed on the worker
that holds the migrated blocks with the local part. This module is the torch
reference (it runs on CPU and CUDA alike).

Invariants:
- ``lse`` is the natural log, per query token and head: shape ``[T, H]`` for
  outputs of shape ``[T, H, D]``.
- An empty partition (no visible key: ``lse = -inf``) contributes nothing; its
  ``o`` may hold anything (even NaN) and is never read. If every partition is
  empty the merged output is 0 and the merged lse is ``-inf``.
- Extreme logits (|lse| up to the float32 range) do not overflow: weights are
  formed relative to the maximum lse, so they lie in ``[0, 1]``.
- The weights are computed in float32 (float64 for float64 inputs); the output
  has the dtype of ``outputs[0]``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class MergedState(NamedTuple):
    """A merged attention state: ``output`` [T, H, D] and ``lse`` [T, H] (float32/64)."""

    output: torch.Tensor
    lse: torch.Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_attention_states(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> MergedState:
    """Merge partial attention states over disjoint KV partitions (see module doc).

    Args:
        outputs: ``n >= 1`` tensors ``[T, H, D]``, each normalised over its own partition.
        lses: ``n`` tensors ``[T, H]``, natural-log sum of exp of that partition's logits;
            ``-inf`` where the partition had no visible key.
    """
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"need as many outputs as lses (>= 1), got {len(outputs)} and {len(lses)}")
    shape = outputs[0].shape
    for o, s in zip(outputs, lses):
        if o.shape != shape or s.shape != shape[:-1]:
            raise ValueError(f"shape mismatch: output {tuple(o.shape)} / lse {tuple(s.shape)}, "
                             f"expected {tuple(shape)} / {tuple(shape[:-1])}")
    acc = _acc_dtype(outputs[0].dtype)
    lse_stack = torch.stack([s.to(acc) for s in lses])  # [n, T, H]
    lse_max = lse_stack.amax(dim=0)  # [T, H]; -inf where all partitions are empty
    # Shift by the max so the weights are in [0, 1]; where all are empty, shift by 0
    # so that exp(-inf - 0) = 0 rather than exp(nan).
    finite_max = torch.where(torch.isfinite(lse_max), lse_max, torch.zeros_like(lse_max))
    weights = torch.exp(lse_stack - finite_max)  # [n, T, H]; 0 for empty partitions
    total = weights.sum(dim=0)  # [T, H]; >= 1 unless all empty (then 0)
    merged = torch.zeros(shape, dtype=acc, device=outputs[0].device)
    for o, w in zip(outputs, weights):
        # An empty partition's output is never read (it may be NaN): mask, don't multiply.
        contrib = o.to(acc) * w.unsqueeze(-1)
        merged += torch.where(w.unsqueeze(-1) > 0, contrib, torch.zeros_like(contrib))
    nonempty = total > 0
    merged = merged / torch.where(nonempty, total, torch.ones_like(total)).unsqueeze(-1)
    lse = torch.where(nonempty, finite_max + torch.log(total), torch.full_like(total, float("-inf")))
    return MergedState(merged.to(outputs[0].dtype), lse)


def merge_two(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> MergedState:
    """Shorthand for :func:`merge_attention_states` of two partitions."""
    return merge_attention_states((o_a, o_b), (lse_a, lse_b))
