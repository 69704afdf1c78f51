"""Decode attention of a batch whose requests have KV pages on a peer: the device-independent glue.

:func:`decode_with_remote` is what a decode step does for the rows planned onto
a KV host: attend locally over every position *but* the lent ``[start, stop)``
range (:func:`~bana_sglang.kernels.paged_decode.page_list` leaves it out of the
page list; the local LSE comes back in the natural log), send the queries to the
host meanwhile (:class:`~bana_sglang.attention.remote.RemoteKV`), and merge the
host's part row by row, exactly (:func:`~bana_sglang.kernels.merge.merge_two`,
Triton on CUDA). It runs on any device: its tests run it on the CPU against
full attention, and the device check on a GPU with the Triton kernels. Rows
whose host did not answer keep the local part; the KV lender ends those
requests with an error before this step's token is committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bana_sglang.attention.remote import RemoteKV
from bana_sglang.kernels import merge
from bana_sglang.kernels.paged_decode import decode_attention, page_list


def decode_with_remote(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: Sequence[int],
    seq_lens: Sequence[int],
    remote: dict[int, Any],
    *,
    layer: int,
    scale: float,
    lender: RemoteKV | None,
) -> torch.Tensor:
    """``o [B, Hq, Dv]`` of one decode step's attention (see the module docstring).
    ``remote``: batch index -> segment (``start``/``stop`` token range on the host)."""
    skip = {b: (int(seg.start), int(seg.stop)) for b, seg in remote.items()}
    indptr, indices = page_list(req_to_token, rows, seq_lens, skip)
    pending = lender.attend_begin(layer, q, remote, scale) if remote and lender else None
    o, lse = decode_attention(q, k_buffer, v_buffer, indptr, indices, scale)
    if pending is not None:
        host = lender.attend_end(pending)
        if host:
            picked = sorted(host)
            idx = torch.tensor(picked, device=o.device)
            o_h = torch.stack([host[b][0] for b in picked]).to(o.device)
            lse_h = torch.stack([host[b][1] for b in picked]).to(o.device)
            o[idx] = merge.merge_two(o[idx], lse[idx], o_h, lse_h).output
    return o
