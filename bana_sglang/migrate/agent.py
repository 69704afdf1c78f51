"""The per-worker migration agent: a ZMQ endpoint inside the SGLang scheduler.

The scheduler calls :meth:`MigrationAgent.poll` once per loop iteration (a
plugin hook on ``Scheduler.process_input_requests``, i.e. at every batch
boundary). ``poll`` answers every waiting request without blocking: commands
are validated and recorded there, and bulk work (checksums, transfer-engine
reads) runs on the agent's own worker thread, whose progress later polls and
``Watch`` requests read. The scheduler loop never waits on a transfer.

Layer migration, staging (``MigrateLayers`` X -> Y):
1. X checksums (CRC32) every parameter of layers ``[start, stop)`` and
   registers their memory with its Mooncake transfer engine;
2. X offers them to Y (:class:`~.messages.HostLayers`: addresses, sizes,
   checksums; no bytes through ZMQ);
3. Y allocates a guest area shaped like its own copy of those layers (same
   architecture), reads X's bytes into it through the transfer engine, and
   verifies every CRC32;
4. X follows Y's progress; the migration ends ``staged`` (Y holds a verified
   copy) or ``failed`` with a reason; ``Cancel`` makes Y drop its copy.
With ``switch`` the execution then moves to Y (:mod:`.switch`), and
:meth:`placement` reports who executes which layers. KV-block migration
(``MigrateKV``) is :mod:`.kvagent`'s.

Invariants: every request gets exactly one reply; an exception while handling
one becomes an ``internal`` error reply (logged with its traceback) and the
agent keeps running; a guest area is freed (and unregistered) exactly once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import zmq

from bana_sglang.counters import CounterSet
from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.migrate.kv.handler import KVMixin
from bana_sglang.migrate.layers.handler import SwitchMixin, WorkerHandles
from bana_sglang.migrate.requests.handler import RequestMixin
from bana_sglang.migrate.transfer import Fail, TransferEngine, crc32
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = (
    0.005,
    0.2,
)  # a source polls its peer this often during a transfer (backing off)
# A peer's agent answers at its scheduler's batch boundaries: a long CPU batch
# (or a machine starved of cores) delays it by seconds. Silent this long: gone.
PEER_TIMEOUT_S = 30.0
# A remote step (one forward's layers on the peer) unanswered this long: the peer
# is taken as gone and the owner restores the layers (BANA_MIGRATE_STEP_TIMEOUT_S).
STEP_TIMEOUT_S = 30.0
MAX_PER_POLL = 64  # requests answered per scheduler iteration


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
    params: list = field(
        default_factory=list
    )  # source: (parameter, shape) of the layers, offer order
    guest_addrs: list[int] = field(default_factory=list)  # source: where the peer holds the weights
    pending: str = ""  # source: what the scheduler thread applies at the next boundary
    released_bytes: int = 0
    kind: str = "layers"  # or "kv" (KV-block migration)
    kv_pages: int = 0  # kv source: pages asked for, and the fewest per request
    kv_min_pages: int = 1
    req: object = None  # request source: the SGLang request while it stops
    t_copy: float = 0.0  # request source: when its pre-copy started
    handoff: tuple = ()  # request source: (prompt ids, answer ids) once handed off
    owner_endpoint: str = ""  # KV guest: the lender's agent (a Reclaim asks it to recall)
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def seconds(self) -> float:
        return (self.t_end or time.monotonic()) - self.t0

    def finish(self, state: str, reason: str = "", detail: str = "") -> None:
        self.state, self.reason, self.detail = state, reason, detail
        self.t_end = time.monotonic()

    def info(self, kv: dict | None = None) -> m.MigrationInfo:
        return m.MigrationInfo(
            migration=self.migration,
            side=self.side,
            peer=self.peer,
            start=self.start,
            stop=self.stop,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            seconds=round(self.seconds, 4),
            reason=self.reason,
            detail=self.detail,
            crc32=list(self.crc),
            tensors=list(self.names),
            executor=self.executor,
            released_bytes=self.released_bytes,
            kind=self.kind,
            kv=kv or {},
            **self._step_info(),
        )

    def _step_info(self) -> dict:
        span = self.span
        if span is None:
            return {}
        if self.side == "guest":
            return {
                "steps": span.steps,
                "guest_seconds": round(span.compute_s, 4),
                "guest_kv_bytes": span.kv_bytes,
            }
        st = span.stats
        return {
            "steps": st.steps,
            "remote_seconds": round(st.remote_s, 4),
            "guest_seconds": round(st.guest_s, 4),
            "shipped_rows": st.shipped_rows,
        }

    def reply(self, rid: int) -> m.Reply:
        if self.state == "failed" or self.state == "cancelled":
            return m.Failed(
                id=rid,
                migration=self.migration,
                reason=self.reason or self.state,
                detail=self.detail,
            )
        if self.state in m.TERMINAL:
            return m.Done(
                id=rid,
                migration=self.migration,
                state=self.state,
                bytes=self.bytes_done,
                seconds=round(self.seconds, 4),
            )
        return m.Progress(
            id=rid,
            migration=self.migration,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
        )


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
    "kv_migrations_started": "KV-block migrations this worker started as the lender",
    "kv_migrations_lost": "KV-block migrations whose host failed with pages on it",
    "kv_pages_moved": "KV pages this worker moved to peers (and freed here)",
    "kv_bytes_moved": "KV bytes this worker moved to peers",
    "kv_segments_recalled": "KV segments read back from peers by a recall",
    "kv_reclaims": "Recalls this KV host asked its lenders for (it needed its memory)",
    "request_migrations_started": "Live request migrations this worker accepted as the source",
    "requests_handed_off": "Running requests this worker stopped for the router to continue elsewhere",
}


# source states that hold nothing: the layers may be migrated again
_SETTLED = ("failed", "cancelled", "home", "restored")


class MigrationAgent(SwitchMixin, KVMixin, RequestMixin):
    """One worker's agent; see the module doc. ``layers`` is the model's list of
    decoder layers (``model.model.layers`` for SGLang's Llama)."""

    def __init__(
        self,
        name: str,
        role: str,
        layers: torch.nn.ModuleList,
        endpoint: str,
        *,
        te_host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        peer_timeout_s: float = PEER_TIMEOUT_S,
        worker: WorkerHandles | None = None,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ):
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
        self.handoffs: dict[str, _Migration] = {}  # rid -> its request migration
        self.metrics = CounterSet("bana_migrate", METRICS)
        self._closed = False
        logger.info(
            "migration agent of %s (%s, %d layers) on %s",
            name,
            role,
            self.num_layers,
            self.endpoint,
        )

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
        self._kv_close()
        self._sock.close(0)

    # ------------------------------------------------------------------ handlers
    def handle(self, req: m.Request) -> m.Reply:
        if isinstance(req, m.Ping):
            return m.Pong(
                id=req.id,
                worker=self.name,
                role=self.role,
                num_layers=self.num_layers,
                pid=os.getpid(),
            )
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
        if isinstance(req, m.MigrateKV):
            return self._migrate_kv(req)
        if isinstance(req, m.OpenKVHost):
            return self._open_kv_host(req)
        if isinstance(req, m.MigrateRequest):
            return self._migrate_request(req)
        if isinstance(req, m.Handoff):
            return self._handoff(req)
        if isinstance(req, m.Reclaim):
            return self._reclaim(req.id, req.reason or "asked")
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
            infos = [
                mig.info(self._kv_info(mig) if mig.kind == "kv" and mig.side == "source" else None)
                for mig in self.migrations.values()
            ]
            guest = sum(
                t.numel() * t.element_size() for mig in self.migrations.values() for t in mig.guest
            )
            guest += sum(
                mig.span.kv_bytes
                for mig in self.migrations.values()
                if mig.side == "guest" and mig.span is not None and mig.guest
            )
        hosted = self._kv_host.bytes_held if self._kv_host is not None else 0
        free = total = evictable = running = -1
        batch = (
            getattr(self.worker.scheduler, "running_batch", None)
            if self.worker is not None
            else None
        )
        movable = []
        if batch is not None:
            running = len(batch.reqs)
            movable = self.movable_requests(batch.reqs)
        if self.worker is not None and self.worker.allocator is not None:
            free = int(self.worker.allocator.available_size())
            total = int(self.worker.allocator.size)
            tree = getattr(self.worker.scheduler, "tree_cache", None)
            evictable = int(tree.evictable_size()) if tree is not None else -1
        return m.StatusResult(
            id=rid,
            worker=self.name,
            role=self.role,
            num_layers=self.num_layers,
            placement=self.placement(),
            migrations=infos,
            guest_bytes=guest + hosted,
            transfer_session=self._te.session if self._te else "",
            kv_free_tokens=free,
            kv_total_tokens=total,
            kv_evictable_tokens=evictable,
            kv_hosted_bytes=hosted,
            running_requests=running,
            movable=movable,
        )

    def _engine(self) -> TransferEngine:
        with self._te_lock:
            if self._te is None:
                self._te = TransferEngine(self.te_host, self.protocol, self.device)
                logger.info(
                    "migration agent of %s: transfer engine %s (%s)",
                    self.name,
                    self._te.session,
                    self.protocol,
                )
            return self._te

    # -- source side
    def _migrate(self, req: m.MigrateLayers) -> m.Reply:
        if not req.start < req.stop <= self.num_layers:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"layers [{req.start}, {req.stop}) are not a non-empty range of this "
                f"worker's {self.num_layers} layers",
            )
        if req.migration in self.migrations:
            return m.Error(
                id=req.id, reason="invalid", detail=f"migration id {req.migration!r} is taken"
            )
        busy = [
            x
            for x in self.migrations.values()
            if x.side == "source"
            and x.state not in _SETTLED
            and x.start < req.stop
            and req.start < x.stop
        ]
        if busy:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"layers overlap migration {busy[0].migration!r} "
                f"[{busy[0].start}, {busy[0].stop}) ({busy[0].state})",
            )
        if req.switch:
            why = (
                self.worker.why_not()
                if self.worker
                else "this agent has no model runner (not inside a worker)"
            )
            if why:
                return m.Error(
                    id=req.id, reason="invalid", detail=f"cannot switch the execution: {why}"
                )
            if self._lender is not None and self._lender.segments:
                return m.Error(
                    id=req.id,
                    reason="invalid",
                    detail="KV pages of this worker's requests are on a peer (KV-block migration); "
                    "the guest layers would read every KV slot, so recall them first",
                )
            away = [
                x
                for x in self.migrations.values()
                if x.side == "guest" and x.state == "serving" and x.kind == "layers"
            ]
            if away:
                return m.Error(
                    id=req.id,
                    reason="invalid",
                    detail=f"this worker executes guest layers ({away[0].migration!r}); "
                    "a worker either lends or hosts layers",
                )
        mig = _Migration(
            req.migration, "source", req.peer, req.start, req.stop, "accepted", switch=req.switch
        )
        with self._lock:
            self.migrations[req.migration] = mig
        self.metrics.add("migrations_started")
        self._work.submit(self._run_source, mig, req.peer)
        logger.info(
            "migration %s: layers [%d, %d) of %s -> %s accepted",
            mig.migration,
            mig.start,
            mig.stop,
            self.name,
            req.peer,
        )
        return m.Accepted(id=req.id, migration=req.migration)

    def _layer_tensors(self, start: int, stop: int) -> list[tuple[int, str, torch.Tensor]]:
        """The layers' parameters. Buffers (e.g. a rotary cos/sin cache) are derived
        from the config, which the peer shares, so they do not travel."""
        return [(i, name, p.data) for i, name, p in self._layer_params(start, stop)]

    def _layer_params(self, start: int, stop: int) -> list[tuple[int, str, torch.nn.Parameter]]:
        return [
            (i, name, p)
            for i in range(start, stop)
            for name, p in self.layers[i].named_parameters()
        ]

    def _run_source(self, mig: _Migration, peer: str) -> None:
        client = AgentClient(peer, timeout_s=self.peer_timeout_s, ctx=self._ctx)
        try:
            mig.state = "checksumming"
            tensors = self._layer_tensors(mig.start, mig.stop)
            if any(t.device.type != "cpu" or not t.is_contiguous() for _, _, t in tensors):
                raise Fail(
                    "invalid",
                    "layer migration reads CPU, contiguous parameters only (this worker's "
                    "are not); the CUDA path needs the CUDA transfer engine",
                )
            te = self._engine()
            descs = []
            for layer, name, t in tensors:
                te.register(t)
                descs.append(
                    m.TensorDesc(
                        layer=layer,
                        name=name,
                        dtype=str(t.dtype).removeprefix("torch."),
                        shape=list(t.shape),
                        addr=t.data_ptr(),
                        nbytes=t.numel() * t.element_size(),
                        crc32=crc32(t),
                    )
                )
            mig.crc = [d.crc32 for d in descs]
            mig.names = [f"{d.layer}.{d.name}" for d in descs]
            mig.bytes_total = sum(d.nbytes for d in descs)
            if mig.cancel.is_set():
                raise Fail("cancelled", "cancelled before the offer")
            mig.state = "offered"
            reply = self._ask(
                client,
                m.HostLayers,
                migration=mig.migration,
                owner=self.name,
                session=te.session,
                start=mig.start,
                stop=mig.stop,
                tensors=descs,
            )
            if not isinstance(reply, m.Accepted):
                raise Fail("peer_refused", describe(reply))
            mig.state = "transferring"
            wait = WATCH_INTERVAL_S[0]
            while True:
                if mig.cancel.is_set():
                    self._drop_at_peer(client, mig)
                    raise Fail("cancelled", "cancelled during the transfer")
                reply = self._ask(client, m.Watch, migration=mig.migration)
                if isinstance(reply, m.Progress):
                    mig.bytes_done = reply.bytes_done
                elif isinstance(reply, m.Done):
                    mig.bytes_done = reply.bytes
                    break
                else:
                    raise Fail(
                        reply.reason if isinstance(reply, (m.Failed, m.Error)) else "internal",
                        "peer: " + describe(reply),
                    )
                time.sleep(wait)
                wait = min(WATCH_INTERVAL_S[1], wait * 2)
            self.metrics.add("migrations_staged")
            self.metrics.add("sent_bytes", mig.bytes_done)
            logger.info(
                "migration %s: layers [%d, %d) staged on %s: %.1f MB verified in %.2fs (%.1f MB/s)",
                mig.migration,
                mig.start,
                mig.stop,
                mig.peer,
                mig.bytes_done / 1e6,
                mig.seconds,
                mig.bytes_done / 1e6 / max(mig.seconds, 1e-9),
            )
            if mig.switch:
                self._prepare_switch(mig, client)
            else:
                mig.finish("staged")
        except Fail as f:
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
            raise Fail("peer_unreachable", str(e)) from None

    def _drop_at_peer(self, client: AgentClient, mig: _Migration) -> None:
        with contextlib.suppress(Fail):
            self._ask(client, m.DropGuest, migration=mig.migration)

    def _cancel(self, req: m.Cancel) -> m.Reply:
        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != "source":
            return self._unknown(req.id, req.migration)
        if mig.state in _SETTLED or mig.state == "handed_off":
            return m.Ok(id=req.id, note=f"already {mig.state}")
        if mig.state == "stopping":
            return m.Ok(
                id=req.id, note="too late: the request stops at this boundary and is handed off"
            )
        if mig.state == "remote":  # switched: cancelling brings the layers home
            return self._recall(m.Recall(id=req.id, deadline=req.deadline, migration=req.migration))
        if mig.state == "recalling":
            return m.Ok(id=req.id, note="already recalling")
        mig.cancel.set()
        if mig.state == "staged":  # done: ask the peer to free its copy, off the scheduler thread
            mig.finish("cancelled", "cancelled", "cancelled after staging; the peer drops its copy")
            self._work.submit(self._drop_remote, mig)
        return m.Ok(id=req.id, note="cancelling")

    # -- guest side
    def _host(self, req: m.HostLayers) -> m.Reply:
        if req.migration in self.migrations:
            return m.Error(
                id=req.id, reason="invalid", detail=f"migration id {req.migration!r} is taken"
            )
        if not req.start < req.stop <= self.num_layers:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"layers [{req.start}, {req.stop}) do not exist in this worker's model",
            )
        mine = {(i, n): t for i, n, t in self._layer_tensors(req.start, req.stop)}
        for d in req.tensors:
            own = mine.get((d.layer, d.name))
            if (
                own is None
                or list(own.shape) != d.shape
                or str(own.dtype).removeprefix("torch.") != d.dtype
            ):
                return m.Error(
                    id=req.id,
                    reason="invalid",
                    detail=f"layer {d.layer} {d.name} {d.dtype}{d.shape} does not match this worker's "
                    "model (layer migration needs the same architecture)",
                )
        mig = _Migration(
            req.migration,
            "guest",
            req.owner,
            req.start,
            req.stop,
            "pulling",
            bytes_total=sum(d.nbytes for d in req.tensors),
            names=[f"{d.layer}.{d.name}" for d in req.tensors],
        )
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
                    raise Fail("cancelled", "dropped by its owner during the transfer")
                idx = [i for i, d in enumerate(req.tensors) if d.layer == layer and d.nbytes]
                if idx:
                    te.read(req.session, [area[i] for i in idx], [req.tensors[i].addr for i in idx])
                    mig.bytes_done += sum(req.tensors[i].nbytes for i in idx)
            mig.crc = [crc32(t) for t in area]
            bad = [d.name for d, got in zip(req.tensors, mig.crc) if got != d.crc32]
            if bad:
                raise Fail(
                    "checksum",
                    f"{len(bad)} tensors differ from the owner's checksum, e.g. {bad[0]}",
                )
            mig.finish("verified")
            self.metrics.add("guest_bytes_received", mig.bytes_done)
            logger.info(
                "guest layers [%d, %d) of %s verified: %.1f MB in %.2fs",
                req.start,
                req.stop,
                req.owner,
                mig.bytes_done / 1e6,
                mig.seconds,
            )
        except Fail as f:
            self._free_guest(mig)
            mig.finish("dropped" if f.reason == "cancelled" else "failed", f.reason, f.detail)
        except Exception as e:
            self._free_guest(mig)
            mig.finish("failed", "transfer", f"{type(e).__name__}: {e}")
            logger.warning("guest layers of %s (%s) failed: %s", req.owner, mig.migration, e)

    def _free_guest(self, mig: _Migration) -> None:
        if mig.side == "guest" and mig.span is not None and mig.guest:
            mig.span.close()
        area, mig.guest = mig.guest, []
        if area and self._te is not None:
            for t in area:
                self._te.unregister(t)
