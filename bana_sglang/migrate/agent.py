"""The per-worker migration agent: a ZMQ endpoint inside the SGLang scheduler.

The scheduler calls :meth:`MigrationAgent.poll` once per loop iteration (a
plugin hook on ``Scheduler.process_input_requests``, i.e. at every batch
boundary). ``poll`` first applies what the worker thread left pending for the
scheduler thread (layer modules to swap, KV pages to move, a request to stop),
then answers every waiting request without blocking: commands are validated
and recorded there, and bulk work (checksums, transfer-engine reads) runs on
the agent's own worker thread, whose progress later polls and ``Watch``
requests read. The scheduler loop never waits on a transfer.

The agent composes one handler per mechanism, each given the shared
:class:`~bana_sglang.migrate.services.Services`:
:class:`~bana_sglang.migrate.layers.handler.LayerMigrations` (staging and the
execution switch), :class:`~bana_sglang.migrate.kv.handler.KVMigrations`
(KV-block lender and host) and
:class:`~bana_sglang.migrate.requests.handler.RequestMigrations` (live
request migration). :data:`METRICS` are its counters.

Invariants: every request gets exactly one reply (the
:class:`~bana_sglang.wire.transport.Server` answers a malformed, unknown,
wrong-version or stale request with its reason and never executes it); an
exception while handling one becomes an ``internal`` error reply (logged
with its traceback) and the agent keeps running.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from bana_sglang.counters import CounterSet
from bana_sglang.migrate.config import MigrateConfig
from bana_sglang.migrate.kv.handler import KVMigrations
from bana_sglang.migrate.layers.handler import LayerMigrations
from bana_sglang.migrate.records import KVMigration, LayerMigration, Migration
from bana_sglang.migrate.requests.handler import RequestMigrations
from bana_sglang.migrate.services import Services, WorkerHandles
from bana_sglang.migrate.states import SETTLED, Pending, Side, State
from bana_sglang.migrate.transfer import TransferEngine, crc32
from bana_sglang.wire import agent as m
from bana_sglang.wire.transport import Server

__all__ = ["METRICS", "MigrationAgent", "TransferEngine", "WorkerHandles", "crc32"]

logger = logging.getLogger(__name__)

#: states in which a migration holds nothing on this worker and runs nothing
AT_REST = frozenset(
    {State.HOME, State.RESTORED, State.FAILED, State.CANCELLED, State.DROPPED, State.HANDED_OFF}
)

MAX_PER_POLL = 64  # requests answered per scheduler iteration

METRICS = {
    "migrations_started": "Layer migrations this worker started as the source",
    "migrations_staged": "Layer migrations that ended staged (the peer verified its copy)",
    "migrations_failed": "Layer migrations that failed or were cancelled (source side)",
    "sent_bytes": "Layer bytes peers read from this worker and verified",
    "guest_bytes_received": "Layer bytes this worker read for other workers and verified",
    "rejected_requests": (
        "Control messages refused (malformed, unknown type or version, stale, invalid)"
    ),
    "migrations_switched": "Layer migrations whose layers this worker then ran on the peer",
    "migrations_recalled": "Switched layer migrations brought home by a recall",
    "migrations_restored": (
        "Switched layer migrations restored from the checkpoint after the peer failed"
    ),
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
    "requests_handed_off": (
        "Running requests this worker stopped for the router to continue elsewhere"
    ),
}


class MigrationAgent:
    """One worker's agent; see the module doc. ``layers`` is the model's list of
    decoder layers (``model.model.layers`` for SGLang's Llama)."""

    def __init__(
        self,
        name: str,
        role: str,
        layers: torch.nn.ModuleList,
        endpoint: str,
        *,
        config: MigrateConfig | None = None,
        worker: WorkerHandles | None = None,
    ):
        self.name, self.role, self.layers = name, role, layers
        self.num_layers = len(layers)
        self.config = config or MigrateConfig()
        self.worker = worker
        self.metrics = CounterSet("bana_migrate", METRICS)
        self.services = sv = Services(name, role, layers, self.config, worker, self.metrics)
        self.kv = KVMigrations(sv)
        self.layer_migrations = LayerMigrations(sv, kv_pages_away=self.kv.pages_away)
        self.requests = RequestMigrations(sv)
        switch = self.layer_migrations.switch
        # what the scheduler thread applies at a batch boundary
        self._appliers = {
            Pending.INSTALL: switch.install,
            Pending.HOME: switch.come_home,
            Pending.CHECKPOINT: switch.reload_home,
            Pending.KV_MOVE: self.kv.move,
            Pending.KV_RECALL: self.kv.recall_now,
            Pending.REQ_STOP: self.requests.stop,
        }
        handlers = {
            m.Ping: self._ping,
            m.Status: lambda req: self.status(req.id),
            m.MigrateLayers: self.layer_migrations.migrate,
            m.Watch: self._watch,
            m.Cancel: self._cancel,
            m.HostLayers: self.layer_migrations.host,
            m.DropGuest: self.layer_migrations.drop_guest,
            m.Recall: self._recall,
            m.OpenGuest: switch.open_guest,
            m.MigrateKV: self.kv.migrate,
            m.OpenKVHost: self.kv.open_host,
            m.MigrateRequest: self.requests.migrate,
            m.Handoff: self.requests.handoff,
            m.Reclaim: self.kv.reclaim,
        }
        self._server = Server(
            m.CHANNEL,
            {cls: self._counted(fn) for cls, fn in handlers.items()},
            bind=endpoint,
            on_reject=self._rejected,
            ctx=sv.ctx,
        )
        self.endpoint = sv.endpoint = self._server.endpoint
        logger.info(
            "migration agent of %s (%s, %d layers) on %s",
            name,
            role,
            self.num_layers,
            self.endpoint,
        )

    @property
    def migrations(self) -> dict[str, Migration]:
        """Every migration this worker took part in, by id."""
        return self.services.migrations

    # ------------------------------------------------------------------ loop
    def poll(self) -> int:
        """Apply what is pending, then answer every waiting request (at most
        MAX_PER_POLL); never blocks."""
        self._apply_pending()
        return self._server.poll(MAX_PER_POLL)

    @property
    def socket(self):
        """The agent's listening socket: an idle scheduler waits on it with its own."""
        return self._server.socket

    def busy(self) -> bool:
        """Whether a migration is under way or holds something here (its scheduler
        then keeps its short idle wait: work lands between commands, not on a socket)."""
        return any(mig.state not in AT_REST for mig in list(self.migrations.values()))

    def serve_forever(self, stop: threading.Event, interval_s: float = 0.005) -> None:
        """Run :meth:`poll` on the calling thread until ``stop`` (tests, tools)."""
        while not stop.is_set():
            if not self.poll():
                stop.wait(interval_s)

    def close(self) -> None:
        sv = self.services
        if sv.closed:
            return
        sv.closed = True
        for mig in list(sv.migrations.values()):
            mig.cancel.set()
        sv.work.shutdown(wait=True, cancel_futures=True)
        self.layer_migrations.close()
        self.kv.close()
        self._server.close()

    def _apply_pending(self) -> None:
        """Scheduler thread, at a batch boundary."""
        for mig in list(self.migrations.values()):
            if mig.side != Side.SOURCE or mig.pending is None:
                continue
            with mig.lock:
                action, mig.pending = mig.pending, None
                try:
                    self._appliers[action](mig)
                except Exception as e:
                    logger.exception("migration %s: %s failed", mig.migration, action)
                    mig.finish(State.FAILED, "internal", f"{action}: {type(e).__name__}: {e}")
        self.kv.settle()
        self.kv.host_pressure()
        self.requests.settle()

    # ------------------------------------------------------------------ requests
    def _counted(self, handler):
        """``handler``, with its ``invalid`` refusals counted as rejected requests."""

        def answer(req: m.Request) -> m.Reply:
            reply = handler(req)
            if isinstance(reply, m.Error) and reply.reason == "invalid":
                self.metrics.add("rejected_requests")
            return reply

        return answer

    def _rejected(self, err: m.Error) -> None:
        logger.warning("rejected a request (%s): %s", err.reason, err.detail)
        self.metrics.add("rejected_requests")

    def _ping(self, req: m.Ping) -> m.Reply:
        return m.Pong(
            id=req.id,
            worker=self.name,
            role=self.role,
            num_layers=self.num_layers,
            pid=os.getpid(),
        )

    def _watch(self, req: m.Watch) -> m.Reply:
        mig = self.migrations.get(req.migration)
        return mig.reply(req.id) if mig else self.services.unknown(req.id, req.migration)

    def _cancel(self, req: m.Cancel) -> m.Reply:
        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != Side.SOURCE:
            return self.services.unknown(req.id, req.migration)
        if mig.state in SETTLED or mig.state == State.HANDED_OFF:
            return m.Ok(id=req.id, note=f"already {mig.state}")
        if mig.state == State.STOPPING:
            return m.Ok(
                id=req.id, note="too late: the request stops at this boundary and is handed off"
            )
        if mig.state == State.REMOTE:  # switched (or KV pages out): cancelling brings them home
            return self._recall(m.Recall(id=req.id, deadline=req.deadline, migration=req.migration))
        if mig.state == State.RECALLING:
            return m.Ok(id=req.id, note="already recalling")
        mig.cancel.set()
        if mig.state == State.STAGED:  # done: ask the peer to free its copy
            self.layer_migrations.cancel_staged(mig)
        return m.Ok(id=req.id, note="cancelling")

    def _recall(self, req: m.Recall) -> m.Reply:
        mig = self.migrations.get(req.migration)
        if mig is None or mig.side != Side.SOURCE:
            return self.services.unknown(req.id, req.migration)
        if isinstance(mig, KVMigration):
            return self.kv.recall(req, mig)
        if not isinstance(mig, LayerMigration):
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"migration {req.migration!r} is {mig.state}, not remote: nothing to recall",
            )
        return self.layer_migrations.switch.recall(req, mig)

    def status(self, rid: int) -> m.StatusResult:
        sv, w = self.services, self.worker
        with sv.lock:
            infos = [
                mig.info(
                    self.kv.stats(mig)
                    if isinstance(mig, KVMigration) and mig.side == Side.SOURCE
                    else None
                )
                for mig in sv.migrations.values()
            ]
            guest = self.layer_migrations.guest_bytes()
        hosted = self.kv.hosted_bytes()
        free = total = evictable = running = -1
        batch = getattr(w.scheduler, "running_batch", None) if w is not None else None
        movable = []
        if batch is not None:
            running = len(batch.reqs)
            movable = self.requests.movable_requests(batch.reqs)
        if w is not None and w.allocator is not None:
            free = int(w.allocator.available_size())
            total = int(w.allocator.size)
            tree = getattr(w.scheduler, "tree_cache", None)
            evictable = int(tree.evictable_size()) if tree is not None else -1
        return m.StatusResult(
            id=rid,
            worker=self.name,
            role=self.role,
            num_layers=self.num_layers,
            placement=self.layer_migrations.placement(),
            migrations=infos,
            guest_bytes=guest + hosted,
            transfer_session=sv.te.session if sv.te else "",
            kv_free_tokens=free,
            kv_total_tokens=total,
            kv_evictable_tokens=evictable,
            kv_hosted_bytes=hosted,
            running_requests=running,
            movable=movable,
        )
