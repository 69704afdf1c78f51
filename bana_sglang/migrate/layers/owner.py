"""The execution switch of a layer migration: layers ``[a, b)`` of worker X run on Y.

Owner side (X, in its forward pass):
- :class:`RemoteSpan` takes the place of ``layers[a]`` and :class:`Skip` of
  ``layers[a+1:b]``. At layer ``a`` it exports the layer-boundary state the way
  SGLang's pipeline parallelism does (``residual_batch.to_pp``: the hidden
  state and the residual), packs it with the batch's attention metadata into
  one registered buffer, and sends Y a :class:`~bana_sglang.wire.layer_steps.RunLayers`. Y reads the
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

Guest side (Y, :mod:`.guest`): ``GuestSpan`` holds copies of Y's own layer modules
``[a, b)`` whose parameters are the staged guest weights (X's, verified by
CRC32), a guest KV area shaped like X's slot space for those layers, and an
executor thread with its own ZMQ socket. Its attention is
``GuestAttention``: the same ``bana_cpu`` kernels as X's backend, on the
guest KV, with the plan built from the shipped slot ids. Same modules, same
weights, same kernels, same inputs: the same floats as X computing the layers.

Failure: a step that gets no answer within ``step_timeout_s``, or an error,
raises :class:`RemoteFailed` inside X's forward; the owner's callback restores
the layers (from the checkpoint) and X computes the step itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bana_sglang.migrate.errors import MigrateError
from bana_sglang.wire import layer_steps as s
from bana_sglang.wire.transport import ChannelError, Client

logger = logging.getLogger(__name__)

ALIGN = 64  # byte alignment of every tensor in a packed step buffer


class RemoteFailed(MigrateError, RuntimeError):
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
            layout.append(
                s.TensorSlot(
                    name=name,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=list(t.shape),
                    offset=off,
                )
            )
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.ensure(max(off, 1))
        for slot, t in zip(layout, tensors.values()):
            n = t.numel() * t.element_size()
            if n:
                self.buf[slot.offset : slot.offset + n].view(t.dtype).view(t.shape).copy_(t)
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
            raise ValueError(
                f"tensor {slot.name!r} ({n} bytes at {slot.offset}) lies outside the "
                f"{nbytes}-byte buffer"
            )
        out[slot.name] = buf[slot.offset : slot.offset + n].view(dtype).view(slot.shape)
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
            self._wrap(
                allocator, "_release_page_ids", lambda *ids: [self.forget_pages(i) for i in ids]
            )
        elif (
            type(allocator).__name__ == "TokenToKVPoolAllocator"
        ):  # page size 1: free is the one path
            self._wrap(allocator, "free", lambda idx: self.forget_slots(idx))
        else:
            logger.warning(
                "remote layers: unknown allocator %s; shipping the whole KV of every batch",
                type(allocator).__name__,
            )
            return False
        self._wrap(allocator, "clear", lambda: self.valid.zero_())
        return True

    def _wrap(self, obj, name: str, before: Callable) -> None:
        had_own = name in vars(
            obj
        )  # already wrapped (another span's mirror) or set on the instance
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
            while (
                (top := vars(obj).get(name)) is not None
                and getattr(top, "bana_mirror", None) is not None
                and top.bana_mirror._closed
            ):
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

    def __init__(
        self,
        migration: str,
        start: int,
        stop: int,
        endpoint: str,
        guest_session: str,
        engine,
        ctx: OwnerContext,
        step_timeout_s: float,
        on_failure: Callable,
    ):
        super().__init__()
        self.migration, self.start, self.stop = migration, start, stop
        self.endpoint, self._session = endpoint, guest_session
        self.engine, self.ctx = engine, ctx
        self.step_timeout_s, self.on_failure = step_timeout_s, on_failure
        self.stats = StepStats()
        self.mirror = SlotMirror(ctx.kv_pool.get_key_buffer(start).shape[0], ctx.allocator)
        self.send = StepBuffer(engine)
        self.recv = StepBuffer(engine)
        self._client = Client(endpoint, s.CHANNEL, timeout_s=step_timeout_s)
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
            return local_layer(
                positions, self._import(hidden, residual, forward_batch, self.start), forward_batch
            )
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
                PPProxyTensors({"hidden_states": hidden, "residual": residual}), fb
            )
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
        extend_lens = (
            [1] * len(seq_lens)
            if kind == "decode"
            else [int(n) for n in fb.extend_seq_lens.tolist()]
        )
        rows = fb.req_pool_indices.tolist()
        slots = (
            torch.cat([self.ctx.req_to_token[r, :n].long() for r, n in zip(rows, seq_lens)])
            if rows
            else torch.zeros(0, dtype=torch.long)
        )
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
        tensors = {
            "hidden_states": hidden,
            "positions": positions.long(),
            "out_loc": out_loc,
            "kv_slots": slots,
            "miss_slots": miss,
        }
        if residual is not None:
            tensors["residual"] = residual
        if miss.numel():
            tensors["miss_k"] = torch.stack([pool.get_key_buffer(li)[miss] for li in layers])
            tensors["miss_v"] = torch.stack([pool.get_value_buffer(li)[miss] for li in layers])
        layout, nbytes = self.send.pack(tensors)
        reply = self._call(kind, seq_lens, extend_lens, layout, nbytes)
        self.recv.ensure(reply.nbytes)
        try:  # bounded: this runs on the scheduler thread, and a frozen guest never sends the bytes
            self.engine.read(
                self._session,
                [self.recv.buf[: reply.nbytes]],
                [reply.addr],
                timeout_s=self.step_timeout_s,
            )
        except Exception as e:
            raise RemoteFailed(f"reading the guest's output: {e}") from e
        out = self.recv.views(reply.layout, reply.nbytes)
        # X's pool stays complete: store the rows the guest wrote for these layers
        if out_loc.numel():
            for i, li in enumerate(layers):
                pool.get_key_buffer(li)[out_loc] = out["new_k"][i].to(pool.get_key_buffer(li).dtype)
                pool.get_value_buffer(li)[out_loc] = out["new_v"][i].to(
                    pool.get_value_buffer(li).dtype
                )
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
        step = self.stats.steps
        try:  # a late answer to a step that timed out is skipped; on silence the socket goes
            reply = self._client.request(
                s.RunLayers,
                timeout_s=self.step_timeout_s,
                migration=self.migration,
                step=step,
                mode=kind,
                session=self.engine.session,
                addr=self.send.addr,
                nbytes=nbytes,
                layout=layout,
                seq_lens=seq_lens,
                extend_lens=extend_lens,
            )
        except ChannelError as e:
            raise RemoteFailed(
                f"no answer from the guest at {self.endpoint} within {self.step_timeout_s:.0f}s"
            ) from e
        if isinstance(reply, s.LayersDone):
            return reply
        raise RemoteFailed(f"guest refused step {step}: {reply.reason}: {reply.detail}")

    def close(self) -> None:
        self.mirror.close()
        self._client.close()
        self.send.close()
        self.recv.close()
