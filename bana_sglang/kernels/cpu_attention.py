"""CPU attention over a paged (slot-indexed) KV cache whose cost follows the new tokens.

SGLang's ``torch_native`` extend path pads every request's queries to the full
KV length and runs a ``kv_len x kv_len`` SDPA, so a prompt that hits the prefix
cache costs almost as much as a cold one. Here the ``q_len`` new queries attend
to the ``kv_len`` keys directly (``q_len x kv_len`` work) with the causal
offset: query ``i`` sits at absolute position ``q_offset + i`` and sees keys
``0 .. q_offset + i``.

Layout (SGLang's): ``q`` ``[tokens, Hq, D]``; the KV pool per layer
``k_cache`` ``[slots, Hkv, D]``, ``v_cache`` ``[slots, Hkv, Dv]``; a request's
KV is the pool rows named by its slot ids, in position order (the slots may be
scattered: page size 1 or any page size, the ids are what counts).

Invariants:
- GQA: query head ``h`` uses KV head ``h // (Hq // Hkv)`` (``repeat_interleave``
  order, as in SGLang and HF). The KV heads are never copied ``Hq/Hkv`` times:
  the ``G = Hq/Hkv`` query heads of a group are folded into the query-length
  axis (``[Hkv, G*q_len, D]``), except for a cold causal prefill, which goes to
  SDPA's own causal kernel with ``enable_gqa`` (as the stock backend does).
- New tokens after a cached prefix never build a ``q_len x kv_len`` mask: the
  queries attend to the prefix unmasked and to the new keys with the square
  causal kernel (KV heads repeated for that part only), and the two states are
  merged exactly by their lse (1.2-2.6x faster than the masked call on CPU).
- The math is ``torch.nn.functional.scaled_dot_product_attention`` (the CPU
  flash kernel) in the dtype of ``q``; KV of another dtype is cast to it.
- ``lse`` (natural log, float32, ``[q_len, Hq]``) is returned only on request;
  together with :mod:`bana_sglang.kernels.merge` it gives exact attention over KV split
  across partitions (KV-block migration).
- :func:`reference_attention` is the dense float64 reference the tests use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Decode runs either as one padded call (every request's keys gathered to the longest
# length, a mask for the shorter ones) or as a loop of one call per request. Their costs
# on this CPU (microseconds per layer; `python -m bench.bench_decode_paths` measures
# them and checks the choice against both paths): the padded call per padded key, the
# loop per key and per request. One padded call wins for many short requests; with
# mixed lengths its gather and mask cost several times the loop (2026-12-01: a batch
# of the trace's first burst, 163-1700 tokens, 44 ms a step padded against 17.5 ms).
PAD_KEY_US = 0.45
LOOP_KEY_US = 0.30
LOOP_REQUEST_US = 35.0


def decode_pads(seq_lens: Sequence[int]) -> bool:
    """Whether :func:`decode_attention` runs these lengths as one padded call."""
    b = len(seq_lens)
    return (
        b > 1 and PAD_KEY_US * b * max(seq_lens) < LOOP_KEY_US * sum(seq_lens) + LOOP_REQUEST_US * b
    )


class AttentionResult(NamedTuple):
    """``output`` [q_len, Hq, Dv] (dtype of q); ``lse`` [q_len, Hq] float32, or None if not asked."""

    output: torch.Tensor
    lse: torch.Tensor | None


def causal_offset_mask(
    q_len: int, kv_len: int, q_offset: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive mask ``[q_len, kv_len]``: 0 where key ``j <= q_offset + i``, else ``-inf``."""
    q_pos = torch.arange(q_offset, q_offset + q_len, device=device).unsqueeze(1)  # [q_len, 1]
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)  # [1, kv_len]
    mask = torch.zeros((q_len, kv_len), dtype=dtype, device=device)
    return mask.masked_fill_(k_pos > q_pos, float("-inf"))


def _fold(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[L, Hq, D] -> [Hkv, G*L, D]: the G query heads of a KV group become extra rows."""
    length, hq, d = q.shape
    g = hq // n_kv
    return q.view(length, n_kv, g, d).permute(1, 2, 0, 3).reshape(n_kv, g * length, d)


def _unfold(x: torch.Tensor, length: int) -> torch.Tensor:
    """[Hkv, G*L, Dv] -> [L, Hq, Dv] (inverse of :func:`_fold`); also [Hkv, G*L] -> [L, Hq]."""
    n_kv = x.shape[0]
    g = x.shape[1] // length
    if x.dim() == 2:
        return x.view(n_kv, g, length).permute(2, 0, 1).reshape(length, n_kv * g)
    return (
        x.view(n_kv, g, length, x.shape[-1])
        .permute(2, 0, 1, 3)
        .reshape(length, n_kv * g, x.shape[-1])
    )


def _sdpa_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA on [B, H, L, D] that also returns the lse [B, H, L] (float32).

    The public SDPA does not expose the lse; the CPU flash kernel it dispatches
    to does (``aten._scaled_dot_product_flash_attention_for_cpu``, torch >= 2.3;
    its mask must have the query's dtype).
    """
    if mask is not None:
        mask = mask.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )[:2]
    return out, lse.float()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_offset: int | None,
    need_lse: bool = False,
) -> AttentionResult:
    """Attention of one sequence's queries over its gathered KV.

    Args:
        q: [q_len, Hq, D]; k: [kv_len, Hkv, D]; v: [kv_len, Hkv, Dv].
        q_offset: absolute position of ``q[0]`` (causal: query ``i`` sees keys
            ``<= q_offset + i``); ``None``: every query sees every key.
        need_lse: also return the lse (slower path; for partial attention).
    """
    q_len, hq, _ = q.shape
    kv_len, hkv, dv = v.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    if kv_len == 0:  # an empty partition: contributes nothing (see bana_sglang.kernels.merge)
        lse = torch.full((q_len, hq), float("-inf")) if need_lse else None
        return AttentionResult(q.new_zeros((q_len, hq, dv)), lse)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    # Does any query miss a key? Only then is a mask needed.
    # Query 0 sees keys 0..q_offset, so a mask is needed iff that misses some key.
    masked = q_offset is not None and q_offset < kv_len - 1
    kt = k.permute(1, 0, 2)  # [Hkv, kv_len, D] (a view)
    vt = v.permute(1, 0, 2)
    if masked and q_offset == 0 and q_len == kv_len and not need_lse:
        # Cold causal prefill: SDPA's causal kernel (top-left aligned = correct here).
        out = F.scaled_dot_product_attention(
            q.permute(1, 0, 2).unsqueeze(0),
            kt.unsqueeze(0),
            vt.unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=hq != hkv,
        )  # [1, Hq, q_len, Dv]
        return AttentionResult(out[0].permute(1, 0, 2), None)
    g = hq // hkv
    if masked and 0 < q_offset and q_offset + q_len == kv_len:
        return _extend_over_prefix(q, kt, vt, q_offset, scale, need_lse)
    qf = _fold(q, hkv).unsqueeze(0)  # [1, Hkv, G*q_len, D]
    mask = None
    if masked:
        assert q_offset is not None
        mask = causal_offset_mask(q_len, kv_len, q_offset, q.dtype, q.device).repeat(
            g, 1
        )  # [G*q_len, kv]
    if need_lse:
        out, lse = _sdpa_with_lse(qf, kt.unsqueeze(0), vt.unsqueeze(0), mask, scale)
        return AttentionResult(_unfold(out[0], q_len), _unfold(lse[0], q_len))
    out = F.scaled_dot_product_attention(
        qf, kt.unsqueeze(0), vt.unsqueeze(0), attn_mask=mask, scale=scale
    )
    return AttentionResult(_unfold(out[0], q_len), None)


def _extend_over_prefix(
    q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, prefix: int, scale: float, need_lse: bool
) -> AttentionResult:
    """New tokens after a cached prefix, without a ``q_len x kv_len`` mask: every
    query sees the whole prefix (one unmasked call) and the new keys causally
    (the square, top-left aligned causal kernel); the two states merge exactly
    by their lse. ``kt``/``vt``: [Hkv, kv_len, D] with ``kv_len = prefix + q_len``."""
    q_len, hq, _ = q.shape
    hkv = kt.shape[0]
    g = hq // hkv
    qf = _fold(q, hkv).unsqueeze(0)  # [1, Hkv, G*q_len, D]
    o_p, lse_p = _sdpa_with_lse(
        qf, kt[:, :prefix].unsqueeze(0), vt[:, :prefix].unsqueeze(0), None, scale
    )
    o_p, lse_p = _unfold(o_p[0], q_len), _unfold(lse_p[0], q_len)  # [L, Hq, Dv], [L, Hq]
    k_new, v_new = kt[:, prefix:], vt[:, prefix:]
    if g > 1:  # the causal kernel wants one KV head per query head
        k_new, v_new = k_new.repeat_interleave(g, dim=0), v_new.repeat_interleave(g, dim=0)
    o_n, lse_n = _sdpa_with_lse(
        q.permute(1, 0, 2).unsqueeze(0),
        k_new.unsqueeze(0),
        v_new.unsqueeze(0),
        None,
        scale,
        causal=True,
    )
    o_n, lse_n = o_n[0].permute(1, 0, 2), lse_n[0].transpose(0, 1)  # [L, Hq, Dv], [L, Hq]
    # both partitions are non-empty: finite lse on each side
    m = torch.maximum(lse_p, lse_n)
    w_p, w_n = torch.exp(lse_p - m), torch.exp(lse_n - m)
    total = w_p + w_n
    out = o_p * (w_p / total).unsqueeze(-1).to(o_p.dtype) + o_n * (w_n / total).unsqueeze(-1).to(
        o_n.dtype
    )
    return AttentionResult(out, m + torch.log(total) if need_lse else None)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: Sequence[torch.Tensor],
    extend_lens: Sequence[int],
    *,
    scale: float,
    out: torch.Tensor | None = None,
    need_lse: bool = False,
) -> AttentionResult:
    """Causal extend attention for a batch of requests over a paged KV pool.

    Args:
        q: [sum(extend_lens), Hq, D], the new tokens of each request, concatenated.
        k_cache / v_cache: [slots, Hkv, D] / [slots, Hkv, Dv], already holding the new tokens' KV.
        kv_indices: per request, the slot ids [prefix_len + extend_len] of its whole KV in
            position order (the last ``extend_len`` are the new tokens).
        extend_lens: new tokens per request (may be 0: nothing to do for it).
        out: optional [sum(extend_lens), Hq, Dv] buffer to write into.
    """
    if len(kv_indices) != len(extend_lens):
        raise ValueError(f"{len(kv_indices)} kv index lists for {len(extend_lens)} requests")
    n_tokens, hq, _ = q.shape
    dv = v_cache.shape[-1]
    if out is None:
        out = q.new_empty((n_tokens, hq, dv))
    lse = torch.empty((n_tokens, hq), dtype=torch.float32) if need_lse else None
    start = 0
    for slots, ext in zip(kv_indices, extend_lens):
        if ext == 0:
            continue
        kv_len = slots.shape[0]
        if ext > kv_len:
            raise ValueError(f"extend_len {ext} > kv_len {kv_len}")
        res = attend(
            q[start : start + ext],
            k_cache[slots],
            v_cache[slots],
            scale=scale,
            q_offset=kv_len - ext,
            need_lse=need_lse,
        )
        out[start : start + ext] = res.output
        if lse is not None:
            lse[start : start + ext] = res.lse
        start += ext
    if start != n_tokens:
        raise ValueError(f"extend_lens sum to {start}, but q has {n_tokens} tokens")
    return AttentionResult(out, lse)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_table: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    scale: float,
    out: torch.Tensor | None = None,
    need_lse: bool = False,
) -> AttentionResult:
    """One new token per request, attending to its whole KV (itself included).

    Args:
        q: [B, Hq, D].
        kv_table: [B, >= max(seq_lens)] slot ids per request in position order; entries at
            or beyond a request's length must be valid slot ids (e.g. 0) and are masked out.
        seq_lens: KV length per request (>= 1).
    """
    bsz, hq, _ = q.shape
    hkv, dv = v_cache.shape[-2], v_cache.shape[-1]
    if out is None:
        out = q.new_empty((bsz, hq, dv))
    if bsz == 0:
        return AttentionResult(out, torch.empty((0, hq)) if need_lse else None)
    max_len = max(seq_lens)
    if need_lse or not decode_pads(seq_lens):
        lse = torch.empty((bsz, hq), dtype=torch.float32) if need_lse else None
        for b, n in enumerate(seq_lens):
            slots = kv_table[b, :n]
            res = attend(
                q[b : b + 1],
                k_cache[slots],
                v_cache[slots],
                scale=scale,
                q_offset=None,
                need_lse=need_lse,
            )
            out[b] = res.output[0]
            if lse is not None:
                lse[b] = res.lse[0]
        return AttentionResult(out, lse)
    # One padded call: [B, Hkv, max_len, D] keys, the G heads of a group as G query rows.
    slots = kv_table[:, :max_len]
    k = k_cache[slots].permute(0, 2, 1, 3)  # [B, Hkv, max_len, D]
    v = v_cache[slots].permute(0, 2, 1, 3)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    qf = q.view(bsz, hkv, hq // hkv, q.shape[-1])  # [B, Hkv, G, D]
    mask = None
    lens = torch.tensor(list(seq_lens))
    if min(seq_lens) != max_len:
        pad = torch.arange(max_len).unsqueeze(0) >= lens.unsqueeze(1)  # [B, max_len]
        mask = torch.zeros((bsz, 1, 1, max_len), dtype=q.dtype).masked_fill_(
            pad.view(bsz, 1, 1, max_len), float("-inf")
        )
    res = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G, Dv]
    out.copy_(res.reshape(bsz, hq, dv))
    return AttentionResult(out, None)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, q_offset: int | None
) -> AttentionResult:
    """Dense float64 reference of :func:`attend` (output in float64, lse float64)."""
    q_len, hq, _ = q.shape
    kv_len, hkv, _ = k.shape
    g = hq // hkv
    k64 = k.double().repeat_interleave(g, dim=1)  # [kv_len, Hq, D]
    v64 = v.double().repeat_interleave(g, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale  # [Hq, q_len, kv_len]
    if q_offset is not None:
        logits = logits + causal_offset_mask(q_len, kv_len, q_offset, torch.float64)
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, q_len]
    probs = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v64)
    return AttentionResult(out, lse.transpose(0, 1))
