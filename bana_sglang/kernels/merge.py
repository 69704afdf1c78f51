"""Exact merge of attention states computed over disjoint KV partitions.

Attention over a KV set ``K = K_1 ∪ K_2`` can be computed piecewise: each
partition ``i`` yields a normalised partial output ``o_i`` and the log-sum-exp
``lse_i`` of its (scaled, masked) logits. The exact result is

    lse = log(exp(lse_1) + exp(lse_2))
    o   = exp(lse_1 - lse) * o_1 + exp(lse_2 - lse) * o_2

KV-block migration uses this to combine the attention computed on the worker
that holds the migrated blocks with the local part. :func:`merge_attention_states`
is the torch reference (CPU and CUDA alike); :func:`merge_two` on CUDA
tensors (float32/float16/bfloat16) runs one Triton kernel instead, one
program per (token, head) row, when Triton is installed (``BANA_MERGE_TRITON=0``
turns it off); everywhere else it is the reference.

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

import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bana_sglang import envs

logger = logging.getLogger(__name__)


class MergedState(NamedTuple):
    """A merged attention state: ``output`` [T, H, D] and ``lse`` [T, H] (float32/64)."""

    output: torch.Tensor
    lse: torch.Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_attention_states(
    outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> MergedState:
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
            raise ValueError(
                f"shape mismatch: output {tuple(o.shape)} / lse {tuple(s.shape)}, "
                f"expected {tuple(shape)} / {tuple(shape[:-1])}"
            )
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
    lse = torch.where(
        nonempty, finite_max + torch.log(total), torch.full_like(total, float("-inf"))
    )
    return MergedState(merged.to(outputs[0].dtype), lse)


def merge_two(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> MergedState:
    """:func:`merge_attention_states` of two partitions; the Triton kernel on CUDA."""
    if (
        o_a.is_cuda
        and o_a.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and _triton_kernel() is not None
    ):
        return merge_two_triton(o_a, lse_a, o_b, lse_b)
    return merge_attention_states((o_a, o_b), (lse_a, lse_b))


@functools.cache
def _triton_kernel():
    """The compiled-on-first-use Triton kernel, or None (no Triton, or turned off)."""
    if not envs.BANA_MERGE_TRITON.get():
        return None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def merge_two_rows(
        o_a, lse_a, o_b, lse_b, out, lse_out, D: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)  # one (token, head): D values and one lse per input
        sa = tl.load(lse_a + row).to(tl.float32)
        sb = tl.load(lse_b + row).to(tl.float32)
        m = tl.maximum(sa, sb)
        m = tl.where(m == float("-inf"), 0.0, m)  # both empty: exp(-inf - 0) = 0, not exp(nan)
        wa = tl.exp(sa - m)
        wb = tl.exp(sb - m)
        total = wa + wb
        cols = tl.arange(0, BLOCK_D)
        inside = cols < D
        a = tl.load(o_a + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(o_b + row * D + cols, mask=inside, other=0.0).to(tl.float32)
        # an empty partition's output is never read (it may be NaN): select, don't multiply
        acc = tl.where(wa > 0, a * wa, 0.0) + tl.where(wb > 0, b * wb, 0.0)
        o = acc / tl.where(total > 0, total, 1.0)
        tl.store(out + row * D + cols, o.to(out.dtype.element_ty), mask=inside)
        tl.store(lse_out + row, tl.where(total > 0, m + tl.log(total), float("-inf")))

    return merge_two_rows


def merge_two_triton(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> MergedState:
    """The Triton kernel behind :func:`merge_two` (CUDA tensors; same contract, lse float32)."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("Triton is not available (or BANA_MERGE_TRITON=0)")
    for o, s in ((o_a, lse_a), (o_b, lse_b)):
        if o.shape != o_a.shape or s.shape != o_a.shape[:-1] or o.dim() != 3:
            raise ValueError(
                f"shape mismatch: output {tuple(o.shape)} / lse {tuple(s.shape)}, expected "
                f"[T, H, D] {tuple(o_a.shape)} / {tuple(o_a.shape[:-1])}"
            )
        if not (o.is_cuda and s.is_cuda) or o.device != o_a.device or s.device != o_a.device:
            raise ValueError("merge_two_triton needs every tensor on the same CUDA device")
    t, h, d = o_a.shape
    out = torch.empty_like(o_a, memory_format=torch.contiguous_format)
    lse = torch.empty((t, h), dtype=torch.float32, device=o_a.device)
    if t * h:
        import triton

        kernel[(t * h,)](
            o_a.contiguous(),
            lse_a.contiguous(),
            o_b.to(o_a.dtype).contiguous(),
            lse_b.contiguous(),
            out,
            lse,
            D=d,
            BLOCK_D=triton.next_power_of_2(d),
        )
    return MergedState(out, lse)
