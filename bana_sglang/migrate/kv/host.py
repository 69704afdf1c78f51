"""Host side of KV-block migration: hold pages of other workers' running
requests and compute partial attention over them.

One :class:`KVHost` per worker, opened by its migration agent on the first
``OpenKVHost``; it serves the :mod:`bana_sglang.wire.kv_blocks` channel with a
:class:`~bana_sglang.wire.transport.Server` on a thread of its own, so the
lender's decode steps never wait for this worker's batch boundaries. Each
hosted segment (``[tokens, layers, 2, kv_heads, head_dim]``, one request's
pages) is its own tensor registered with the transfer engine: the lender reads
it back from there on recall.

Partial attention uses the same kernel as the ``bana_cpu`` backend
(:func:`bana_sglang.kernels.cpu_attention.attend` with ``need_lse``): every query sees
every hosted key (the hosted pages lie before the query's position).

Invariants: a segment is unregistered exactly once (drop, close); an error
while serving a request becomes an error reply and the thread keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from bana_sglang.kernels import cpu_attention
from bana_sglang.migrate.layers.owner import StepBuffer, unpack
from bana_sglang.wire import kv_blocks as w
from bana_sglang.wire.transport import Server

logger = logging.getLogger(__name__)


@dataclass
class _Hosted:
    lender: str
    layers: int
    segments: dict[str, torch.Tensor] = field(default_factory=dict)
    attend_calls: int = 0
    compute_s: float = 0.0


class KVHost:
    """Serves :mod:`bana_sglang.wire.kv_blocks` requests for every lender of this worker."""

    def __init__(self, engine, host: str, name: str = ""):
        self.engine = engine
        self.name = name
        self.hosted: dict[str, _Hosted] = {}
        self._lock = threading.Lock()
        self.recv = StepBuffer(engine)
        self.send = StepBuffer(engine)
        serve = {cls: self._serve for cls in (w.HostKV, w.Attend, w.DropKV)}
        # an inline Attend's queries are the request's second frame
        self._server = Server(w.CHANNEL, serve, f"tcp://{host}:*", extra_frames=True)
        # advertised as bound: the given host, the port the server picked
        self.endpoint = f"tcp://{host}:{self._server.endpoint.rsplit(':', 1)[1]}"
        self._server.start("bana-kv-host")
        logger.info("KV-block host of %s on %s", name or "this worker", self.endpoint)

    # ------------------------------------------------------------------ bookkeeping
    def open(self, migration: str, lender: str, layers: int) -> None:
        with self._lock:
            self.hosted.setdefault(migration, _Hosted(lender, layers))

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(
                t.numel() * t.element_size()
                for h in self.hosted.values()
                for t in h.segments.values()
            )

    def info(self) -> dict[str, dict]:
        with self._lock:
            return {
                mid: {
                    "lender": h.lender,
                    "segments": len(h.segments),
                    "bytes": sum(t.numel() * t.element_size() for t in h.segments.values()),
                    "attend_calls": h.attend_calls,
                    "compute_s": h.compute_s,
                }
                for mid, h in self.hosted.items()
            }

    # ------------------------------------------------------------------ serving
    def _serve(self, req, frames: list):
        return self.handle(req, frames[0] if frames else None)

    def handle(self, req, payload=None):
        """The reply to ``req``, or (reply, payload) for an inline Attend."""
        hosted = self.hosted.get(req.migration)
        if hosted is None:
            return w.Error(
                id=req.id, reason="invalid", detail=f"no KV migration {req.migration!r} opened here"
            )
        if isinstance(req, w.DropKV):
            return self._drop(req, hosted)
        if isinstance(req, w.HostKV):
            return self._host(req, hosted)
        return self._attend(req, hosted, payload)

    def _read(self, req, dst: list[torch.Tensor], addrs: list[int]) -> str:
        try:  # bounded by the request's deadline: a frozen lender must not hold this thread
            self.engine.read(
                req.session, dst, addrs, timeout_s=max(req.deadline - time.time(), 0.1)
            )
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return ""

    def _host(self, req: w.HostKV, hosted: _Hosted) -> w.Reply:
        dtype = getattr(torch, req.dtype, None)
        if not isinstance(dtype, torch.dtype):
            return w.Error(id=req.id, reason="invalid", detail=f"unknown dtype {req.dtype!r}")
        row = 2 * req.layers * req.kv_heads * req.head_dim * dtype.itemsize
        for seg in req.segments:
            if seg.offset + seg.tokens * row > req.nbytes:
                return w.Error(
                    id=req.id,
                    reason="invalid",
                    detail=f"segment {seg.key!r} lies outside the buffer",
                )
            if seg.key in hosted.segments:
                return w.Error(
                    id=req.id, reason="invalid", detail=f"segment {seg.key!r} is already hosted"
                )
        t0 = time.perf_counter()
        tensors = [
            torch.empty((seg.tokens, req.layers, 2, req.kv_heads, req.head_dim), dtype=dtype)
            for seg in req.segments
        ]
        for t in tensors:
            self.engine.register(t)
        err = self._read(req, tensors, [req.addr + seg.offset for seg in req.segments])
        if err:
            for t in tensors:  # a late read may still land: keep them alive until it does
                self.engine.unregister(t)
            return w.Error(id=req.id, reason="transfer", detail=err)
        with self._lock:
            for seg, t in zip(req.segments, tensors):
                hosted.segments[seg.key] = t
        return w.KVHosted(
            id=req.id,
            addrs=[t.data_ptr() for t in tensors],
            seconds=round(time.perf_counter() - t0, 6),
        )

    def _attend(self, req: w.Attend, hosted: _Hosted, payload=None):
        missing = [k for k in req.keys if k not in hosted.segments]
        if missing:
            return w.Error(
                id=req.id, reason="invalid", detail=f"segment {missing[0]!r} is not hosted here"
            )
        if req.layer >= hosted.layers:
            return w.Error(
                id=req.id, reason="invalid", detail=f"layer {req.layer} of {hosted.layers}"
            )
        if req.inline:
            if payload is None or len(payload) < req.nbytes or req.nbytes > w.INLINE_MAX:
                return w.Error(
                    id=req.id,
                    reason="invalid",
                    detail="an inline Attend needs its payload frame "
                    f"(at most {w.INLINE_MAX} bytes)",
                )
            buf = (
                torch.frombuffer(bytearray(payload[: req.nbytes]), dtype=torch.uint8)
                if req.nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            self.recv.ensure(req.nbytes)
            err = self._read(req, [self.recv.buf[: req.nbytes]], [req.addr])
            if err:
                self.recv.close()  # unregistration waits for the late read, which may still land in it
                self.recv = StepBuffer(self.engine)
                return w.Error(id=req.id, reason="transfer", detail=err)
            buf = self.recv.buf
        try:
            q = unpack(buf, req.layout, req.nbytes)["q"]
            if q.dim() != 3 or q.shape[0] != len(req.keys):
                raise ValueError(f"q {tuple(q.shape)} for {len(req.keys)} keys")
        except (ValueError, KeyError) as e:
            return w.Error(id=req.id, reason="invalid", detail=f"the layout: {e}")
        t0 = time.perf_counter()
        out, lse = [], []
        with torch.inference_mode():
            for i, key in enumerate(req.keys):
                seg = hosted.segments[key]
                res = cpu_attention.attend(
                    q[i : i + 1],
                    seg[:, req.layer, 0],
                    seg[:, req.layer, 1],
                    scale=req.scale,
                    q_offset=None,
                    need_lse=True,
                )
                out.append(res.output)
                lse.append(res.lse)
        layout, nbytes = self.send.pack({"output": torch.cat(out), "lse": torch.cat(lse)})
        dt = time.perf_counter() - t0
        hosted.attend_calls += 1
        hosted.compute_s += dt
        if req.inline:
            return (
                w.Attended(
                    id=req.id,
                    addr=0,
                    nbytes=nbytes,
                    layout=layout,
                    compute_s=round(dt, 6),
                    inline=True,
                ),
                self.send.buf[:nbytes].numpy().tobytes(),
            )
        return w.Attended(
            id=req.id, addr=self.send.addr, nbytes=nbytes, layout=layout, compute_s=round(dt, 6)
        )

    def _drop(self, req: w.DropKV, hosted: _Hosted) -> w.Reply:
        with self._lock:
            keys = list(req.keys) or list(hosted.segments)
            gone = [hosted.segments.pop(k) for k in keys if k in hosted.segments]
            if not req.keys:
                self.hosted.pop(req.migration, None)
        for t in gone:
            self.engine.unregister(t)
        return w.Dropped(
            id=req.id, segments=len(gone), bytes=sum(t.numel() * t.element_size() for t in gone)
        )

    def close(self) -> None:
        self._server.close()
        with self._lock:
            tensors = [t for h in self.hosted.values() for t in h.segments.values()]
            self.hosted.clear()
        for t in tensors:
            self.engine.unregister(t)
        self.recv.close()
        self.send.close()
