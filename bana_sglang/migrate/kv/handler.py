"""KV-block migration in the agent: both sides' handlers.

Lender (D, ``MigrateKV``): the worker thread asks the peer's agent to open its
KV host (``OpenKVHost``); at the next batch boundary the scheduler thread picks
the pages, copies them to the host and frees them
(:class:`~bana_sglang.migrate.kv.lender.KVLender`). The migration is ``remote``
while any of its segments is on the host and ``home`` once every one came back
(recall or request end); ``failed`` (``peer_lost``) when the host failed with
segments on it.

Host (H, ``OpenKVHost``): one :class:`~bana_sglang.migrate.kv.host.KVHost` per
worker serves every lender on its own thread. When H's own KV pool runs low it
asks its lenders to recall (``Reclaim``, also sent by an operator).
"""

from __future__ import annotations

import logging
import time

from bana_sglang.attention.remote import remote_kv, set_remote_kv
from bana_sglang.migrate.errors import TransferError
from bana_sglang.migrate.kv.host import KVHost
from bana_sglang.migrate.kv.lender import KVLender, KVLost
from bana_sglang.migrate.records import KVMigration, LayerMigration
from bana_sglang.migrate.services import Services
from bana_sglang.migrate.states import Pending, Side, State
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

logger = logging.getLogger(__name__)

# A KV host short of memory asks its lenders to recall at most this often.
RECLAIM_EVERY_S = 5.0
# the states of a KV source migration with segments on the host
_OUT = (State.REMOTE, State.RECALLING)


class KVMigrations:
    """The agent's KV-block migration handlers: this worker's lender and its host."""

    def __init__(self, services: Services):
        self.sv = services
        self.lender: KVLender | None = None
        self.host: KVHost | None = None
        self._last_reclaim = -1e9

    def pages_away(self) -> bool:
        """KV pages of this worker's requests are on a peer."""
        return self.lender is not None and bool(self.lender.segments)

    def hosted_bytes(self) -> int:
        return self.host.bytes_held if self.host is not None else 0

    # -- lender
    def _why_not(self) -> str:
        sv = self.sv
        w = sv.worker
        if w is None:
            return "this agent has no model runner (not inside a worker)"
        why = w.why_not()
        if why:
            return why
        sched = w.scheduler
        if sched is None:
            return "the agent has no handle on the scheduler"
        if sv.role != "decode":
            return (
                f"this is a {sv.role} worker: KV-block migration moves pages of running decode "
                "requests"
            )
        if not getattr(sched, "enable_overlap", False):
            return (
                "the overlap scheduler is off (--disable-overlap-schedule): a request whose KV "
                "host fails must end before its step's token is committed, which needs it"
            )
        away = [
            x
            for x in sv.migrations.values()
            if isinstance(x, LayerMigration)
            and x.side == Side.SOURCE
            and x.state in (State.SWITCHING, State.REMOTE, State.RECALLING)
        ]
        if away:
            return (
                f"layers of this worker run elsewhere ({away[0].migration!r}); their guest reads "
                "every KV slot of a request, so KV pages cannot leave at the same time"
            )
        return ""

    def migrate(self, req: m.MigrateKV) -> m.Reply:
        sv = self.sv
        why = self._why_not()
        if why:
            return m.Error(id=req.id, reason="invalid", detail=f"cannot migrate KV blocks: {why}")
        if taken := sv.taken(req.id, req.migration):
            return taken
        if req.peer == sv.endpoint:
            return m.Error(id=req.id, reason="invalid", detail="the peer is this worker")
        if self.lender is None:
            w = sv.worker
            self.lender = KVLender(
                w.kv_pool,
                w.req_to_token,
                w.allocator,
                w.scheduler.tree_cache,
                sv.engine(),
                num_layers=sv.num_layers,
                scheduler=w.scheduler,
                timeout_s=sv.config.kv_timeout_s,
            )
            set_remote_kv(self.lender)  # the bana_cpu backend's decode plan reads it
        mig = KVMigration(
            migration=req.migration,
            side=Side.SOURCE,
            peer=req.peer,
            state=State.ACCEPTED,
            pages=req.pages,
            min_pages=req.min_pages,
        )
        sv.add(mig)
        sv.metrics.add("kv_migrations_started")
        sv.work.submit(self._open_peer, mig)
        logger.info(
            "KV-block migration %s: up to %d pages of %s -> %s accepted",
            mig.migration,
            req.pages,
            sv.name,
            req.peer,
        )
        return m.Accepted(id=req.id, migration=req.migration)

    def _open_peer(self, mig: KVMigration) -> None:
        """Worker thread: have the peer open its KV host; the move happens at a boundary."""
        sv = self.sv
        client = sv.peer(mig.peer)
        try:
            mig.state = State.OFFERED
            reply = sv.ask(
                client,
                m.OpenKVHost,
                migration=mig.migration,
                owner=sv.name,
                layers=sv.num_layers,
                owner_endpoint=sv.endpoint,
            )
            if not isinstance(reply, m.KVHostOpened):
                raise TransferError("peer_refused", "opening the KV host: " + describe(reply))
            mig.executor = reply.worker
            self.lender.open_peer(mig.migration, reply.endpoint, reply.session)
            with mig.lock:
                mig.pending = Pending.KV_MOVE
        except TransferError as f:
            mig.finish(State.FAILED, f.reason, f.detail)
            sv.metrics.add("migrations_failed")
            logger.warning("KV-block migration %s failed: %s %s", mig.migration, f.reason, f.detail)
        except Exception as e:
            mig.finish(State.FAILED, "internal", f"{type(e).__name__}: {e}")
            logger.exception("KV-block migration %s failed", mig.migration)
        finally:
            client.close()

    def move(self, mig: KVMigration) -> None:
        """Scheduler thread (``Pending.KV_MOVE``): pick the pages and move them."""
        sv, lender = self.sv, self.lender
        if mig.cancel.is_set():
            mig.finish(State.CANCELLED, "cancelled", "cancelled before the move")
            lender.close_peer(mig.migration)
            return
        reqs = list(getattr(sv.worker.scheduler.running_batch, "reqs", None) or [])
        picks = lender.pick(reqs, mig.pages, mig.min_pages)
        if not picks:
            mig.finish(
                State.FAILED,
                "invalid",
                f"no running request has {mig.min_pages} complete page(s) of "
                f"its own to move ({len(reqs)} running)",
            )
            sv.metrics.add("migrations_failed")
            lender.close_peer(mig.migration)
            return
        mig.state = State.TRANSFERRING
        try:
            st = lender.move(mig.migration, picks)
        except KVLost as e:
            mig.finish(State.FAILED, "peer_unreachable", str(e))
            sv.metrics.add("migrations_failed")
            lender.close_peer(mig.migration)
            return
        mig.bytes_total = mig.bytes_done = st.bytes_out
        mig.released_bytes = st.bytes_out
        mig.finish(State.REMOTE)
        sv.metrics.add("kv_pages_moved", st.pages)
        sv.metrics.add("kv_bytes_moved", st.bytes_out)
        logger.info(
            "KV-block migration %s: %d pages of %d requests (%.1f MB) now on %s; copy stalled "
            "decoding %.1f ms",
            mig.migration,
            st.pages,
            st.segments,
            st.bytes_out / 1e6,
            mig.executor,
            1e3 * st.move_s,
        )

    def recall_now(self, mig: KVMigration) -> None:
        """Scheduler thread (``Pending.KV_RECALL``): read back what fits in free pages."""
        done, left = self.lender.recall_migration(mig.migration)
        self.sv.metrics.add("kv_segments_recalled", done)
        mig.detail = f"{left} segment(s) wait for free pages or their request's end" if left else ""
        logger.info(
            "KV-block migration %s: recalled %d segment(s), %d left", mig.migration, done, left
        )

    def settle(self) -> None:
        """Scheduler thread: end KV migrations whose segments are all home, or lost."""
        lender = self.lender
        if lender is None:
            return
        for mig in self.sv.migrations.values():
            if not isinstance(mig, KVMigration) or mig.side != Side.SOURCE or mig.state not in _OUT:
                continue
            if lender.lost_in(mig.migration):
                mig.finish(
                    State.FAILED,
                    "peer_lost",
                    f"the KV host failed ({lender.lost_hosts[mig.migration]}); "
                    "its requests ended with an error",
                )
                self.sv.metrics.add("kv_migrations_lost")
            elif not lender.active(mig.migration):
                st = lender.stats[mig.migration]
                mig.finish(State.HOME, "", f"{st.recalled} recalled, {st.dropped} dropped")
            else:
                continue
            lender.close_peer(mig.migration)  # its buffers and socket; lost segments release later

    def recall(self, req: m.Recall, mig: KVMigration) -> m.Reply:
        if mig.state not in _OUT:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"KV-block migration {req.migration!r} is {mig.state}: nothing to recall",
            )
        mig.state = State.RECALLING
        with mig.lock:
            mig.pending = Pending.KV_RECALL
        return m.Accepted(id=req.id, migration=req.migration)

    def stats(self, mig: KVMigration) -> dict:
        """A source migration's lender statistics (``MigrationInfo.kv``)."""
        if self.lender is None or mig.migration not in self.lender.stats:
            return {}
        d = self.lender.stats[mig.migration].as_dict()
        d["remote_segments"] = self.lender.active(mig.migration)
        return d

    # -- host
    def open_host(self, req: m.OpenKVHost) -> m.Reply:
        sv = self.sv
        if req.layers != sv.num_layers:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"{req.owner} has {req.layers} layers, this worker {sv.num_layers}: "
                "KV pages need the same model",
            )
        existing = sv.migrations.get(req.migration)
        if existing is not None and existing.side != Side.GUEST:
            return sv.taken(req.id, req.migration)
        if self.host is None:
            self.host = KVHost(sv.engine(), sv.config.te_host, sv.name)
        self.host.open(req.migration, req.owner, req.layers)
        if existing is None:
            sv.add(
                KVMigration(
                    migration=req.migration,
                    side=Side.GUEST,
                    peer=req.owner,
                    state=State.SERVING,
                    owner_endpoint=req.owner_endpoint,
                )
            )
        return m.KVHostOpened(
            id=req.id,
            migration=req.migration,
            worker=sv.name,
            endpoint=self.host.endpoint,
            session=sv.engine().session,
        )

    def reclaim(self, req: m.Reclaim) -> m.Reply:
        return self._reclaim(req.id, req.reason or "asked")

    def _reclaim(self, rid: int, reason: str) -> m.Reply:
        """This worker needs its memory: ask the lenders of the pages it hosts to recall them."""
        sv = self.sv
        held = self.host.info() if self.host is not None else {}
        asks = [
            mig
            for mid, mig in sv.migrations.items()
            if isinstance(mig, KVMigration)
            and mig.side == Side.GUEST
            and held.get(mid, {}).get("segments")
        ]
        if not asks:
            return m.Ok(id=rid, note="this worker hosts no KV pages")
        blind = [mig.migration for mig in asks if not mig.owner_endpoint]
        for mig in asks:
            if mig.owner_endpoint:
                sv.work.submit(self._ask_recall, mig, reason)
        sv.metrics.add("kv_reclaims", len(asks) - len(blind))
        note = f"asked {len(asks) - len(blind)} lender migration(s) to recall ({reason})"
        if blind:
            note += f"; {', '.join(blind)} did not say where their lender's agent is"
        return m.Ok(id=rid, note=note)

    def _ask_recall(self, mig: KVMigration, reason: str) -> None:
        """Worker thread: one recall request to a lender."""
        sv = self.sv
        client = sv.peer(mig.owner_endpoint)
        try:
            reply = client.call(m.Recall, migration=mig.migration)
            logger.info(
                "KV host %s: asked %s to recall %s (%s): %s",
                sv.name,
                mig.peer,
                mig.migration,
                reason,
                describe(reply),
            )
        except Exception as e:  # the lender may be gone: its segments are dropped when it closes
            logger.warning(
                "KV host %s: could not ask %s to recall %s: %s", sv.name, mig.peer, mig.migration, e
            )
        finally:
            client.close()

    def host_pressure(self) -> None:
        """Scheduler thread: reclaim when this worker's own KV pool runs low while it hosts
        pages."""
        host, w = self.host, self.sv.worker
        if host is None or w is None or w.allocator is None or not host.bytes_held:
            return
        now = time.monotonic()
        if now - self._last_reclaim < RECLAIM_EVERY_S:
            return
        total = max(1, int(w.allocator.size))
        free = int(w.allocator.available_size())
        tree = getattr(w.scheduler, "tree_cache", None) if w.scheduler is not None else None
        free += int(tree.evictable_size()) if tree is not None else 0
        if free / total < self.sv.config.kv_reclaim_below:
            self._last_reclaim = now
            self._reclaim(0, f"its KV pool is {1 - free / total:.0%} used")

    def close(self) -> None:
        if self.lender is not None:
            if remote_kv() is self.lender:
                set_remote_kv(None)
            self.lender.close()
        if self.host is not None:
            self.host.close()
