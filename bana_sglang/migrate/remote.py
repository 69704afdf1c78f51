"""The execution switch of a layer migration: layers ``[a, b)`` of worker X run on Y.

Owner side (X, in its forward pass):
- :class:`RemoteSpan` takes the place of ``layers[a]`` and :class:`Skip` of
  ``layers[a+1:b]``. At layer ``a`` it exports the layer-boundary state the way
  SGLang's pipeline parallelism does (``residual_batch.to_pp``: the hidden
  state and the residual), packs it with the batch's attention metadata into
  one registered buffer, and sends Y a :class:`~.steps.RunLayers`. Y reads the
  buffer through the Mooncake transfer engine, runs its guest layers, and
  answers with the address of its output buffer, which X reads back the same
  way. X restores the state before layer ``b`` (``attn_boundary.from_pp``, or
  a fresh residual stream when ``b`` is the last layer) and goes on.
- X's KV pool stays complete for ``[a, b)``: Y returns the K/V rows each batch
  wrote, and X stores them. SGLang's PD transfer and the global store read every
  layer's KV from X's buffers, so they keep working unchanged; and if Y dies, X
  can run the layers itself again at once with the KV it has.
- :class:`SlotMirror` tracks which of X's KV slots Y already holds for the
  guest layers: the rows Y computed itself, and the rows X shipped. KV that
  reached X's pool another way (the PD transfer, the global store) is shipped
  with the first batch that reads it. A freed page is forgotten (a hook on the
  allocator's page release), so a reused slot is never read stale.

Guest side (Y): :class:`GuestSpan` holds copies of Y's own layer modules
``[a, b)`` whose parameters are the staged guest weights (X's, verified by
CRC32), a guest KV area shaped like X's slot space for those layers, and an
executor thread with its own ZMQ socket. Its attention is
:class:`GuestAttention`: the same ``bana_cpu`` kernels as X's backend, on the
guest KV, with the plan built from the shipped slot ids. Same modules, same
weights, same kernels, same inputs: the same floats as X computing the layers.

Failure: a step that gets no answer within ``step_timeout_s``, or an error,
raises :class:`RemoteFailed` inside X's forward; the owner's callback restores
the layers (from the checkpoint) and X computes the step itself.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from bana_sglang.migrate import steps as s

logger = logging.getLogger(__name__)

ALIGN = 64  # byte alignment of every tensor in a packed step buffer


class RemoteFailed(RuntimeError):
    """A remote step failed (no answer, an error, a failed read)."""


# --------------------------------------------------------------------------- buffers
class StepBuffer:
    """A growable byte buffer registered with a transfer engine, into which named
    tensors are packed (and from which views are unpacked)."""

    def __init__(self, engine, capacity: int = 1 << 20):
        self.engine = engine
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.ensure(capacity)

    def ensure(self, nbytes: int) -> None:
        if nbytes <= self.buf.numel():
            return
        if self.buf.numel():
            self.engine.unregister(self.buf)
        self.buf = torch.empty(max(nbytes, 2 * self.buf.numel()), dtype=torch.uint8)
        self.engine.register(self.buf)

    @property
    def addr(self) -> int:
        return self.buf.data_ptr()

    def pack(self, tensors: dict[str, torch.Tensor]) -> tuple[list[s.TensorSlot], int]:
        layout, off = [], 0
        for name, t in tensors.items():
            layout.append(s.TensorSlot(name=name, dtype=str(t.dtype).removeprefix("torch."),
                                       shape=list(t.shape), offset=off))
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.ensure(max(off, 1))
        for slot, t in zip(layout, tensors.values()):
            n = t.numel() * t.element_size()
            if n:
                self.buf[slot.offset:slot.offset + n].view(t.dtype).view(t.shape).copy_(t)
        return layout, off

    def views(self, layout: list[s.TensorSlot], nbytes: int) -> dict[str, torch.Tensor]:
        return unpack(self.buf, layout, nbytes)

    def close(self) -> None:
        if self.buf.numel():
            self.engine.unregister(self.buf)
        self.buf = torch.empty(0, dtype=torch.uint8)


def unpack(buf: torch.Tensor, layout: list[s.TensorSlot], nbytes: int) -> dict[str, torch.Tensor]:
    """Views of the tensors ``layout`` describes in ``buf`` (checked against ``nbytes``)."""
    out = {}
    for slot in layout:
        dtype = getattr(torch, slot.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {slot.name!r}: unknown dtype {slot.dtype!r}")
        count = 1
        for d in slot.shape:
            count *= d
        n = count * dtype.itemsize
        if slot.offset + n > min(nbytes, buf.numel()):
            raise ValueError(f"tensor {slot.name!r} ({n} bytes at {slot.offset}) lies outside the "
                             f"{nbytes}-byte buffer")
        out[slot.name] = buf[slot.offset:slot.offset + n].view(dtype).view(slot.shape)
    return out


# --------------------------------------------------------------------------- owner side
class SlotMirror:
    """Which KV slots of the owner's pool the guest holds (for the guest layers).

    Set for the rows a remote step wrote or shipped; cleared for every page the
    allocator releases (and on ``clear``). Without a hook on the allocator
    (an allocator type this does not know) every step ships the full KV of its
    batch: slower, never stale."""

    def __init__(self, rows: int, allocator=None):
        self.valid = torch.zeros(rows, dtype=torch.bool)
        self.page = max(int(getattr(allocator, "page_size", 1) or 1), 1)
        self._undo: list[tuple[object, str]] = []
        self._closed = False
        self.hooked = allocator is not None and self._hook(allocator)

    def _hook(self, allocator) -> bool:
        if hasattr(allocator, "_release_page_ids"):  # paged: every free path ends here
            self._wrap(allocator, "_release_page_ids", lambda *ids: [self.forget_pages(i) for i in ids])
        elif type(allocator).__name__ == "TokenToKVPoolAllocator":  # page size 1: free is the one path
            self._wrap(allocator, "free", lambda idx: self.forget_slots(idx))
        else:
            logger.warning("remote layers: unknown allocator %s; shipping the whole KV of every batch",
                           type(allocator).__name__)
            return False
        self._wrap(allocator, "clear", lambda: self.valid.zero_())
        return True

    def _wrap(self, obj, name: str, before: Callable) -> None:
        had_own = name in vars(obj)  # already wrapped (another span's mirror) or set on the instance
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            if not self._closed:
                before(*args, **kwargs)
            return original(*args, **kwargs)

        wrapped.bana_mirror, wrapped.bana_previous = self, original if had_own else None
        setattr(obj, name, wrapped)
        self._undo.append((obj, name))

    def forget_pages(self, page_ids: torch.Tensor) -> None:
        ids = page_ids.reshape(-1).long().cpu()
        if self.page == 1:
            self.forget_slots(ids)
            return
        slots = (ids.unsqueeze(1) * self.page + torch.arange(self.page)).reshape(-1)
        self.valid[slots[slots < self.valid.numel()]] = False

    def forget_slots(self, slots: torch.Tensor) -> None:
        ids = slots.reshape(-1).long().cpu()
        self.valid[ids[ids < self.valid.numel()]] = False

    def missing(self, slots: torch.Tensor) -> torch.Tensor:
        if not self.hooked:
            return slots
        return slots[~self.valid[slots]]

    def close(self) -> None:
        """Stop tracking and unhook. A wrapper another mirror wrapped later stays
        in its chain, inert (unwrapping from the middle would drop the other's)."""
        self._closed = True
        for obj, name in reversed(self._undo):
            # unwind every closed mirror's wrapper from the top of the chain
            while (top := vars(obj).get(name)) is not None and getattr(top, "bana_mirror", None) is not None \
                    and top.bana_mirror._closed:
                if top.bana_previous is None:
                    delattr(obj, name)  # back to the class's method
                else:
                    setattr(obj, name, top.bana_previous)
        self._undo.clear()


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    shipped_rows: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    remote_s: float = 0.0  # wall time inside RemoteSpan (X's view)
    guest_s: float = 0.0  # Y's compute time

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


class Skip(torch.nn.Module):
    """A layer executed elsewhere: the hidden state passes through unchanged."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        return hidden_states


@dataclass
class OwnerContext:
    """What the owner's forward needs of its worker."""

    layers: torch.nn.ModuleList
    kv_pool: object  # SGLang KV pool (get_key_buffer / get_value_buffer)
    req_to_token: torch.Tensor  # [max_reqs, max_context] slot ids
    allocator: object = None


class RemoteSpan(torch.nn.Module):
    """Layers ``[start, stop)`` of this worker, executed by a guest; see the module doc.

    ``on_failure(span, error)`` restores the layers at home and returns the
    local module of layer ``start``, which then runs this step."""

    def __init__(self, migration: str, start: int, stop: int, endpoint: str, guest_session: str, engine,
                 ctx: OwnerContext, step_timeout_s: float, on_failure: Callable):
        super().__init__()
        self.migration, self.start, self.stop = migration, start, stop
        self.endpoint, self._session = endpoint, guest_session
        self.engine, self.ctx = engine, ctx
        self.step_timeout_s, self.on_failure = step_timeout_s, on_failure
        self.stats = StepStats()
        self.mirror = SlotMirror(ctx.kv_pool.get_key_buffer(start).shape[0], ctx.allocator)
        self.send = StepBuffer(engine)
        self.recv = StepBuffer(engine)
        self._zctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self.failed: BaseException | None = None

    # -- the forward of layer `start`
    def forward(self, positions, hidden_states, forward_batch, capture_output=None):
        from sglang.srt.layers.layer_boundary import residual as _  # noqa: F401  (package init)
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

        proxy = residual_batch.to_pp(hidden_states, forward_batch)
        hidden, residual = proxy.tensors["hidden_states"], proxy.tensors.get("residual")
        try:
            out_h, out_r = self._run(positions, hidden, residual, forward_batch)
        except Exception as e:
            self.failed = e
            local_layer = self.on_failure(self, e)  # restores the layers; X runs them itself
            return local_layer(positions, self._import(hidden, residual, forward_batch, self.start),
                               forward_batch)
        return self._import(out_h, out_r, forward_batch, self.stop)

    def _import(self, hidden, residual, fb, before: int):
        """Restore the layer-boundary state before layer ``before``."""
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
        from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        if residual is None:  # the stack's very start: nothing accumulated yet
            residual_batch.start(fb)
            return hidden
        if before < len(self.ctx.layers):
            return self.ctx.layers[before].attn_boundary.from_pp(
                PPProxyTensors({"hidden_states": hidden, "residual": residual}), fb)
        h, fb.residual_stream = ResidualStream.from_handoff(hidden, residual, PLAIN_ADD)
        return h

    def _plan(self, fb) -> tuple[str, list[int], list[int], torch.Tensor]:
        mode = fb.forward_mode
        if mode.is_decode():
            kind = "decode"
        elif mode.is_extend():
            kind = "extend"
        else:
            raise RemoteFailed(f"forward mode {mode.name} is not supported by remote layers")
        seq_lens = [int(n) for n in fb.seq_lens.tolist()]
        extend_lens = [1] * len(seq_lens) if kind == "decode" else [int(n) for n in fb.extend_seq_lens.tolist()]
        rows = fb.req_pool_indices.tolist()
        slots = torch.cat([self.ctx.req_to_token[r, :n].long() for r, n in zip(rows, seq_lens)]) \
            if rows else torch.zeros(0, dtype=torch.long)
        return kind, seq_lens, extend_lens, slots

    def _run(self, positions, hidden, residual, fb):
        t0 = time.perf_counter()
        kind, seq_lens, extend_lens, slots = self._plan(fb)
        out_loc = fb.out_cache_loc.long().cpu()
        # KV rows the batch reads that the guest does not hold (not the rows it writes now)
        needed = torch.unique(slots)
        if out_loc.numel():
            needed = needed[~torch.isin(needed, out_loc)]
        miss = self.mirror.missing(needed)
        pool, layers = self.ctx.kv_pool, range(self.start, self.stop)
        tensors = {"hidden_states": hidden, "positions": positions.long(), "out_loc": out_loc, "kv_slots": slots,
                   "miss_slots": miss}
        if residual is not None:
            tensors["residual"] = residual
        if miss.numel():
            tensors["miss_k"] = torch.stack([pool.get_key_buffer(li)[miss] for li in layers])
            tensors["miss_v"] = torch.stack([pool.get_value_buffer(li)[miss] for li in layers])
        layout, nbytes = self.send.pack(tensors)
        reply = self._call(kind, seq_lens, extend_lens, layout, nbytes)
        self.recv.ensure(reply.nbytes)
        try:
            self.engine.read(self._session, [self.recv.buf[:reply.nbytes]], [reply.addr])
        except Exception as e:
            raise RemoteFailed(f"reading the guest's output: {e}") from e
        out = self.recv.views(reply.layout, reply.nbytes)
        # X's pool stays complete: store the rows the guest wrote for these layers
        if out_loc.numel():
            for i, li in enumerate(layers):
                pool.get_key_buffer(li)[out_loc] = out["new_k"][i].to(pool.get_key_buffer(li).dtype)
                pool.get_value_buffer(li)[out_loc] = out["new_v"][i].to(pool.get_value_buffer(li).dtype)
            self.mirror.valid[out_loc] = True
        if miss.numel():
            self.mirror.valid[miss] = True
        st = self.stats
        st.steps += 1
        st.tokens += int(hidden.shape[0])
        st.shipped_rows += int(miss.numel())
        st.bytes_out += nbytes
        st.bytes_in += reply.nbytes
        st.guest_s += reply.compute_s
        st.remote_s += time.perf_counter() - t0
        # copies: the receive buffer is reused by the next step
        h = out["hidden_states"].clone()
        r = out["residual"].clone() if "residual" in out else None
        return h, r

    def _call(self, kind, seq_lens, extend_lens, layout, nbytes) -> s.LayersDone:
        if self._sock is None:
            self._sock = self._zctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        rid = next(self._ids)
        req = s.RunLayers(id=rid, deadline=time.time() + self.step_timeout_s, migration=self.migration,
                          step=self.stats.steps, mode=kind, session=self.engine.session, addr=self.send.addr,
                          nbytes=nbytes, layout=layout, seq_lens=seq_lens, extend_lens=extend_lens)
        self._sock.send(s.encode(req))
        end = time.monotonic() + self.step_timeout_s
        while (left := end - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                continue
            try:
                reply = s.decode_reply(self._sock.recv())
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise RemoteFailed(f"undecodable reply from the guest: {e}") from e
            if reply.id != rid:
                continue  # a late answer to a step that timed out
            if isinstance(reply, s.LayersDone):
                return reply
            raise RemoteFailed(f"guest refused step {req.step}: {reply.reason}: {reply.detail}")
        self._sock.close(0)
        self._sock = None
        raise RemoteFailed(f"no answer from the guest at {self.endpoint} within {self.step_timeout_s:.0f}s")

    def close(self) -> None:
        self.mirror.close()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self.send.close()
        self.recv.close()


# --------------------------------------------------------------------------- guest side
class _GuestPlan:
    def __init__(self, kind: str, seq_lens: list[int], extend_lens: list[int], kv_slots: torch.Tensor):
        self.is_decode = kind == "decode"
        self.seq_lens = tuple(seq_lens)
        self.extend_lens = tuple(extend_lens)
        bounds = list(itertools.accumulate(seq_lens, initial=0))
        per_req = [kv_slots[bounds[i]:bounds[i + 1]] for i in range(len(seq_lens))]
        if self.is_decode:
            width = max(seq_lens, default=0)
            table = torch.zeros((len(seq_lens), width), dtype=torch.long)
            for i, row in enumerate(per_req):
                table[i, :row.numel()] = row
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
        from bana_sglang.attention._kernels import cpu_attention

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
            cpu_attention.decode_attention(q.reshape(-1, self.hq, self.d), kbuf, vbuf, plan.kv_table, plan.seq_lens,
                                           scale=self.scaling, out=o.view(-1, self.hq, self.dv))
        else:
            cpu_attention.extend_attention(q.view(-1, self.hq, self.d), kbuf, vbuf, plan.kv_indices,
                                           plan.extend_lens, scale=self.scaling, out=o.view(-1, self.hq, self.dv))
        return o


# Objects a guest layer shares with the worker's own layer instead of copying:
# process groups and other runtime handles (not copyable, and not per layer).
_SHARED_MODULES = ("torch._C", "torch.distributed", "torch.cuda", "sglang.srt.distributed", "threading", "_thread",
                   "zmq")


def _shared(root) -> dict[int, object]:
    """A deepcopy memo that maps every runtime handle reachable from ``root`` to itself."""
    memo: dict[int, object] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (torch.Tensor, type, types.ModuleType, types.FunctionType,
                                            types.BuiltinFunctionType, str, bytes, int, float)):
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

    def __init__(self, migration: str, owner: str, own_layers: torch.nn.ModuleList, start: int, stop: int,
                 weights: dict[tuple[int, str], torch.Tensor], kv_rows: int, engine, host: str):
        self.migration, self.owner, self.start, self.stop = migration, owner, start, stop
        self.engine = engine
        self.layers = []
        for i, li in enumerate(range(start, stop)):
            own = own_layers[li]
            memo = _shared(own)
            memo.update({id(p): torch.nn.Parameter(weights[(li, name)], requires_grad=False)
                         for name, p in own.named_parameters()})
            layer = copy.deepcopy(own, memo)  # the same module, its parameters the guest weights
            layer.self_attn.attn = GuestAttention(own.self_attn.attn, self, i)
            self.layers.append(layer)
        a0 = own_layers[start].self_attn.attn
        dtype = own_layers[start].self_attn.qkv_proj.weight.dtype
        n = stop - start
        self.k = [torch.zeros((kv_rows, a0.tp_k_head_num, a0.qk_head_dim), dtype=dtype) for _ in range(n)]
        self.v = [torch.zeros((kv_rows, a0.tp_v_head_num, a0.v_head_dim), dtype=dtype) for _ in range(n)]
        self.kv_bytes = sum(t.numel() * t.element_size() for t in self.k + self.v)
        self.new_k: list = [None] * n
        self.new_v: list = [None] * n
        self.recv = StepBuffer(engine)
        self.send = StepBuffer(engine)
        self.steps = 0
        self.compute_s = 0.0
        self.on_step: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._thread = threading.Thread(target=self._serve, name=f"bana-guest-{migration}", daemon=True)
        self._thread.start()
        logger.info("guest layers [%d, %d) of %s (%s) served on %s; guest KV %.1f MB", start, stop, owner,
                    migration, self.endpoint, self.kv_bytes / 1e6)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100, zmq.POLLIN):
                continue
            try:
                ident, frame = self._sock.recv_multipart()[:2]
            except ValueError:
                continue
            req = s.decode_request(frame)
            if isinstance(req, s.Error):
                reply = req
            else:
                try:
                    reply = self.handle(req)
                except Exception as e:
                    logger.exception("guest step of %s failed", self.migration)
                    reply = s.Error(id=req.id, reason="internal", detail=f"{type(e).__name__}: {e}")
            self._sock.send_multipart([ident, s.encode(reply)])
        self._sock.close(0)

    def handle(self, req) -> s.LayersDone | s.Pong | s.Error:
        if req.migration != self.migration:
            return s.Error(id=req.id, reason="invalid", detail=f"this executor serves {self.migration!r}")
        if isinstance(req, s.Ping):
            return s.Pong(id=req.id, migration=self.migration, steps=self.steps)
        self.recv.ensure(req.nbytes)
        try:
            self.engine.read(req.session, [self.recv.buf[:req.nbytes]], [req.addr])
        except Exception as e:
            return s.Error(id=req.id, reason="transfer", detail=str(e))
        try:
            t = self.recv.views(req.layout, req.nbytes)
            need = {"hidden_states", "positions", "out_loc", "kv_slots", "miss_slots"}
            if not need <= t.keys() or len(req.seq_lens) != len(req.extend_lens) \
                    or sum(req.seq_lens) != t["kv_slots"].numel():
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
        return s.LayersDone(id=req.id, step=req.step, addr=self.send.addr, nbytes=nbytes, layout=layout,
                            compute_s=round(dt, 6), shipped_rows=int(miss.numel()))

    @torch.inference_mode()
    def _forward(self, req: s.RunLayers, t: dict[str, torch.Tensor]):
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        plan = _GuestPlan(req.mode, req.seq_lens, req.extend_lens, t["kv_slots"])
        gb = GuestBatch(req.mode, plan, t["out_loc"], t["hidden_states"].shape[0])
        hidden = t["hidden_states"].clone()
        if "residual" in t:
            hidden = self.layers[0].attn_boundary.from_pp(
                PPProxyTensors({"hidden_states": hidden, "residual": t["residual"].clone()}), gb)
        else:
            residual_batch.start(gb)
        positions = t["positions"].clone()
        for layer in self.layers:
            hidden = layer(positions, hidden, gb)
        proxy = residual_batch.to_pp(hidden, gb)
        return proxy.tensors["hidden_states"], proxy.tensors.get("residual")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.recv.close()
        self.send.close()
        self.layers, self.k, self.v = [], [], []
