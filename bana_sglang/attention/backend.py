"""``BanaCpuAttnBackend``: SGLang's CPU attention with extend cost ∝ new tokens × context.

A subclass of SGLang's ``TorchNativeAttnBackend`` that keeps its KV write and
metadata (SWA location translation) and replaces the attention math with
:mod:`bana_sglang.kernels.cpu_attention`: an extend's new queries attend to the cached
prefix plus themselves with the causal offset, instead of padding the queries
to the whole KV length; a decode batch runs as one padded SDPA call when that is
cheaper, else one call per request (``bana_sglang.kernels.cpu_attention.decode_pads``).

Why not SGLang's ``flex_attention`` backend, which also runs on CPU: measured
in the same run (``bench/bench_attention.py --backends torch_native bana_cpu
flex_attention``, small model, 2026-11-29), a fully cached 4k prompt took
4.50 s with it, against 2.23 s stock and 0.16 s here. Its cold prefill took
8.2 s against 5.1 s stock, and its decode at batch 8 ran at 28 tok/s against
50 stock. It builds the same whole-KV-length queries as ``torch_native``.

Invariants:
- Per batch, :meth:`init_forward_metadata` reads the request→slot table once
  (``_BatchPlan``); every layer then only gathers its KV rows by those slots.
  The plan is tied to the ``ForwardBatch`` object it was built for; a forward on
  another batch rebuilds it.
- Layers the kernels do not cover (cross-attention, encoder-only/bidirectional,
  sliding window, encoder-decoder batches) take the stock ``torch_native``
  path unchanged, so outputs never silently differ from stock semantics.
- Like the stock backend, ``logit_cap`` is not applied (SGLang's
  ``torch_native`` ignores it too).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from bana_sglang.attention.remote import remote_kv
from bana_sglang.kernels import cpu_attention, merge

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _BatchPlan:
    """Where each request's KV lives, computed once per forward batch."""

    # The ForwardBatch it was built for (compared by identity; held until the next
    # batch replaces the plan, which keeps a stale plan from ever being reused).
    batch: object
    is_decode: bool
    seq_lens: tuple[int, ...]  # KV length per request (prefix + new)
    extend_lens: tuple[int, ...]  # new tokens per request (1 each for decode)
    kv_indices: tuple[torch.Tensor, ...]  # extend: per request slot ids [seq_len] (views)
    kv_table: torch.Tensor | None  # decode: [B, max_seq_len] slot ids, padding -> slot 0
    # decode rows with KV pages on a peer (KV-block migration): batch index -> segment.
    # Their kv_table row and seq_len cover only the positions kept here.
    remote: dict | None = None


class BanaCpuAttnBackend(TorchNativeAttnBackend):
    """CPU attention backend (registered as ``bana_cpu``); see module doc."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__(model_runner)
        self._plan: _BatchPlan | None = None
        logger.info("bana_cpu attention backend: extend cost follows the new tokens")

    # --- metadata -------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        self._plan = self._build_plan(forward_batch)

    def _build_plan(self, fb: ForwardBatch) -> _BatchPlan | None:
        mode = fb.forward_mode
        if fb.encoder_lens is not None or not (mode.is_decode() or mode.is_extend()):
            return None
        req_to_token = self.req_to_token_pool.req_to_token  # [max_reqs, max_context] slot ids
        pools = fb.req_pool_indices.tolist()
        seq_lens = tuple(int(n) for n in fb.seq_lens.tolist())
        if mode.is_decode():
            lender = remote_kv()
            remote = lender.plan(pools) if lender is not None else None
            if remote:
                return self._remote_plan(fb, req_to_token, pools, seq_lens, remote)
            max_len = max(seq_lens, default=0)
            table = req_to_token[fb.req_pool_indices, :max_len].clone()  # [B, max_len]
            pad = torch.arange(max_len).unsqueeze(0) >= fb.seq_lens.cpu().unsqueeze(1)
            table.masked_fill_(pad.to(table.device), 0)
            return _BatchPlan(fb, True, seq_lens, (1,) * len(seq_lens), (), table.long())
        extend_lens = tuple(int(n) for n in fb.extend_seq_lens.tolist())
        kv_indices = tuple(req_to_token[p, :n].long() for p, n in zip(pools, seq_lens))
        return _BatchPlan(fb, False, seq_lens, extend_lens, kv_indices, None)

    @staticmethod
    def _remote_plan(fb, req_to_token, pools, seq_lens, remote) -> _BatchPlan:
        """A decode plan whose rows skip the positions a KV host holds."""
        rows, lens = [], []
        for b, (p, n) in enumerate(zip(pools, seq_lens)):
            seg = remote.get(b)
            slots = req_to_token[p, :n]
            if seg is not None:  # [start, stop) lie below the last page: both sides non-empty
                slots = torch.cat((slots[: seg.start], slots[seg.stop :]))
            rows.append(slots.long())
            lens.append(int(slots.numel()))
        table = torch.zeros((len(rows), max(lens, default=0)), dtype=torch.long)
        for b, slots in enumerate(rows):
            table[b, : slots.numel()] = slots
        return _BatchPlan(fb, True, tuple(lens), (1,) * len(lens), (), table, remote)

    def _plan_for(self, fb: ForwardBatch) -> _BatchPlan | None:
        plan = self._plan
        if plan is None or plan.batch is not fb:
            plan = self._plan = self._build_plan(fb)
        return plan

    @staticmethod
    def _covered(layer: RadixAttention) -> bool:
        """Whether the kernels implement this layer's attention (else: stock path)."""
        return (
            not layer.is_cross_attention
            and layer.attn_type == AttentionType.DECODER
            and (layer.sliding_window_size is None or layer.sliding_window_size <= -1)
        )

    def _write_kv(
        self,
        layer: RadixAttention,
        fb: ForwardBatch,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        save_kv_cache: bool,
    ) -> None:
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v
            )

    # --- forwards ---------------------------------------------------------
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        plan = self._plan_for(forward_batch)
        if plan is None or plan.is_decode or not self._covered(layer):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self._write_kv(layer, forward_batch, k, v, save_kv_cache)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        cpu_attention.extend_attention(
            q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),  # [tokens, Hq, D]
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),  # [slots, Hkv, D]
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),  # [slots, Hkv, Dv]
            plan.kv_indices,
            plan.extend_lens,
            scale=layer.scaling,
            out=o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        )
        return o

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        plan = self._plan_for(forward_batch)
        if plan is None or not plan.is_decode or not self._covered(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        self._write_kv(layer, forward_batch, k, v, save_kv_cache)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)  # [B, Hq, D]
        o3 = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        pending = (
            remote_kv().attend_begin(layer.layer_id, q3, plan.remote, layer.scaling)
            if plan.remote
            else None
        )  # the host computes its part while we compute ours
        res = cpu_attention.decode_attention(
            q3,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            plan.kv_table,
            plan.seq_lens,
            scale=layer.scaling,
            out=o3,
            need_lse=pending is not None,
        )
        if pending is not None:
            host = remote_kv().attend_end(pending)
            if host:  # one merge for every row with a host part
                rows = torch.tensor(sorted(host))
                o_h = torch.stack([host[b][0] for b in rows.tolist()])
                lse_h = torch.stack([host[b][1] for b in rows.tolist()])
                o3[rows] = merge.merge_two(o3[rows], res.lse[rows], o_h, lse_h).output
            # rows whose host failed keep the local part only: their request ends with an
            # error before this step's token is committed (the KV lender's result hook)
        return o
