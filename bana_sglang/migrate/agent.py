"""The per-worker migration agent: a ZMQ endpoint inside the SGLang scheduler.

The scheduler calls :meth:`MigrationAgent.poll` once per loop iteration (a
plugin hook on ``Scheduler.process_input_requests``, i.e. at every batch
boundary). ``poll`` answers every waiting request without blocking: commands
are validated and recorded there, and bulk work (checksums, transfer-engine
reads) runs on the agent's own worker thread, whose progress later polls and
``Watch`` requests read. The scheduler loop never waits on a transfer.

Layer migration, as far as it goes today (``MigrateLayers`` X -> Y):
1. X checksums (CRC32) every parameter of layers ``[start, stop)`` and
   registers their memory with its Mooncake transfer engine;
2. X offers them to Y (:class:`~.messages.HostLayers`: addresses, sizes,
   checksums; no bytes through ZMQ);
3. Y allocates a guest area shaped like its own copy of those layers (same
   architecture), reads X's bytes into it through the transfer engine, and
   verifies every CRC32;
4. X follows Y's progress; the migration ends ``staged`` (Y holds a verified
   copy) or ``failed`` with a reason; ``Cancel`` makes Y drop its copy.
X never stops using its own layers: switching the execution of the staged
layers to Y (hidden states over the wire, guest KV) is not built yet, so
:meth:`placement` always reports X executing all its layers.

Invariants: every request gets exactly one reply; an exception while handling
one becomes an ``internal`` error reply (logged with its traceback) and the
agent keeps running; a guest area is freed (and unregistered) exactly once.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import zmq

from bana_sglang.counters import CounterSet
from bana_sglang.migrate import messages as m
from bana_sglang.migrate.client import AgentClient, AgentUnavailable

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = (0.005, 0.2)  # a source polls its peer this often during a transfer (backing off)
# A peer's agent answers at its scheduler's batch boundaries: a long CPU batch
# (or a machine starved of cores) delays it by seconds. Silent this long: gone.
PEER_TIMEOUT_S = 30.0
# A remote step (one forward's layers on the peer) unanswered this long: the peer
# is taken as gone and the owner restores the layers (BANA_MIGRATE_STEP_TIMEOUT_S).
STEP_TIMEOUT_S = 30.0
DROP_RETRY_S = 600.0  # how long an owner keeps asking a silent peer to drop its copy
MAX_PER_POLL = 64  # requests answered per scheduler iteration


class TransferEngine:
    """This agent's Mooncake transfer engine (TCP or RDMA), started on first use."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = ""):
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine as _TE

        self._te = _TE()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, {protocol!r}) returned {rc}")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, t: torch.Tensor) -> None:
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            if ptr in self._registered or n == 0:
                return
            rc = self._te.register_memory(ptr, n)
            if rc != 0:
                raise RuntimeError(f"register_memory({n} bytes) returned {rc}")
            self._registered[ptr] = n

    def unregister(self, t: torch.Tensor) -> None:
        with self._lock:
            if self._registered.pop(t.data_ptr(), None) is not None:
                self._te.unregister_memory(t.data_ptr())

    def read(self, session: str, dst: list[torch.Tensor], src_addrs: list[int]) -> None:
        """Read ``src_addrs`` of the engine at ``session`` into ``dst`` (registered)."""
        lens = [t.numel() * t.element_size() for t in dst]
        rc = self._te.batch_transfer_sync_read(session, [t.data_ptr() for t in dst], src_addrs, lens)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read from {session} returned {rc}")


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) & 0xFFFFFFFF


@dataclass
class _Migration:
    migration: str
    side: str  # "source" | "guest"
    peer: str
    start: int
    stop: int
    state: str
    bytes_total: int = 0
    bytes_done: int = 0
    t0: float = field(default_factory=time.monotonic)
    t_end: float | None = None
    reason: str = ""
    detail: str = ""
    crc: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    guest: list[torch.Tensor] = field(default_factory=list)  # guest side: the guest area
    switch: bool = False  # source: execute the layers on the peer once staged
    executor: str = ""  # source: who executes the layers while switched
    span: object = None  # source: the RemoteSpan in the forward; guest: the GuestSpan
    home: list = field(default_factory=list)  # source: the layer modules while they are away
    params: list = field(default_factory=list)  # source: (parameter, shape) of the layers, offer order
    guest_addrs: list[int] = field(default_factory=list)  # source: where the peer holds the weights
    pending: str = ""  # source: what the scheduler thread applies at the next boundary
    released_bytes: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def seconds(self) -> float:
        return (self.t_end or time.monotonic()) - self.t0

    def finish(self, state: str, reason: str = "", detail: str = "") -> None:
        self.state, self.reason, self.detail = state, reason, detail
        self.t_end = time.monotonic()

    def info(self) -> m.MigrationInfo:
        return m.MigrationInfo(migration=self.migration, side=self.side, peer=self.peer, start=self.start,
                               stop=self.stop, state=self.state, bytes_done=self.bytes_done,
                               bytes_total=self.bytes_total, seconds=round(self.seconds, 4),
                               reason=self.reason, detail=self.detail, crc32=list(self.crc),
                               tensors=list(self.names), executor=self.executor,
                               released_bytes=self.released_bytes, **self._step_info())

    def _step_info(self) -> dict:
        span = self.span
        if span is None:
            return {}
        if self.side == "guest":
            return {"steps": span.steps, "guest_seconds": round(span.compute_s, 4), "guest_kv_bytes": span.kv_bytes}
        st = span.stats
        return {"steps": st.steps, "remote_seconds": round(st.remote_s, 4), "guest_seconds": round(st.guest_s, 4),
                "shipped_rows": st.shipped_rows}

    def reply(self, rid: int) -> m.Reply:
        if self.state == "failed" or self.state == "cancelled":
            return m.Failed(id=rid, migration=self.migration, reason=self.reason or self.state, detail=self.detail)
        if self.state in m.TERMINAL:
            return m.Done(id=rid, migration=self.migration, state=self.state, bytes=self.bytes_done,
                          seconds=round(self.seconds, 4))
        return m.Progress(id=rid, migration=self.migration, state=self.state, bytes_done=self.bytes_done,
                          bytes_total=self.bytes_total)


METRICS = {
    "migrations_started": "Layer migrations this worker started as the source",
    "migrations_staged": "Layer migrations that ended staged (the peer verified its copy)",
    "migrations_failed": "Layer migrations that failed or were cancelled (source side)",
    "sent_bytes": "Layer bytes peers read from this worker and verified",
    "guest_bytes_received": "Layer bytes this worker read for other workers and verified",
    "rejected_requests": "Control messages refused (malformed, unknown type or version, stale, invalid)",
    "migrations_switched": "Layer migrations whose layers this worker then ran on the peer",
    "migrations_recalled": "Switched layer migrations brought home by a recall",
    "migrations_restored": "Switched layer migrations restored from the checkpoint after the peer failed",
    "released_bytes": "Weight bytes this worker freed while peers executed its layers",
    "remote_steps": "Forwards whose migrated layers ran on a peer",
    "guest_steps": "Forwards of other workers' layers this worker ran",
}


@dataclass
class WorkerHandles:
    """What the execution switch needs of the worker (from its SGLang ModelRunner)."""

    model: torch.nn.Module
    kv_pool: object
    req_to_token: torch.Tensor
    allocator: object
    model_path: str
    attention_backend: str
    tp_size: int = 1

    @classmethod
    def from_runner(cls, runner) -> WorkerHandles:
        return cls(model=runner.model, kv_pool=runner.token_to_kv_pool,
                   req_to_token=runner.req_to_token_pool.req_to_token,
                   allocator=runner.token_to_kv_pool_allocator, model_path=runner.model_config.model_path,
                   attention_backend=str(runner.server_args.attention_backend),
                   tp_size=int(runner.server_args.tp_size))

    def why_not(self) -> str:
        """Why layers of this worker cannot run remotely, or ''."""
        if self.tp_size != 1:
            return f"tensor parallelism {self.tp_size}: remote layers are built for TP 1"
        if self.attention_backend != "bana_cpu":
            return (f"attention backend {self.attention_backend!r}: remote layers run the bana_cpu kernels, "
                    "so the owner must too (exact tokens)")
        if next(self.model.parameters()).device.type != "cpu":
            return "the model is not on the CPU: the CUDA path needs the CUDA transfer engine"
        return ""


# source states that hold nothing: the layers may be migrated again
_SETTLED = ("failed", "cancelled", "home", "restored")


class MigrationAgent:
    """One worker's agent; see the module doc. ``layers`` is the model's list of
    decoder layers (``model.model.layers`` for SGLang's Llama)."""

    def __init__(self, name: str, role: str, layers: torch.nn.ModuleList, endpoint: str, *,
                 te_host: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                 peer_timeout_s: float = PEER_TIMEOUT_S, worker: WorkerHandles | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S):
        self.name, self.role, self.layers = name, role, layers
        self.peer_timeout_s = peer_timeout_s
        self.worker = worker
        self.step_timeout_s = step_timeout_s
        self.num_layers = len(layers)
        self.te_host, self.protocol, self.device = te_host, protocol, device
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._te: TransferEngine | None = None
        self._te_lock = threading.Lock()
        self._work = ThreadPoolExecutor(1, thread_name_prefix=f"bana-migrate-{name}")
        self._lock = threading.Lock()
        self.migrations: dict[str, _Migration] = {}
        self.metrics = CounterSet("bana_migrate", METRICS)
        self._closed = False
        logger.info("migration agent of %s (%s, %d layers) on %s", name, role, self.num_layers, self.endpoint)

    # ------------------------------------------------------------------ loop
    def poll(self) -> int:
        """Answer every waiting request (at most MAX_PER_POLL); never blocks."""
        self._apply_pending()
        n = 0
        while n < MAX_PER_POLL:
            try:
                ident, frame = self._sock.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                break
            except ValueError:  # a message of one frame: nothing to answer to
                continue
            n += 1
            req = m.decode_request(frame)
            if isinstance(req, m.Error):
                logger.warning("rejected a request (%s): %s", req.reason, req.detail)
                self.metrics.add("rejected_requests")
                reply = req
            else:
                try:
                    reply = self.handle(req)
                except Exception as e:  # a bug: answer, log, keep serving
                    logger.exception("migration agent: %s failed", type(req).__name__)
                    reply = m.Error(id=req.id, reason="internal", detail=f"{type(e).__name__}: {e}")
            if isinstance(reply, m.Error) and reply.reason == "invalid":
                self.metrics.add("rejected_requests")
            self._sock.send_multipart([ident, m.encode(reply)])
        return n

    def serve_forever(self, stop: threading.Event, interval_s: float = 0.005) -> None:
        """Run :meth:`poll` on the calling thread until ``stop`` (tests, tools)."""
        while not stop.is_set():
            if not self.poll():
                stop.wait(interval_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for mig in list(self.migrations.values()):
            mig.cancel.set()
        self._work.shutdown(wait=True, cancel_futures=True)
        for mig in list(self.migrations.values()):
            self._free_guest(mig)
            if mig.side == "source" and mig.span is not None:
                mig.span.close()
        self._sock.close(0)

    # ------------------------------------------------------------------ handlers
    def handle(self, req: m.Request) -> m.Reply:
        if isinstance(req, m.Ping):
            return m.Pong(id=req.id, worker=self.name, role=self.role, num_layers=self.num_layers, pid=os.getpid())
        if isinstance(req, m.Status):
            return self.status(req.id)
        if isinstance(req, m.MigrateLayers):
            return self._migrate(req)
        if isinstance(req, m.Watch):
            mig = self.migrations.get(req.migration)
            return mig.reply(req.id) if mig else self._unknown(req.id, req.migration)
        if isinstance(req, m.Cancel):
            return self._cancel(req)
        if isinstance(req, m.HostLayers):
            return self._host(req)
        if isinstance(req, m.Recall):
            return self._recall(req)
        if isinstance(req, m.OpenGuest):
            return self._open_guest(req)
        if isinstance(req, m.DropGuest):
            mig = self.migrations.get(req.migration)
            if mig is None or mig.side != "guest":
                return self._unknown(req.id, req.migration)
            mig.cancel.set()
            if mig.state == "pulling":  # the worker thread frees it when it stops
                return m.Ok(id=req.id, note="dropping after the current read")
            self._free_guest(mig)
            mig.finish("dropped", "cancelled", "dropped by its owner")
            return m.Ok(id=req.id, note="dropped")
        return m.Error(id=req.id, reason="unknown_type", detail=type(req).__name__)

    @staticmethod
    def _unknown(rid: int, migration: str) -> m.Error:
        return m.Error(id=rid, reason="invalid", detail=f"no migration {migration!r} here")

    def placement(self) -> list[m.Placement]:
        """Who executes which of this worker's layers (consecutive runs)."""
        away = {}
        for mig in self.migrations.values():
            if mig.side == "source" and mig.home:  # switched: the modules are away
                for i in range(mig.start, mig.stop):
                    away[i] = mig.executor
        out: list[m.Placement] = []
        for i in range(self.num_layers):
            who = away.get(i, self.name)
            if out and out[-1].executor == who:
                out[-1] = m.Placement(start=out[-1].start, stop=i + 1, executor=who)
            else:
                out.append(m.Placement(start=i, stop=i + 1, executor=who))
        return out

    def status(self, rid: int) -> m.StatusResult:
        with self._lock:
            infos = [mig.info() for mig in self.migrations.values()]
            guest = sum(t.numel() * t.element_size() for mig in self.migrations.values() for t in mig.guest)
            guest += sum(mig.span.kv_bytes for mig in self.migrations.values()
                         if mig.side == "guest" and mig.span is not None and mig.guest)
        return m.StatusResult(id=rid, worker=self.name, role=self.role, num_layers=self.num_layers,
                              placement=self.placement(), migrations=infos, guest_bytes=guest,
                              transfer_session=self._te.session if self._te else "")

    def _engine(self) -> TransferEngine:
        with self._te_lock:
            if self._te is None:
                self._te = TransferEngine(self.te_host, self.protocol, self.device)
                logger.info("migration agent of %s: transfer engine %s (%s)", self.name, self._te.session,
                            self.protocol)
            return self._te

    # -- source side
    def _migrate(self, req: m.MigrateLayers) -> m.Reply:
        if not req.start < req.stop <= self.num_layers:
            return m.Error(id=req.id, reason="invalid",
                           detail=f"layers [{req.start}, {req.stop}) are not a non-empty range of this "
                                  f"worker's {self.num_layers} layers")
        if req.migration in self.migrations:
            return m.Error(id=req.id, reason="invalid", detail=f"migration id {req.migration!r} is taken")
        busy = [x for x in self.migrations.values() if x.side == "source" and x.state not in _SETTLED
                and x.start < req.stop and req.start < x.stop]
        if busy:
            return m.Error(id=req.id, reason="invalid",
                           detail=f"layers overlap migration {busy[0].migration!r} "
                                  f"[{busy[0].start}, {busy[0].stop}) ({busy[0].state})")
        if req.switch:
            why = self.worker.why_not() if self.worker else "this agent has no model runner (not inside a worker)"
            if why:
                return m.Error(id=req.id, reason="invalid", detail=f"cannot switch the execution: {why}")
            away = [x for x in self.migrations.values() if x.side == "guest" and x.state == "serving"]
            if away:
                return m.Error(id=req.id, reason="invalid",
                               detail=f"this worker executes guest layers ({away[0].migration!r}); "
                                      "a worker either lends or hosts layers")
        mig = _Migration(req.migration, "source", req.peer, req.start, req.stop, "accepted", switch=req.switch)
        with self._lock:
            self.migrations[req.migration] = mig
        self.metrics.add("migrations_started")
        self._work.submit(self._run_source, mig, req.peer)
        logger.info("migration %s: layers [%d, %d) of %s -> %s accepted", mig.migration, mig.start, mig.stop,
                    self.name, req.peer)
        return m.Accepted(id=req.id, migration=req.migration)

    def _layer_tensors(self, start: int, stop: int) -> list[tuple[int, str, torch.Tensor]]:
        """The layers' parameters. Buffers (e.g. a rotary cos/sin cache) are derived
        from the config, which the peer shares, so they do not travel."""
        return [(i, name, p.data) for i, name, p in self._layer_params(start, stop)]

    def _layer_params(self, start: int, stop: int) -> list[tuple[int, str, torch.nn.Parameter]]:
        return [(i, name, p) for i in range(start, stop) for name, p in self.layers[i].named_parameters()]

    def _run_source(self, mig: _Migration, peer: str) -> None:
        client = AgentClient(peer, timeout_s=self.peer_timeout_s, ctx=self._ctx)
        try:
            mig.state = "checksumming"
            tensors = self._layer_tensors(mig.start, mig.stop)
            if any(t.device.type != "cpu" or not t.is_contiguous() for _, _, t in tensors):
                raise _Fail("invalid", "layer migration reads CPU, contiguous parameters only (this worker's "
                                       "are not); the CUDA path needs the CUDA transfer engine")
            te = self._engine()
            descs = []
            for layer, name, t in tensors:
                te.register(t)
                descs.append(m.TensorDesc(layer=layer, name=name, dtype=str(t.dtype).removeprefix("torch."),
                                          shape=list(t.shape), addr=t.data_ptr(),
                                          nbytes=t.numel() * t.element_size(), crc32=crc32(t)))
            mig.crc = [d.crc32 for d in descs]
            mig.names = [f"{d.layer}.{d.name}" for d in descs]
            mig.bytes_total = sum(d.nbytes for d in descs)
            if mig.cancel.is_set():
                raise _Fail("cancelled", "cancelled before the offer")
            mig.state = "offered"
            reply = self._ask(client, m.HostLayers, migration=mig.migration, owner=self.name,
                              session=te.session, start=mig.start, stop=mig.stop, tensors=descs)
            if not isinstance(reply, m.Accepted):
                raise _Fail("peer_refused", _describe(reply))
            mig.state = "transferring"
            wait = WATCH_INTERVAL_S[0]
            while True:
                if mig.cancel.is_set():
                    self._drop_at_peer(client, mig)
                    raise _Fail("cancelled", "cancelled during the transfer")
                reply = self._ask(client, m.Watch, migration=mig.migration)
                if isinstance(reply, m.Progress):
                    mig.bytes_done = reply.bytes_done
                elif isinstance(reply, m.Done):
                    mig.bytes_done = reply.bytes
                    break
                else:
                    raise _Fail(reply.reason if isinstance(reply, (m.Failed, m.Error)) else "internal",
                                "peer: " + _describe(reply))
                time.sleep(wait)
                wait = min(WATCH_INTERVAL_S[1], wait * 2)
            self.metrics.add("migrations_staged")
            self.metrics.add("sent_bytes", mig.bytes_done)
            logger.info("migration %s: layers [%d, %d) staged on %s: %.1f MB verified in %.2fs (%.1f MB/s)",
                        mig.migration, mig.start, mig.stop, mig.peer, mig.bytes_done / 1e6, mig.seconds,
                        mig.bytes_done / 1e6 / max(mig.seconds, 1e-9))
            if mig.switch:
                self._prepare_switch(mig, client)
            else:
                mig.finish("staged")
        except _Fail as f:
            mig.finish("cancelled" if f.reason == "cancelled" else "failed", f.reason, f.detail)
            self.metrics.add("migrations_failed")
            logger.warning("migration %s %s: %s %s", mig.migration, mig.state, f.reason, f.detail)
        except Exception as e:
            mig.finish("failed", "internal", f"{type(e).__name__}: {e}")
            self.metrics.add("migrations_failed")
            logger.exception("migration %s failed", mig.migration)
        finally:
            client.close()

    def _ask(self, client: AgentClient, make, **fields) -> m.Reply:
        try:
            return client.call(make, **fields)
        except AgentUnavailable as e:
            raise _Fail("peer_unreachable", str(e)) from None

    def _drop_at_peer(self, client: AgentClient, mig: _Migration) -> None:
        with contextlib.suppress(_Fail):
            self._ask(client, m.DropGuest, migration=mig.migration)

    def _cancel(self, req: m.Cancel) -> m.Reply:
        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != "source":
            return self._unknown(req.id, req.migration)
        if mig.state in _SETTLED:
            return m.Ok(id=req.id, note=f"already {mig.state}")
        if mig.state == "remote":  # switched: cancelling brings the layers home
            return self._recall(m.Recall(id=req.id, deadline=req.deadline, migration=req.migration))
        if mig.state == "recalling":
            return m.Ok(id=req.id, note="already recalling")
        mig.cancel.set()
        if mig.state == "staged":  # done: ask the peer to free its copy, off the scheduler thread
            mig.finish("cancelled", "cancelled", "cancelled after staging; the peer drops its copy")
            self._work.submit(self._drop_remote, mig)
        return m.Ok(id=req.id, note="cancelling")

    # -- the execution switch (source side)
    def _prepare_switch(self, mig: _Migration, client: AgentClient) -> None:
        """Worker thread, after staging: open the guest executor on the peer and
        build the remote span; the scheduler thread installs it (_apply_pending)."""
        from bana_sglang.migrate.remote import OwnerContext, RemoteSpan

        mig.state = "switching"
        w = self.worker
        rows = w.kv_pool.get_key_buffer(mig.start).shape[0]
        reply = self._ask(client, m.OpenGuest, migration=mig.migration, kv_rows=rows)
        if not isinstance(reply, m.GuestOpened):
            self._drop_at_peer(client, mig)
            raise _Fail("peer_refused", "opening the guest executor: " + _describe(reply))
        mig.executor, mig.guest_addrs = reply.worker, list(reply.addrs)
        ctx = OwnerContext(layers=self.layers, kv_pool=w.kv_pool, req_to_token=w.req_to_token,
                           allocator=w.allocator)
        try:
            mig.span = RemoteSpan(mig.migration, mig.start, mig.stop, reply.endpoint, reply.session,
                                  self._engine(), ctx, self.step_timeout_s, self._on_remote_failure)
        except Exception as e:  # the peer opened its executor: close it
            self._drop_at_peer(client, mig)
            raise _Fail("internal", f"building the remote span: {type(e).__name__}: {e}") from e
        with mig.lock:
            mig.pending = "install"

    def _apply_pending(self) -> None:
        """Scheduler thread, at a batch boundary: swap layer modules."""
        for mig in list(self.migrations.values()):
            if mig.side != "source" or not mig.pending:
                continue
            with mig.lock:
                action, mig.pending = mig.pending, ""
                try:
                    if action == "install":
                        self._install(mig)
                    elif action == "home":
                        self._swap_home(mig)
                        self._finish_home(mig, "home", "")
                    elif action == "checkpoint":
                        self._restore_from_checkpoint(mig)
                        self._finish_home(mig, "home", "", note="reloaded from the checkpoint")
                except Exception as e:
                    logger.exception("migration %s: %s failed", mig.migration, action)
                    mig.finish("failed", "internal", f"{action}: {type(e).__name__}: {e}")

    def _install(self, mig: _Migration) -> None:
        from bana_sglang.migrate.remote import Skip

        if mig.cancel.is_set():
            mig.span.close()
            self._work.submit(self._drop_remote, mig)
            mig.finish("cancelled", "cancelled", "cancelled before the switch")
            return
        mig.params = [(p, tuple(p.shape)) for _, _, p in self._layer_params(mig.start, mig.stop)]
        mig.home = [self.layers[i] for i in range(mig.start, mig.stop)]
        self.layers[mig.start] = mig.span
        for i in range(mig.start + 1, mig.stop):
            self.layers[i] = Skip(i)
        # the peer executes them now: free this worker's copy of the weights
        released = 0
        for p, _ in mig.params:
            if self._te is not None:
                self._te.unregister(p.data)
            released += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype)
        mig.released_bytes = released
        mig.finish("remote")
        self.metrics.add("migrations_switched")
        self.metrics.add("released_bytes", released)
        logger.info("migration %s: layers [%d, %d) of %s now run on %s; %.1f MB of weights released here",
                    mig.migration, mig.start, mig.stop, self.name, mig.executor, released / 1e6)

    def _swap_home(self, mig: _Migration) -> None:
        for i, module in zip(range(mig.start, mig.stop), mig.home):
            self.layers[i] = module
        mig.home = []

    def _finish_home(self, mig: _Migration, state: str, reason: str, detail: str = "", note: str = "") -> None:
        stats = mig.span.stats if mig.span is not None else None
        mig.span.close()
        mig.finish(state, reason, detail)
        self.metrics.add("remote_steps", stats.steps if stats else 0)
        self.metrics.add("migrations_recalled" if state == "home" else "migrations_restored")
        self._work.submit(self._drop_remote, mig)
        logger.info("migration %s: layers [%d, %d) run on %s again (%s%s) after %d remote steps",
                    mig.migration, mig.start, mig.stop, self.name, state, f", {note}" if note else "",
                    stats.steps if stats else 0)

    def _drop_remote(self, mig: _Migration) -> None:
        """Tell the peer to drop its copy (and executor). A peer that does not
        answer (frozen, partitioned) is asked again with backoff for up to
        DROP_RETRY_S, on a thread of its own, so its copy is not left behind."""
        if self._drop_once(mig):
            return

        def retry() -> None:
            wait, deadline = 1.0, time.monotonic() + DROP_RETRY_S
            while not self._closed and time.monotonic() < deadline:
                time.sleep(wait)
                if self._drop_once(mig):
                    logger.info("migration %s: the peer dropped its copy after a retry", mig.migration)
                    return
                wait = min(30.0, wait * 2)
            logger.warning("migration %s: the peer never confirmed dropping its copy", mig.migration)

        threading.Thread(target=retry, name=f"bana-drop-{mig.migration}", daemon=True).start()

    def _drop_once(self, mig: _Migration) -> bool:
        client = AgentClient(mig.peer, timeout_s=self.peer_timeout_s, ctx=self._ctx)
        try:
            reply = client.call(m.DropGuest, migration=mig.migration)
        except AgentUnavailable:
            return False
        finally:
            client.close()
        return isinstance(reply, (m.Ok, m.Error))  # dropped, or nothing there to drop

    def _realloc(self, mig: _Migration) -> None:
        for p, shape in mig.params:
            if p.numel() == 0 and shape != (0,):
                p.data = torch.empty(shape, dtype=p.dtype)

    def _verify_home(self, mig: _Migration) -> None:
        got = [crc32(p.data) for p, _ in mig.params]
        bad = [n for n, a, b in zip(mig.names, got, mig.crc) if a != b]
        if bad:
            raise RuntimeError(f"{len(bad)} restored tensors differ from their checksum before the "
                               f"migration, e.g. {bad[0]}")

    def _restore_from_checkpoint(self, mig: _Migration) -> None:
        """Scheduler thread: put the modules back and reload their weights from disk."""
        from safetensors import safe_open

        self._realloc(mig)
        self._swap_home(mig)
        prefixes = tuple(f"model.layers.{i}." for i in range(mig.start, mig.stop))
        files = sorted(glob.glob(os.path.join(self.worker.model_path, "*.safetensors")))
        if not files:
            raise RuntimeError(f"no *.safetensors checkpoint in {self.worker.model_path}")

        def weights():
            for path in files:
                with safe_open(path, "pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if key.startswith(prefixes):
                            yield key, f.get_tensor(key)

        self.worker.model.load_weights(weights())
        self._verify_home(mig)

    def _on_remote_failure(self, span, error: BaseException):
        """Scheduler thread, inside the forward: the peer failed after the switch.
        Reload the layers here and return layer ``start``'s module, which runs
        this very step (X's KV for the layers is complete, so nothing is lost)."""
        mig = self.migrations[span.migration]
        with mig.lock:
            logger.error("migration %s: remote step failed (%s); restoring layers [%d, %d) from the checkpoint",
                         mig.migration, error, mig.start, mig.stop)
            if mig.home:
                self._restore_from_checkpoint(mig)
            mig.pending = ""
            self._finish_home(mig, "restored", "peer_lost", str(error))
        return self.layers[mig.start]

    def _recall(self, req: m.Recall) -> m.Reply:
        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != "source":
            return self._unknown(req.id, req.migration)
        if mig.state != "remote":
            return m.Error(id=req.id, reason="invalid",
                           detail=f"migration {req.migration!r} is {mig.state}, not remote: nothing to recall")
        mig.state, mig.t_end = "recalling", None
        if req.source == "checkpoint":
            with mig.lock:
                mig.pending = "checkpoint"
        else:
            self._work.submit(self._recall_from_peer, mig)
        return m.Accepted(id=req.id, migration=req.migration)

    def _recall_from_peer(self, mig: _Migration) -> None:
        """Worker thread: read the weights back from the peer's verified copy into
        this worker's (unused) parameters; the scheduler thread swaps them in."""
        with mig.lock:
            if mig.state != "recalling":
                return
            try:
                te = self._engine()
                self._realloc(mig)
                tensors = [p.data for p, _ in mig.params]
                for t in tensors:
                    te.register(t)
                try:
                    te.read(mig.span._session, tensors, mig.guest_addrs)
                finally:
                    for t in tensors:
                        te.unregister(t)
                self._verify_home(mig)
                mig.pending = "home"
            except Exception as e:
                logger.warning("migration %s: reading the layers back from %s failed (%s); reloading them from "
                               "the checkpoint", mig.migration, mig.executor, e)
                mig.pending = "checkpoint"

    # -- guest side
    def _host(self, req: m.HostLayers) -> m.Reply:
        if req.migration in self.migrations:
            return m.Error(id=req.id, reason="invalid", detail=f"migration id {req.migration!r} is taken")
        if not req.start < req.stop <= self.num_layers:
            return m.Error(id=req.id, reason="invalid",
                           detail=f"layers [{req.start}, {req.stop}) do not exist in this worker's model")
        mine = {(i, n): t for i, n, t in self._layer_tensors(req.start, req.stop)}
        for d in req.tensors:
            own = mine.get((d.layer, d.name))
            if own is None or list(own.shape) != d.shape or str(own.dtype).removeprefix("torch.") != d.dtype:
                return m.Error(id=req.id, reason="invalid",
                               detail=f"layer {d.layer} {d.name} {d.dtype}{d.shape} does not match this worker's "
                                      "model (layer migration needs the same architecture)")
        mig = _Migration(req.migration, "guest", req.owner, req.start, req.stop, "pulling",
                         bytes_total=sum(d.nbytes for d in req.tensors),
                         names=[f"{d.layer}.{d.name}" for d in req.tensors])
        with self._lock:
            self.migrations[req.migration] = mig
        self._work.submit(self._run_guest, mig, req)
        return m.Accepted(id=req.id, migration=req.migration)

    def _run_guest(self, mig: _Migration, req: m.HostLayers) -> None:
        try:
            te = self._engine()
            area = [torch.empty(d.shape, dtype=getattr(torch, d.dtype)) for d in req.tensors]
            mig.guest = area
            for t in area:
                te.register(t)
            # one batched read per layer: progress is visible between layers
            for layer in range(req.start, req.stop):
                if mig.cancel.is_set():
                    raise _Fail("cancelled", "dropped by its owner during the transfer")
                idx = [i for i, d in enumerate(req.tensors) if d.layer == layer and d.nbytes]
                if idx:
                    te.read(req.session, [area[i] for i in idx], [req.tensors[i].addr for i in idx])
                    mig.bytes_done += sum(req.tensors[i].nbytes for i in idx)
            mig.crc = [crc32(t) for t in area]
            bad = [d.name for d, got in zip(req.tensors, mig.crc) if got != d.crc32]
            if bad:
                raise _Fail("checksum", f"{len(bad)} tensors differ from the owner's checksum, e.g. {bad[0]}")
            mig.finish("verified")
            self.metrics.add("guest_bytes_received", mig.bytes_done)
            logger.info("guest layers [%d, %d) of %s verified: %.1f MB in %.2fs", req.start, req.stop,
                        req.owner, mig.bytes_done / 1e6, mig.seconds)
        except _Fail as f:
            self._free_guest(mig)
            mig.finish("dropped" if f.reason == "cancelled" else "failed", f.reason, f.detail)
        except Exception as e:
            self._free_guest(mig)
            mig.finish("failed", "transfer", f"{type(e).__name__}: {e}")
            logger.warning("guest layers of %s (%s) failed: %s", req.owner, mig.migration, e)

    def _open_guest(self, req: m.OpenGuest) -> m.Reply:
        from bana_sglang.migrate.remote import GuestSpan

        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != "guest":
            return self._unknown(req.id, req.migration)
        if mig.state != "verified":
            return m.Error(id=req.id, reason="invalid", detail=f"guest layers of {req.migration!r} are {mig.state}")
        mine = [x for x in self.migrations.values() if x.side == "source" and x.home]
        if mine:
            return m.Error(id=req.id, reason="invalid",
                           detail=f"this worker's own layers run elsewhere ({mine[0].migration!r}); "
                                  "a worker either lends or hosts layers")
        weights = {}
        for name, t in zip(mig.names, mig.guest):
            layer, pname = name.split(".", 1)
            weights[(int(layer), pname)] = t
        span = GuestSpan(mig.migration, mig.peer, self.layers, mig.start, mig.stop, weights, req.kv_rows,
                         self._engine(), self.te_host)
        span.on_step = lambda: self.metrics.add("guest_steps")
        mig.span = span
        mig.state = "serving"
        return m.GuestOpened(id=req.id, migration=mig.migration, worker=self.name, endpoint=span.endpoint,
                             session=self._engine().session, addrs=[t.data_ptr() for t in mig.guest])

    def _free_guest(self, mig: _Migration) -> None:
        if mig.side == "guest" and mig.span is not None and mig.guest:
            mig.span.close()
        area, mig.guest = mig.guest, []
        if area and self._te is not None:
            for t in area:
                self._te.unregister(t)


class _Fail(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _describe(reply: m.Reply) -> str:
    if isinstance(reply, (m.Failed, m.Error)):
        return f"{reply.reason}: {reply.detail}"
    return type(reply).__name__
