"""The global index service (one process, ZMQ ROUTER) and its client.

``python -m bana_sglang.radix_global.service --port P --capacity-bytes N
[--master HOST:PORT]`` serves :mod:`messages` requests against one
:class:`~bana_sglang.radix_global.index.GlobalPrefixIndex`. With ``--master`` it
also owns store housekeeping: it removes evicted, forgotten and abandoned pages
from the Mooncake store itself (eviction is prefix-aware; Mooncake's own
eviction should never trigger because the index capacity stays below the
storage segment), and it notices a store that restarted empty.

Invariants:
- the index is touched by the serving thread only; store I/O runs on one
  janitor thread, so a slow or dead store never delays a reply;
- every request gets exactly one reply (a result or an ``Error``), and no
  malformed input stops the loop;
- a page becomes visible to lookups only after a commit, and only if its parent
  is indexed (closure); pages written under an intent that is not committed by
  its lease deadline are removed from the store;
- store reset detection: the janitor keeps a sentinel key; if the store answers
  but the sentinel is gone, the store lost its contents, so the index forgets
  everything (and stray ``bana/kv/`` keys are removed).

:class:`IndexClient` never hangs and never raises for an unavailable service:
each call has a timeout; after one timeout the client fails fast (a miss) for
``retry_interval_s`` before trying again, logs once when an outage starts and
once when it ends, and recovers by itself.
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
from typing import NamedTuple

import msgspec
import zmq

from bana_sglang import envs
from bana_sglang.radix_global.errors import IndexUnavailable, StoreError
from bana_sglang.radix_global.index import GlobalPrefixIndex
from bana_sglang.radix_global.keys import OwnerId, PageHash
from bana_sglang.wire import index as m

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
        from bana_sglang.radix_global.mooncake_kv import MooncakeKV, StoreConfig

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
        from bana_sglang.radix_global.mooncake_kv import HAS_LEASE, NOT_FOUND, page_key

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
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if cfg.port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{cfg.host}")
        else:
            self._sock.bind(cfg.endpoint)
            self.port = cfg.port

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
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    for _ in range(256):  # drain a burst, then do housekeeping
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._serve(frames)
                self._housekeeping()
        finally:
            if self._janitor:
                self._janitor.stop()
                self._janitor.join(timeout=10)
            self._sock.close(0)
            self._ctx.term()

    def _serve(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if len(frames) != 2:
            reply: m.Reply = m.Error(
                id=0,
                reason="malformed",
                detail=f"expected one frame per request, got {len(frames) - 1}",
            )
        else:
            req = m.decode_request(frames[1])
            if isinstance(req, m.Error):
                logger.info("rejected request: %s (%s)", req.reason, req.detail)
                reply = req
            else:
                try:
                    reply = self.handle(req)
                except Exception as e:  # a bug must not stop the service
                    logger.exception("internal error handling %s", type(req).__name__)
                    reply = m.Error(id=req.id, reason="internal", detail=repr(e))
        self._sock.send_multipart([ident, m.encode(reply)])

    # -- handlers (pure with respect to I/O except janitor queueing)
    def handle(self, req: m.Request) -> m.Reply:
        if isinstance(req, m.Lookup):
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
        if isinstance(req, m.PublishIntent):
            return self._publish_intent(req)
        if isinstance(req, m.Commit):
            return self._commit(req)
        if isinstance(req, m.ReportLoss):
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
        if isinstance(req, m.Stats):
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
        raise AssertionError(f"unhandled request {type(req).__name__}")

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


# ---------------------------------------------------------------------- client


class IndexMatch(NamedTuple):
    """A lookup answer. ``available`` is False when the service could not be asked
    (then ``length`` is 0: a miss)."""

    length: int
    sizes: tuple[int, ...]
    available: bool


class IndexClient:
    """Talks to the index service over a DEALER socket. Not thread-safe: one per
    thread. High-level calls never raise for an unavailable service."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float | None = None,
        retry_interval_s: float | None = None,
        name: str = "client",
    ):
        self.endpoint = endpoint
        self.name = name
        # BANA_INDEX_TIMEOUT_S / BANA_INDEX_RETRY_S, read once here
        self.timeout_s = timeout_s if timeout_s is not None else envs.BANA_INDEX_TIMEOUT_S.get()
        self.retry_interval_s = (
            retry_interval_s if retry_interval_s is not None else envs.BANA_INDEX_RETRY_S.get()
        )
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._down_since: float | None = None
        self._next_try = 0.0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 1000)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    @property
    def available(self) -> bool:
        return self._down_since is None

    def next_id(self) -> int:
        return next(self._ids)

    def deadline(self) -> float:
        return time.time() + self.timeout_s

    def call(self, req: msgspec.Struct, *, timeout_s: float | None = None) -> m.Reply:
        """Send one request, wait for its reply. Raises :class:`IndexUnavailable`
        on timeout (or while failing fast after one)."""
        now = time.monotonic()
        if self._down_since is not None and now < self._next_try:
            raise IndexUnavailable(
                "call", "index service unavailable (failing fast)", target=self.endpoint
            )
        sock = self._socket()
        rid = getattr(req, "id", 0)
        try:
            sock.send(m.encode(req), zmq.NOBLOCK)
        except zmq.Again:
            return self._timed_out("send queue full")
        end = now + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                if time.monotonic() >= end:
                    return self._timed_out(f"no reply within {self.timeout_s:.2f}s")
                continue
            data = sock.recv()
            try:
                reply = m.decode_reply(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.warning("%s: undecodable reply from %s: %s", self.name, self.endpoint, e)
                continue
            if reply.id != rid and not (isinstance(reply, m.Error) and reply.id == 0):
                continue  # a late reply to an earlier, timed-out request
            if self._down_since is not None:
                logger.warning(
                    "%s: index service %s reachable again after %.1fs",
                    self.name,
                    self.endpoint,
                    time.monotonic() - self._down_since,
                )
                self._down_since = None
            return reply

    def _timed_out(self, why: str) -> m.Reply:
        # drop the socket: queued requests and late replies go with it
        self.close()
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "%s: index service %s unavailable (%s); treating lookups as misses",
                self.name,
                self.endpoint,
                why,
            )
        self._next_try = time.monotonic() + self.retry_interval_s
        raise IndexUnavailable("call", why, target=self.endpoint)

    def _ask(self, req: msgspec.Struct) -> m.Reply | None:
        try:
            reply = self.call(req)
        except IndexUnavailable:
            return None
        if isinstance(reply, m.Error):
            logger.warning(
                "%s: index service refused %s: %s (%s)",
                self.name,
                type(req).__name__,
                reply.reason,
                reply.detail,
            )
            return None
        return reply

    # -- high level (never raise for an unavailable service)
    def lookup(
        self,
        chain: Sequence[PageHash],
        *,
        touch: bool = True,
        parent: PageHash | None = None,
        any_parent: bool = False,
    ) -> IndexMatch:
        reply = self._ask(
            m.Lookup(
                id=self.next_id(),
                deadline=self.deadline(),
                chain=list(chain),
                touch=touch,
                parent=parent,
                any_parent=any_parent,
            )
        )
        if not isinstance(reply, m.LookupResult):
            return IndexMatch(0, (), False)
        return IndexMatch(reply.length, tuple(reply.sizes), True)

    def publish_intent(
        self,
        chain: Sequence[PageHash],
        sizes: Sequence[int],
        owner: str,
        *,
        parent: PageHash | None = None,
    ) -> m.IntentResult | None:
        reply = self._ask(
            m.PublishIntent(
                id=self.next_id(),
                deadline=self.deadline(),
                chain=list(chain),
                sizes=list(sizes),
                owner=owner,
                parent=parent,
            )
        )
        return reply if isinstance(reply, m.IntentResult) else None

    def commit(self, intent: int, written: int) -> int | None:
        """Pages made visible, or None if the service could not be asked."""
        reply = self._ask(
            m.Commit(id=self.next_id(), deadline=self.deadline(), intent=intent, written=written)
        )
        return reply.count if isinstance(reply, m.Ok) else None

    def report_loss(self, pages: Sequence[PageHash], reporter: str) -> int | None:
        reply = self._ask(
            m.ReportLoss(
                id=self.next_id(), deadline=self.deadline(), pages=list(pages), reporter=reporter
            )
        )
        return reply.count if isinstance(reply, m.Ok) else None

    def stats(self) -> m.StatsResult | None:
        reply = self._ask(m.Stats(id=self.next_id(), deadline=self.deadline()))
        return reply if isinstance(reply, m.StatsResult) else None


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
