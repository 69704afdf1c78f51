"""Decode attention over a page list, with its log-sum-exp: the GPU half of KV-block migration.

While KV pages of a running request live on a peer, its decode step attends to
the positions kept locally and the peer attends to the pages it holds; the two
partial states merge exactly (:mod:`bana_sglang.kernels.merge`). On a GPU that
is what SGLang's triton backend does for decode context parallelism: a paged
decode over a page list, which simply leaves out what is elsewhere, and an LSE.

- :func:`page_list`: the ``kv_indptr``/``kv_indices`` of a decode batch (the KV
  slots of each request from SGLang's ``req_to_token``), with each request's
  ``[start, stop)`` token range left out where its pages are on a peer. Vector
  ops on the table's device (no per-request Python on a GPU).
- :func:`decode_attention`: one query per request over its listed slots:
  ``(o [B, Hq, Dv], lse [B, Hq])``, the LSE in the **natural log** (float32),
  ``-inf`` for an empty list (its output is zeros). A Triton kernel on CUDA
  (one program per request and query head; online softmax in float32), the torch
  reference elsewhere. The KV host calls it over the pages it holds, every query
  seeing every hosted key (they precede the query's position).
- :func:`lse_from_base2`: FlashInfer's decode kernels return a base-2 LSE;
  merging it as a natural log would weigh the partitions wrongly.

No SGLang import: the device check runs it on a GPU without SGLang.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import torch

LN2 = math.log(2.0)


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """A base-2 log-sum-exp (FlashInfer's) as the natural log the merge expects."""
    return lse2 * LN2


def page_list(
    req_to_token: torch.Tensor,
    rows: torch.Tensor | Sequence[int],
    seq_lens: torch.Tensor | Sequence[int],
    skip: Mapping[int, tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``kv_indptr`` int64 ``[B + 1]``, ``kv_indices`` int64) of the batch's KV slots:
    request ``b`` is row ``rows[b]`` of ``req_to_token``, its first ``seq_lens[b]``
    positions, without positions ``[start, stop)`` of ``skip[b]``."""
    dev = req_to_token.device
    rows = torch.as_tensor(rows, dtype=torch.int64, device=dev)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=dev)
    b = rows.numel()
    if b == 0:
        return torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(
            0, dtype=torch.int64, device=dev
        )
    width = int(lens.max())
    pos = torch.arange(width, device=dev).unsqueeze(0)  # [1, W]
    keep = pos < lens.unsqueeze(1)  # [B, W]
    if skip:
        start = torch.zeros(b, dtype=torch.int64)
        stop = torch.zeros(b, dtype=torch.int64)
        for i, (lo, hi) in skip.items():
            start[i], stop[i] = lo, hi
        start, stop = start.to(dev).unsqueeze(1), stop.to(dev).unsqueeze(1)
        keep &= ~((pos >= start) & (pos < stop))
    table = req_to_token[rows, :width].to(torch.int64)
    indices = table[keep]
    indptr = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    indptr[1:] = torch.cumsum(keep.sum(dim=1), 0)
    return indptr, indices


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q [B, Hq, D]`` over ``k_buffer [S, Hkv, D]``,
    ``v_buffer [S, Hkv, Dv]`` at each request's listed slots (see the module doc)."""
    b, hq, _ = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if kv_indptr.numel() != b + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries for {b} requests")
    if q.is_cuda and _triton_kernel() is not None:
        return _decode_triton(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale)
    return decode_attention_reference(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale)


def decode_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`decode_attention` (float32 math, any device)."""
    b, hq, _ = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    group = hq // hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros((b, hq, dv), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=acc, device=q.device)
    bounds = kv_indptr.tolist()
    for i in range(b):
        idx = kv_indices[bounds[i] : bounds[i + 1]]
        if idx.numel() == 0:
            continue
        k = k_buffer[idx].to(acc).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_buffer[idx].to(acc).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].to(acc), k) * scale  # [Hq, n]
        lse[i] = torch.logsumexp(s, dim=1)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=1), v).to(q.dtype)
    return out, lse


@functools.cache
def _triton_kernel():
    """The Triton kernel (compiled on first use), or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def paged_decode(
        q,
        k_buf,
        v_buf,
        indptr,
        indices,
        out,
        lse_out,
        scale,
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_ob,
        stride_oh,
        stride_lb,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        bi = tl.program_id(0).to(tl.int64)
        hi = tl.program_id(1).to(tl.int64)
        kvh = hi // GROUP
        lo = tl.load(indptr + bi)
        hi_n = tl.load(indptr + bi + 1)
        dcols = tl.arange(0, BLOCK_D)
        vcols = tl.arange(0, BLOCK_DV)
        qv = tl.load(q + bi * stride_qb + hi * stride_qh + dcols, mask=dcols < D, other=0.0)
        qv = qv.to(tl.float32)
        m = float("-inf")
        l_sum = 0.0
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for start in range(lo, hi_n, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            live = offs < hi_n
            slot = tl.load(indices + offs, mask=live, other=0).to(tl.int64)
            k = tl.load(
                k_buf + slot[:, None] * stride_ks + kvh * stride_kh + dcols[None, :],
                mask=live[:, None] & (dcols[None, :] < D),
                other=0.0,
            ).to(tl.float32)
            s = tl.sum(k * qv[None, :], axis=1) * scale
            s = tl.where(live, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(
                v_buf + slot[:, None] * stride_vs + kvh * stride_vh + vcols[None, :],
                mask=live[:, None] & (vcols[None, :] < DV),
                other=0.0,
            ).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            m = m_new
        empty = hi_n <= lo
        o = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_sum))
        tl.store(
            out + bi * stride_ob + hi * stride_oh + vcols,
            o.to(out.dtype.element_ty),
            mask=vcols < DV,
        )
        tl.store(
            lse_out + bi * stride_lb + hi,
            tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l_sum))),
        )

    return paged_decode


def _decode_triton(q, k_buffer, v_buffer, kv_indptr, kv_indices, scale):
    import triton

    b, hq, d = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("the KV buffers' head dimension must be contiguous")
    q = q.contiguous()
    out = torch.empty((b, hq, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq), dtype=torch.float32, device=q.device)
    if b:
        _triton_kernel()[(b, hq)](
            q,
            k_buffer,
            v_buffer,
            kv_indptr.to(device=q.device, dtype=torch.int64),
            kv_indices.to(device=q.device, dtype=torch.int64),
            out,
            lse,
            float(scale),
            q.stride(0),
            q.stride(1),
            k_buffer.stride(0),
            k_buffer.stride(1),
            v_buffer.stride(0),
            v_buffer.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            GROUP=hq // hkv,
            D=d,
            DV=dv,
            BLOCK_D=triton.next_power_of_2(d),
            BLOCK_DV=triton.next_power_of_2(dv),
            BLOCK_N=64,
        )
    return out, lse


def host_partial_attention(
    q: torch.Tensor, segments: Sequence[torch.Tensor], layer: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV host's part: query ``q[i]`` over every position of hosted segment ``i``
    (``[tokens, layers, 2, Hkv, D]``, one request's pages), all requests in one call.
    Every hosted key precedes the query, so nothing is masked."""
    if q.shape[0] != len(segments):
        raise ValueError(f"{q.shape[0]} queries for {len(segments)} segments")
    if not segments:
        empty = q.new_zeros((0, 1, q.shape[2]))
        zero = torch.zeros(1, dtype=torch.int64)
        return decode_attention_reference(q, empty, empty, zero, zero[:0], scale)
    k = torch.cat([s[:, layer, 0] for s in segments])  # [N, Hkv, D]
    v = torch.cat([s[:, layer, 1] for s in segments])
    lens = torch.tensor([s.shape[0] for s in segments], dtype=torch.int64)
    indptr = torch.zeros(len(segments) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int64)
    return decode_attention(q, k, v, indptr.to(q.device), indices.to(q.device), scale)
