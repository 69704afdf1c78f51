"""The global index service: one process answering the index channel.

``python -m bana_sglang.radix_global.service --port P --capacity-bytes N
[--master HOST:PORT]`` answers the requests of :mod:`bana_sglang.wire.index`
(a :class:`bana_sglang.wire.transport.Server`, one handler per request type)
against one :class:`~bana_sglang.radix_global.index.GlobalPrefixIndex`. With
``--master`` it also owns store housekeeping: it removes evicted, forgotten and
abandoned pages from the Mooncake store itself (eviction is prefix-aware;
Mooncake's own eviction should never trigger because the index capacity stays
below the storage segment), and it notices a store that restarted empty.

Invariants:
- the index is touched by the serving thread only; store I/O runs on one
  janitor thread, so a slow or dead store never delays a reply;
- every request gets exactly one reply (a result or an ``Error``), and no
  malformed input stops the loop (the transport's guarantee); expired intents
  and store resets are handled on the serving thread between bursts of
  requests;
- a page becomes visible to lookups only after a commit, and only if its parent
  is indexed (closure); pages written under an intent that is not committed by
  its lease deadline are removed from the store;
- store reset detection: the janitor keeps a sentinel key; if the store answers
  but the sentinel is gone, the store lost its contents, so the index forgets
  everything (and stray ``bana/kv/`` keys are removed).

Its client is :class:`bana_sglang.radix_global.client.IndexClient`.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from bana_sglang.radix_global.errors import StoreError
from bana_sglang.radix_global.index import GlobalPrefixIndex
from bana_sglang.radix_global.keys import OwnerId, PageHash
from bana_sglang.radix_global.mooncake_kv import (
    HAS_LEASE,
    NOT_FOUND,
    MooncakeKV,
    StoreConfig,
    page_key,
)
from bana_sglang.wire import index as m
from bana_sglang.wire import security
from bana_sglang.wire.transport import Server

logger = logging.getLogger(__name__)

READY_LINE = "bana-radix-index ready"


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 0
    capacity_bytes: int = 1 << 30
    master_addr: str | None = None  # Mooncake master "host:port"; None: index only
    intent_ttl_s: float = 30.0  # how long a publish intent may stay uncommitted
    epoch_check_s: float = 1.0  # how often the janitor checks the store sentinel
    remove_retry_s: float = 2.0  # retry delay for removals refused by a lease
    force_remove_after_s: float = 10.0  # then remove even if leased (a hot page renews its lease)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"


@dataclass
class _Intent:
    owner: OwnerId
    chain: list[PageHash]
    sizes: list[int]
    start: int
    stop: int
    deadline: float
    parent: PageHash | None = None


# ---------------------------------------------------------------------- janitor


class _Janitor(threading.Thread):
    """Store housekeeping off the serving thread: removals (with lease retries)
    and store-reset detection. Talks back through ``events``."""

    def __init__(self, cfg: ServiceConfig, events: queue.Queue[str]):
        super().__init__(name="radix-janitor", daemon=True)
        assert cfg.master_addr
        self.cfg = cfg
        self.events = events
        self.kv = MooncakeKV(StoreConfig.from_env(cfg.master_addr))
        self.inbox: queue.Queue[tuple[list[PageHash], bool]] = queue.Queue()
        self._retry: dict[PageHash, tuple[float, float]] = {}  # page -> (first try, next try)
        self._halt = threading.Event()
        self._sentinel: str | None = None
        self._next_epoch_check = 0.0
        self._started_clean = False
        self._busy = 0
        self.resets = 0
        self.ready = threading.Event()  # first store check done (or failed)

    def remove(self, pages: Sequence[PageHash], *, force: bool = False) -> None:
        """Queue store removals. Gentle removals wait out read leases (retrying
        every ``remove_retry_s``, forcing after ``force_remove_after_s``: a page
        read continuously renews its lease); ``force`` skips the lease (for
        pages nobody may read any more; readers verify what they get anyway)."""
        if pages:
            self.inbox.put((list(pages), force))

    @property
    def queued(self) -> int:
        return self.inbox.qsize() + len(self._retry) + self._busy

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        self.kv.connect()
        self._check_epoch()
        self.ready.set()
        while not self._halt.is_set():
            batch: list[PageHash] = []
            urgent: set[PageHash] = set()
            try:
                item = self.inbox.get(timeout=0.1)
                while True:
                    self._busy += len(item[0])  # counted as queued until processed
                    batch.extend(item[0])
                    if item[1]:
                        urgent.update(item[0])
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            now = time.monotonic()
            due = [p for p, (_, nxt) in self._retry.items() if nxt <= now]
            pages = list(dict.fromkeys(batch + due))
            if pages:
                force = [
                    p
                    for p in pages
                    if p in urgent
                    or (
                        p in self._retry and now - self._retry[p][0] > self.cfg.force_remove_after_s
                    )
                ]
                forced_set = set(force)
                gentle = [p for p in pages if p not in forced_set]
                for group, forced in ((gentle, False), (force, True)):
                    if not group:
                        continue
                    try:
                        rcs = self.kv.remove_many([page_key(p) for p in group], force=forced)
                    except StoreError:
                        rcs = [HAS_LEASE] * len(group)  # unavailable: retry later
                    logger.debug("removed %d pages (force=%s): codes %s", len(group), forced, rcs)
                    for p, rc in zip(group, rcs):
                        if rc in (0, NOT_FOUND):
                            self._retry.pop(p, None)
                        else:
                            first = self._retry.get(p, (now, now))[0]
                            self._retry[p] = (first, now + self.cfg.remove_retry_s)
            self._busy = 0
            if now >= self._next_epoch_check:
                self._next_epoch_check = now + self.cfg.epoch_check_s
                self._check_epoch()
        self.kv.close()

    def _check_epoch(self) -> None:
        try:
            if not self._started_clean:
                # a fresh index knows no page: pages left by an earlier index are unreachable
                n = self.kv.remove_matching("^bana/kv/")
                self._started_clean = True
                if n:
                    logger.info("removed %d pages left in the store by an earlier index", n)
            if self._sentinel is not None:
                if self.kv.get_bytes(self._sentinel) is not None:
                    return
                self.resets += 1
                logger.warning(
                    "the Mooncake store lost its contents (restarted?); "
                    "the index forgets every page"
                )
                self.events.put("reset")
                self._retry.clear()  # every page is gone already
                try:
                    self.kv.remove_matching("^bana/kv/")
                except StoreError as e:
                    logger.info("could not clear stray pages after a store reset: %s", e)
                self._sentinel = None
            key = f"bana/epoch/{uuid.uuid4().hex}"
            self.kv.put_bytes(key, b"bana-epoch")
            self._sentinel = key
        except StoreError as e:
            logger.debug("epoch check skipped: %s", e)


# ---------------------------------------------------------------------- service


class IndexService:
    """The serving loop. ``run()`` blocks until :meth:`stop` (or SIGTERM in main)."""

    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.index = GlobalPrefixIndex(cfg.capacity_bytes)
        self._intents: dict[int, _Intent] = {}
        self._pending: dict[PageHash, int] = {}  # page -> intent id
        self._pending_bytes = 0
        self._intent_ids = itertools.count(1)
        self._events: queue.Queue[str] = queue.Queue()
        self._janitor = _Janitor(cfg, self._events) if cfg.master_addr else None
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        handlers = {
            m.Lookup: self._lookup,
            m.PublishIntent: self._publish_intent,
            m.Commit: self._commit,
            m.ReportLoss: self._report_loss,
            m.Stats: self._stats,
            m.Clear: self._clear,
        }
        bind = cfg.endpoint if cfg.port else f"tcp://{cfg.host}:*"  # port 0: any free port
        self._server = Server(m.CHANNEL, handlers, bind, ctx=self._ctx)
        self.port = cfg.port or int(self._server.endpoint.rpartition(":")[2])

    def stop(self) -> None:
        self._stop.set()

    def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop`. ``on_ready`` runs once the socket is bound and
        the first store check is done (or timed out: a down store is no reason
        not to serve)."""
        if self._janitor:
            self._janitor.start()
            if not self._janitor.ready.wait(timeout=10.0):
                logger.warning("store not answering yet; serving without it for now")
        if on_ready:
            on_ready()
        # wait for requests, answer a burst, then expire intents and apply resets
        try:
            while not self._stop.is_set():
                if self._server.wait(100):
                    self._server.poll(256)
                self._housekeeping()
        finally:
            if self._janitor:
                self._janitor.stop()
                self._janitor.join(timeout=10)
            self._server.close()
            security.release(self._ctx)  # its ZAP thread holds a socket of the context
            self._ctx.term()

    # -- handlers, one per request type (no I/O but janitor queueing)
    def _lookup(self, req: m.Lookup) -> m.Reply:
        match = self.index.longest_prefix(
            [PageHash(p) for p in req.chain],
            touch=req.touch,
            parent=PageHash(req.parent) if req.parent else None,
            any_parent=req.any_parent,
        )
        return m.LookupResult(
            id=req.id,
            length=match.length,
            sizes=[p.size for p in match.pages],
            hits=[p.hits for p in match.pages],
        )

    def _report_loss(self, req: m.ReportLoss) -> m.Reply:
        dropped = self.index.forget([PageHash(p) for p in req.pages])
        self._remove([d.page for d in dropped] + list(req.pages), force=True)
        if dropped:
            logger.info(
                "%s reported %d lost pages; %d forgotten with descendants",
                req.reporter,
                len(req.pages),
                len(dropped),
            )
        return m.Ok(id=req.id, count=len(dropped))

    def _clear(self, req: m.Clear) -> m.Reply:
        dropped = self.index.clear()
        pending = list(self._pending)
        self._intents.clear()
        self._pending.clear()
        self._pending_bytes = 0
        self._remove([d.page for d in dropped] + pending, force=True)
        logger.info(
            "cleared: %d pages forgotten and removed, %d pending dropped",
            len(dropped),
            len(pending),
        )
        return m.Ok(id=req.id, count=len(dropped))

    def _stats(self, req: m.Stats) -> m.Reply:
        s = self.index.stats()
        return m.StatsResult(
            id=req.id,
            pages=s.pages,
            leaves=s.leaves,
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
            pending_pages=len(self._pending),
            pending_bytes=self._pending_bytes,
            lookups=s.lookups,
            hit_pages=s.hit_pages,
            lookup_pages=s.lookup_pages,
            inserted=s.inserted,
            evicted=s.evicted,
            forgotten=s.forgotten,
            store_removals_queued=self._janitor.queued if self._janitor else 0,
            store_resets=self._janitor.resets if self._janitor else 0,
            store_attached=self._janitor is not None,
        )

    def _publish_intent(self, req: m.PublishIntent) -> m.Reply:
        if len(req.sizes) != len(req.chain):
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"{len(req.chain)} pages but {len(req.sizes)} sizes",
            )
        chain = [PageHash(p) for p in req.chain]
        parent = PageHash(req.parent) if req.parent else None
        now = time.time()
        if parent is not None and parent not in self.index:
            return m.IntentResult(
                id=req.id,
                intent=0,
                start=0,
                stop=0,
                lease_deadline=now + self.cfg.intent_ttl_s,
                note="parent not indexed",
            )
        # a use of the existing prefix (protects it from eviction), not a hit
        start = self.index.longest_prefix(chain, touch=True, hit=False, parent=parent).length
        stop, note = start, ""
        while stop < len(chain):
            page = chain[stop]
            if page in self.index:
                note = "conflict: page indexed under another parent"
                break
            if page in self._pending:
                note = "pending elsewhere"
                break
            stop += 1
        # make room for everything pending plus this range; shrink the range if needed
        while stop > start:
            need = self._pending_bytes + sum(req.sizes[start:stop])
            keep = chain[:start] + ([parent] if parent else [])
            self._remove([p.page for p in self.index.evict_for(need, protect=keep)])
            if need <= self.index.free_bytes:
                break
            stop -= 1
            note = "no room for the whole chain"
        deadline = now + self.cfg.intent_ttl_s
        if stop == start:
            return m.IntentResult(
                id=req.id,
                intent=0,
                start=start,
                stop=stop,
                lease_deadline=deadline,
                note=note or ("present" if start == len(chain) else "no room"),
            )
        iid = next(self._intent_ids)
        self._intents[iid] = _Intent(
            OwnerId(req.owner), chain[:stop], list(req.sizes[:stop]), start, stop, deadline, parent
        )
        for page in chain[start:stop]:
            self._pending[page] = iid
        self._pending_bytes += sum(req.sizes[start:stop])
        return m.IntentResult(
            id=req.id, intent=iid, start=start, stop=stop, lease_deadline=deadline, note=note
        )

    def _release(self, iid: int) -> _Intent | None:
        it = self._intents.pop(iid, None)
        if it is None:
            return None
        for page in it.chain[it.start : it.stop]:
            if self._pending.get(page) == iid:
                del self._pending[page]
        self._pending_bytes -= sum(it.sizes[it.start : it.stop])
        return it

    def _commit(self, req: m.Commit) -> m.Reply:
        it = self._release(req.intent)
        if it is None:
            return m.Error(
                id=req.id, reason="unknown_intent", detail=f"intent {req.intent} unknown or expired"
            )
        upto = it.start + min(req.written, it.stop - it.start)
        # only the written range is new; it hangs below the page before it, which
        # must still be indexed (it may have been evicted since the intent: then
        # nothing is accepted, never pages whose bytes already left the store)
        anchor = it.chain[it.start - 1] if it.start else it.parent
        res = self.index.insert(
            it.chain[it.start : upto], it.sizes[it.start : upto], it.owner, parent=anchor
        )
        self._remove([p.page for p in res.evicted])
        # written-but-refused and never-committed pages must not linger in the store
        self._remove(list(res.rejected) + it.chain[upto : it.stop])
        return m.Ok(id=req.id, count=len(res.accepted), note=res.reason or "")

    def _remove(self, pages: Sequence[PageHash], *, force: bool = False) -> None:
        if self._janitor and pages:
            self._janitor.remove(pages, force=force)

    def _housekeeping(self) -> None:
        now = time.time()
        for iid in [i for i, it in self._intents.items() if it.deadline < now]:
            it = self._release(iid)
            if it:
                logger.info(
                    "intent %d of %s expired uncommitted; removing its pages", iid, it.owner
                )
                self._remove(it.chain[it.start : it.stop])
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event == "reset":
                dropped = self.index.clear()
                logger.warning("store reset: forgot %d pages", len(dropped))


# ---------------------------------------------------------------------- entry point


def _parse(argv: Sequence[str] | None) -> ServiceConfig:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.radix_global.service",
        description="The global KV prefix index service (ZMQ ROUTER, msgpack messages).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="TCP port to bind")
    p.add_argument(
        "--capacity-bytes",
        type=int,
        default=1 << 30,
        help="store bytes the index may fill; keep below ~0.85 x the storage segment",
    )
    p.add_argument(
        "--master",
        default=None,
        help="Mooncake master host:port; enables store housekeeping (removal of evicted pages)",
    )
    p.add_argument(
        "--intent-ttl", type=float, default=30.0, help="seconds a publish intent may stay open"
    )
    p.add_argument(
        "--epoch-check", type=float, default=1.0, help="seconds between store-reset checks"
    )
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return ServiceConfig(
        host=a.host,
        port=a.port,
        capacity_bytes=a.capacity_bytes,
        master_addr=a.master,
        intent_ttl_s=a.intent_ttl,
        epoch_check_s=a.epoch_check,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = _parse(argv)
    service = IndexService(cfg)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    signal.signal(signal.SIGINT, lambda *_: service.stop())
    service.run(
        on_ready=lambda: print(
            f"{READY_LINE} on tcp://{cfg.host}:{service.port} capacity={cfg.capacity_bytes} "
            f"store={cfg.master_addr or 'none'}",
            flush=True,
        )
    )
    logger.info("index service stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
