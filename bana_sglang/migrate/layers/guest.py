"""The guest side of a switched layer migration (Y runs layers of X).

:class:`GuestSpan` holds copies of Y's own layer modules ``[a, b)`` whose
parameters are the staged guest weights, a guest KV area shaped like X's slot
space for those layers, and an executor: a :class:`~bana_sglang.wire.transport.Server`
of the step channel on a thread of its own, answering
:class:`~bana_sglang.wire.layer_steps.RunLayers` and ``Ping``. Its attention is
:class:`GuestAttention`: the ``bana_cpu`` kernels on the guest KV, planned from
the shipped slot ids. The owner side and the whole protocol: :mod:`.owner`.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import types
from collections.abc import Callable

import torch

from bana_sglang.migrate.layers.owner import StepBuffer
from bana_sglang.wire import layer_steps as s
from bana_sglang.wire.transport import Server

logger = logging.getLogger(__name__)


class _GuestPlan:
    def __init__(
        self, kind: str, seq_lens: list[int], extend_lens: list[int], kv_slots: torch.Tensor
    ):
        self.is_decode = kind == "decode"
        self.seq_lens = tuple(seq_lens)
        self.extend_lens = tuple(extend_lens)
        bounds = list(itertools.accumulate(seq_lens, initial=0))
        per_req = [kv_slots[bounds[i] : bounds[i + 1]] for i in range(len(seq_lens))]
        if self.is_decode:
            width = max(seq_lens, default=0)
            table = torch.zeros((len(seq_lens), width), dtype=torch.long)
            for i, row in enumerate(per_req):
                table[i, : row.numel()] = row
            self.kv_table, self.kv_indices = table, ()
        else:
            self.kv_table, self.kv_indices = None, tuple(per_req)


class GuestBatch:
    """The fields of a ``ForwardBatch`` the layers read (layer-boundary state,
    forward mode, token count), plus the guest attention plan."""

    def __init__(self, kind: str, plan: _GuestPlan, out_loc: torch.Tensor, num_tokens: int):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.forward_mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND
        self.residual_stream = None
        self.attn_cp_metadata = None
        self.dp_padding_mode = None
        self.global_num_token_non_padded_cpu = None
        self.mha_return_lse = False
        self.input_ids = torch.empty(num_tokens, dtype=torch.long)
        self.plan = plan
        self.out_loc = out_loc


class GuestAttention(torch.nn.Module):
    """Replaces a guest layer's ``RadixAttention``: writes the new K/V into the
    guest KV and runs the ``bana_cpu`` kernels over it."""

    def __init__(self, attn, span: GuestSpan, index: int):
        super().__init__()
        self.layer_id = attn.layer_id
        self.hq, self.hkv = attn.tp_q_head_num, attn.tp_k_head_num
        self.d, self.dv = attn.qk_head_dim, attn.v_head_dim
        self.scaling = attn.scaling
        self.span, self.index = span, index

    def forward(self, q, k, v, forward_batch, save_kv_cache: bool = True, **kwargs):
        from bana_sglang.kernels import cpu_attention

        gb: GuestBatch = forward_batch
        kbuf, vbuf = self.span.k[self.index], self.span.v[self.index]
        k = k.view(-1, self.hkv, self.d)
        v = v.view(-1, self.hkv, self.dv)
        if gb.out_loc.numel():
            kbuf[gb.out_loc] = k.to(kbuf.dtype)
            vbuf[gb.out_loc] = v.to(vbuf.dtype)
        self.span.new_k[self.index], self.span.new_v[self.index] = k, v
        o = q.new_empty((q.shape[0], self.hq * self.dv))
        plan = gb.plan
        if plan.is_decode:
            cpu_attention.decode_attention(
                q.reshape(-1, self.hq, self.d),
                kbuf,
                vbuf,
                plan.kv_table,
                plan.seq_lens,
                scale=self.scaling,
                out=o.view(-1, self.hq, self.dv),
            )
        else:
            cpu_attention.extend_attention(
                q.view(-1, self.hq, self.d),
                kbuf,
                vbuf,
                plan.kv_indices,
                plan.extend_lens,
                scale=self.scaling,
                out=o.view(-1, self.hq, self.dv),
            )
        return o


# Objects a guest layer shares with the worker's own layer instead of copying:
# process groups and other runtime handles (not copyable, and not per layer).
_SHARED_MODULES = (
    "torch._C",
    "torch.distributed",
    "torch.cuda",
    "sglang.srt.distributed",
    "threading",
    "_thread",
    "zmq",
)


def _shared(root) -> dict[int, object]:
    """A deepcopy memo that maps every runtime handle reachable from ``root`` to itself."""
    memo: dict[int, object] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(
            o,
            (
                torch.Tensor,
                type,
                types.ModuleType,
                types.FunctionType,
                types.BuiltinFunctionType,
                str,
                bytes,
                int,
                float,
            ),
        ):
            continue
        seen.add(id(o))
        if (type(o).__module__ or "").startswith(_SHARED_MODULES):
            memo[id(o)] = o
            continue
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        else:
            if hasattr(o, "__dict__"):
                stack.extend(vars(o).values())
            for name in getattr(type(o), "__slots__", ()) or ():
                if hasattr(o, name):
                    stack.append(getattr(o, name))
    return memo


class GuestSpan:
    """Guest layers ``[start, stop)`` of another worker, served on a ZMQ socket."""

    def __init__(
        self,
        migration: str,
        owner: str,
        own_layers: torch.nn.ModuleList,
        start: int,
        stop: int,
        weights: dict[tuple[int, str], torch.Tensor],
        kv_rows: int,
        engine,
        host: str,
    ):
        self.migration, self.owner, self.start, self.stop = migration, owner, start, stop
        self.engine = engine
        self.layers = []
        for i, li in enumerate(range(start, stop)):
            own = own_layers[li]
            memo = _shared(own)
            memo.update(
                {
                    id(p): torch.nn.Parameter(weights[(li, name)], requires_grad=False)
                    for name, p in own.named_parameters()
                }
            )
            layer = copy.deepcopy(own, memo)  # the same module, its parameters the guest weights
            layer.self_attn.attn = GuestAttention(own.self_attn.attn, self, i)
            self.layers.append(layer)
        a0 = own_layers[start].self_attn.attn
        dtype = own_layers[start].self_attn.qkv_proj.weight.dtype
        n = stop - start
        self.k = [
            torch.zeros((kv_rows, a0.tp_k_head_num, a0.qk_head_dim), dtype=dtype) for _ in range(n)
        ]
        self.v = [
            torch.zeros((kv_rows, a0.tp_v_head_num, a0.v_head_dim), dtype=dtype) for _ in range(n)
        ]
        self.kv_bytes = sum(t.numel() * t.element_size() for t in self.k + self.v)
        self.new_k: list = [None] * n
        self.new_v: list = [None] * n
        self.recv = StepBuffer(engine)
        self.send = StepBuffer(engine)
        self.steps = 0
        self.compute_s = 0.0
        self.on_step: Callable[[], None] = lambda: None
        handlers = {s.RunLayers: self.handle, s.Ping: self.handle}
        self._server = Server(s.CHANNEL, handlers, f"tcp://{host}:*")
        # advertised as bound: the given host, the port the server picked
        self.endpoint = f"tcp://{host}:{self._server.endpoint.rsplit(':', 1)[1]}"
        self._server.start(f"bana-guest-{migration}")
        logger.info(
            "guest layers [%d, %d) of %s (%s) served on %s; guest KV %.1f MB",
            start,
            stop,
            owner,
            migration,
            self.endpoint,
            self.kv_bytes / 1e6,
        )

    def handle(self, req) -> s.LayersDone | s.Pong | s.Error:
        if req.migration != self.migration:
            return s.Error(
                id=req.id, reason="invalid", detail=f"this executor serves {self.migration!r}"
            )
        if isinstance(req, s.Ping):
            return s.Pong(id=req.id, migration=self.migration, steps=self.steps)
        self.recv.ensure(req.nbytes)
        try:
            # bounded by the step's deadline: a frozen owner must not hold this executor
            self.engine.read(
                req.session,
                [self.recv.buf[: req.nbytes]],
                [req.addr],
                timeout_s=max(req.deadline - time.time(), 0.1),
            )
        except Exception as e:
            if isinstance(
                e, TimeoutError
            ):  # the late read may still land in this buffer: use a new one
                self.recv.close()
                self.recv = StepBuffer(self.engine)
            return s.Error(id=req.id, reason="transfer", detail=str(e))
        try:
            t = self.recv.views(req.layout, req.nbytes)
            need = {"hidden_states", "positions", "out_loc", "kv_slots", "miss_slots"}
            if (
                not need <= t.keys()
                or len(req.seq_lens) != len(req.extend_lens)
                or sum(req.seq_lens) != t["kv_slots"].numel()
            ):
                raise ValueError("the step's layout does not describe one batch")
        except ValueError as e:
            return s.Error(id=req.id, reason="invalid", detail=str(e))
        t0 = time.perf_counter()
        miss = t["miss_slots"]
        if miss.numel():
            for i in range(len(self.layers)):
                self.k[i][miss] = t["miss_k"][i].to(self.k[i].dtype)
                self.v[i][miss] = t["miss_v"][i].to(self.v[i].dtype)
        hidden, residual = self._forward(req, t)
        outs = {"hidden_states": hidden}
        if residual is not None:
            outs["residual"] = residual
        outs["new_k"] = torch.stack(self.new_k) if t["out_loc"].numel() else torch.zeros(0)
        outs["new_v"] = torch.stack(self.new_v) if t["out_loc"].numel() else torch.zeros(0)
        layout, nbytes = self.send.pack(outs)
        dt = time.perf_counter() - t0
        self.steps += 1
        self.compute_s += dt
        self.on_step()
        return s.LayersDone(
            id=req.id,
            step=req.step,
            addr=self.send.addr,
            nbytes=nbytes,
            layout=layout,
            compute_s=round(dt, 6),
            shipped_rows=int(miss.numel()),
        )

    @torch.inference_mode()
    def _forward(self, req: s.RunLayers, t: dict[str, torch.Tensor]):
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        plan = _GuestPlan(req.mode, req.seq_lens, req.extend_lens, t["kv_slots"])
        gb = GuestBatch(req.mode, plan, t["out_loc"], t["hidden_states"].shape[0])
        hidden = t["hidden_states"].clone()
        if "residual" in t:
            hidden = self.layers[0].attn_boundary.from_pp(
                PPProxyTensors({"hidden_states": hidden, "residual": t["residual"].clone()}), gb
            )
        else:
            residual_batch.start(gb)
        positions = t["positions"].clone()
        for layer in self.layers:
            hidden = layer(positions, hidden, gb)
        proxy = residual_batch.to_pp(hidden, gb)
        return proxy.tensors["hidden_states"], proxy.tensors.get("residual")

    def close(self) -> None:
        self._server.close()
        self.recv.close()
        self.send.close()
        self.layers, self.k, self.v = [], [], []
