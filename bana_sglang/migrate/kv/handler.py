"""KV-block migration in the migration agent, as a mixin of :class:`~.agent.MigrationAgent`.

Lender (D, ``MigrateKV``): the worker thread asks the peer's agent to open its
KV host (``OpenKVHost``); at the next batch boundary the scheduler thread picks
the pages, copies them to the host and frees them (:class:`~.kvlend.KVLender`).
The migration is ``remote`` while any of its segments is on the host and
``home`` once every one came back (recall or request end); ``failed``
(``peer_lost``) when the host failed with segments on it.

Host (H, ``OpenKVHost``): one :class:`~.kvhost.KVHost` per worker serves every
lender on its own thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from bana_sglang import envs
from bana_sglang.attention.remote import remote_kv, set_remote_kv
from bana_sglang.migrate.client import AgentClient
from bana_sglang.migrate.kv import lender as kvlend
from bana_sglang.migrate.transfer import Fail
from bana_sglang.wire import agent as m
from bana_sglang.wire.agent import describe

if TYPE_CHECKING:
    from bana_sglang.migrate.agent import _Migration

logger = logging.getLogger("bana_sglang.migrate.agent")


# A KV host whose own pool has less than this fraction free (free + evictable) asks
# its lenders to recall, at most every RECLAIM_EVERY_S.
RECLAIM_EVERY_S = 5.0


class KVMixin:
    """The agent supplies ``migrations``, ``worker``, ``metrics``, ``_work``, ``_engine``, ``_ask``."""

    _lender: kvlend.KVLender | None = None
    _kv_host = None
    _last_reclaim = -1e9

    @property
    def reclaim_below(self) -> float:
        """A KV host asks for its memory back below this free share (``BANA_KV_HOST_RECLAIM_BELOW``)."""
        return envs.BANA_KV_HOST_RECLAIM_BELOW.get()

    # ------------------------------------------------------------------ lender
    def _why_not_kv(self) -> str:
        w = self.worker
        if w is None:
            return "this agent has no model runner (not inside a worker)"
        why = w.why_not()
        if why:
            return why
        sched = w.scheduler
        if sched is None:
            return "the agent has no handle on the scheduler"
        if self.role != "decode":
            return f"this is a {self.role} worker: KV-block migration moves pages of running decode requests"
        if not getattr(sched, "enable_overlap", False):
            return (
                "the overlap scheduler is off (--disable-overlap-schedule): a request whose KV host fails "
                "must end before its step's token is committed, which needs it"
            )
        away = [
            x
            for x in self.migrations.values()
            if x.side == "source"
            and x.kind == "layers"
            and x.state in ("switching", "remote", "recalling")
        ]
        if away:
            return (
                f"layers of this worker run elsewhere ({away[0].migration!r}); their guest reads every "
                "KV slot of a request, so KV pages cannot leave at the same time"
            )
        return ""

    def _migrate_kv(self, req: m.MigrateKV) -> m.Reply:
        from bana_sglang.migrate.agent import _Migration

        why = self._why_not_kv()
        if why:
            return m.Error(id=req.id, reason="invalid", detail=f"cannot migrate KV blocks: {why}")
        if req.migration in self.migrations:
            return m.Error(
                id=req.id, reason="invalid", detail=f"migration id {req.migration!r} is taken"
            )
        if req.peer == self.endpoint:
            return m.Error(id=req.id, reason="invalid", detail="the peer is this worker")
        if self._lender is None:
            w = self.worker
            self._lender = kvlend.KVLender(
                w.kv_pool,
                w.req_to_token,
                w.allocator,
                w.scheduler.tree_cache,
                self._engine(),
                num_layers=self.num_layers,
                scheduler=w.scheduler,
                timeout_s=envs.BANA_KV_STEP_TIMEOUT_S.get() or self.step_timeout_s,
            )
            set_remote_kv(self._lender)  # the bana_cpu backend's decode plan reads it
        mig = _Migration(req.migration, "source", req.peer, 0, 0, "accepted", kind="kv")
        mig.kv_pages, mig.kv_min_pages = req.pages, req.min_pages
        with self._lock:
            self.migrations[req.migration] = mig
        self.metrics.add("kv_migrations_started")
        self._work.submit(self._open_kv_peer, mig)
        logger.info(
            "KV-block migration %s: up to %d pages of %s -> %s accepted",
            mig.migration,
            req.pages,
            self.name,
            req.peer,
        )
        return m.Accepted(id=req.id, migration=req.migration)

    def _open_kv_peer(self, mig: _Migration) -> None:
        """Worker thread: have the peer open its KV host; the move happens at a boundary."""
        client = AgentClient(mig.peer, timeout_s=self.peer_timeout_s, ctx=self._ctx)
        try:
            mig.state = "offered"
            reply = self._ask(
                client,
                m.OpenKVHost,
                migration=mig.migration,
                owner=self.name,
                layers=self.num_layers,
                owner_endpoint=self.endpoint,
            )
            if not isinstance(reply, m.KVHostOpened):
                raise Fail("peer_refused", "opening the KV host: " + describe(reply))
            mig.executor = reply.worker
            self._lender.open_peer(mig.migration, reply.endpoint, reply.session)
            with mig.lock:
                mig.pending = "kv_move"
        except Fail as f:
            mig.finish("failed", f.reason, f.detail)
            self.metrics.add("migrations_failed")
            logger.warning("KV-block migration %s failed: %s %s", mig.migration, f.reason, f.detail)
        except Exception as e:
            mig.finish("failed", "internal", f"{type(e).__name__}: {e}")
            logger.exception("KV-block migration %s failed", mig.migration)
        finally:
            client.close()

    def _kv_apply(self, mig: _Migration, action: str) -> None:
        """Scheduler thread, at a batch boundary."""
        lender = self._lender
        if action == "kv_move":
            if mig.cancel.is_set():
                mig.finish("cancelled", "cancelled", "cancelled before the move")
                lender.close_peer(mig.migration)
                return
            reqs = list(getattr(self.worker.scheduler.running_batch, "reqs", None) or [])
            picks = lender.pick(reqs, mig.kv_pages, mig.kv_min_pages)
            if not picks:
                mig.finish(
                    "failed",
                    "invalid",
                    f"no running request has {mig.kv_min_pages} complete page(s) of "
                    f"its own to move ({len(reqs)} running)",
                )
                self.metrics.add("migrations_failed")
                lender.close_peer(mig.migration)
                return
            mig.state = "transferring"
            try:
                st = lender.move(mig.migration, picks)
            except kvlend.KVLost as e:
                mig.finish("failed", "peer_unreachable", str(e))
                self.metrics.add("migrations_failed")
                lender.close_peer(mig.migration)
                return
            mig.bytes_total = mig.bytes_done = st.bytes_out
            mig.released_bytes = st.bytes_out
            mig.finish("remote")
            self.metrics.add("kv_pages_moved", st.pages)
            self.metrics.add("kv_bytes_moved", st.bytes_out)
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
        elif action == "kv_recall":
            done, left = lender.recall_migration(mig.migration)
            self.metrics.add("kv_segments_recalled", done)
            mig.detail = (
                f"{left} segment(s) wait for free pages or their request's end" if left else ""
            )
            logger.info(
                "KV-block migration %s: recalled %d segment(s), %d left", mig.migration, done, left
            )

    def _kv_settle(self) -> None:
        """Scheduler thread: end KV migrations whose segments are all home, or lost."""
        lender = self._lender
        if lender is None:
            return
        for mig in self.migrations.values():
            if mig.kind != "kv" or mig.side != "source" or mig.state not in ("remote", "recalling"):
                continue
            if lender.lost_in(mig.migration):
                mig.finish(
                    "failed",
                    "peer_lost",
                    f"the KV host failed ({lender.lost_hosts[mig.migration]}); "
                    "its requests ended with an error",
                )
                self.metrics.add("kv_migrations_lost")
            elif not lender.active(mig.migration):
                st = lender.stats[mig.migration]
                mig.finish("home", "", f"{st.recalled} recalled, {st.dropped} dropped")
            else:
                continue
            lender.close_peer(
                mig.migration
            )  # its buffers and socket; lost segments still release later

    def _kv_recall(self, req, mig: _Migration) -> m.Reply:
        if mig.state not in ("remote", "recalling"):
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"KV-block migration {req.migration!r} is {mig.state}: nothing to recall",
            )
        mig.state = "recalling"
        with mig.lock:
            mig.pending = "kv_recall"
        return m.Accepted(id=req.id, migration=req.migration)

    def _kv_info(self, mig: _Migration) -> dict:
        if self._lender is None or mig.migration not in self._lender.stats:
            return {}
        d = self._lender.stats[mig.migration].as_dict()
        d["remote_segments"] = self._lender.active(mig.migration)
        return d

    # ------------------------------------------------------------------ host
    def _open_kv_host(self, req: m.OpenKVHost) -> m.Reply:
        from bana_sglang.migrate.agent import _Migration
        from bana_sglang.migrate.kv.host import KVHost

        if req.layers != self.num_layers:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"{req.owner} has {req.layers} layers, this worker {self.num_layers}: "
                "KV pages need the same model",
            )
        existing = self.migrations.get(req.migration)
        if existing is not None and existing.side != "guest":
            return m.Error(
                id=req.id, reason="invalid", detail=f"migration id {req.migration!r} is taken"
            )
        if self._kv_host is None:
            self._kv_host = KVHost(self._engine(), self.te_host, self.name)
        self._kv_host.open(req.migration, req.owner, req.layers)
        if existing is None:
            with self._lock:
                self.migrations[req.migration] = _Migration(
                    req.migration,
                    "guest",
                    req.owner,
                    0,
                    0,
                    "serving",
                    kind="kv",
                    owner_endpoint=req.owner_endpoint,
                )
        return m.KVHostOpened(
            id=req.id,
            migration=req.migration,
            worker=self.name,
            endpoint=self._kv_host.endpoint,
            session=self._engine().session,
        )

    def _reclaim(self, rid: int, reason: str) -> m.Reply:
        """This worker needs its memory: ask the lenders of the pages it hosts to recall them."""
        held = self._kv_host.info() if self._kv_host is not None else {}
        asks = [
            mig
            for mid, mig in self.migrations.items()
            if mig.side == "guest" and mig.kind == "kv" and held.get(mid, {}).get("segments")
        ]
        if not asks:
            return m.Ok(id=rid, note="this worker hosts no KV pages")
        blind = [mig.migration for mig in asks if not mig.owner_endpoint]
        for mig in asks:
            if mig.owner_endpoint:
                self._work.submit(self._ask_recall, mig, reason)
        self.metrics.add("kv_reclaims", len(asks) - len(blind))
        note = f"asked {len(asks) - len(blind)} lender migration(s) to recall ({reason})"
        if blind:
            note += f"; {', '.join(blind)} did not say where their lender's agent is"
        return m.Ok(id=rid, note=note)

    def _ask_recall(self, mig, reason: str) -> None:
        """Worker thread: one recall request to a lender."""
        client = AgentClient(mig.owner_endpoint, timeout_s=self.peer_timeout_s, ctx=self._ctx)
        try:
            reply = client.call(m.Recall, migration=mig.migration)
            logger.info(
                "KV host %s: asked %s to recall %s (%s): %s",
                self.name,
                mig.peer,
                mig.migration,
                reason,
                describe(reply),
            )
        except Exception as e:  # the lender may be gone: its segments are dropped when it closes
            logger.warning(
                "KV host %s: could not ask %s to recall %s: %s",
                self.name,
                mig.peer,
                mig.migration,
                e,
            )
        finally:
            client.close()

    def _kv_host_pressure(self) -> None:
        """Scheduler thread: reclaim when this worker's own KV pool runs low while it hosts pages."""
        host, w = self._kv_host, self.worker
        if host is None or w is None or w.allocator is None or not host.bytes_held:
            return
        now = time.monotonic()
        if now - self._last_reclaim < RECLAIM_EVERY_S:
            return
        total = max(1, int(w.allocator.size))
        free = int(w.allocator.available_size())
        tree = getattr(w.scheduler, "tree_cache", None) if w.scheduler is not None else None
        free += int(tree.evictable_size()) if tree is not None else 0
        if free / total < self.reclaim_below:
            self._last_reclaim = now
            self._reclaim(0, f"its KV pool is {1 - free / total:.0%} used")

    def _kv_close(self) -> None:
        if self._lender is not None:
            if remote_kv() is self._lender:
                set_remote_kv(None)
            self._lender.close()
        if self._kv_host is not None:
            self._kv_host.close()
