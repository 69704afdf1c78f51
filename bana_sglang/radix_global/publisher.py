"""Publishing a worker's new KV pages to the global store, off the forward's way.

SGLang hands the linker each new tree node to offload (prefill workers: prompts;
decode workers: the prompt of a request whose KV has just arrived, and what it
generated). :class:`Publisher` does the rest on one thread of its own:

- **batched**: it takes every offload queued since its last round at once, asks
  the index for each chain's intent, frames all granted pages in its host
  :class:`~bana_sglang.radix_global.pool.Arena` (header, then payload: one
  contiguous object per page) and writes them with one batched put, one slice
  per page (a slice costs as much as tens of KB of payload over TCP; SGLang's
  pool keeps K and V of every layer apart, so putting straight from the pool
  took 2 x layers slices per page), then commits each chain;
- **fenced**: on CUDA it first waits for the offload-ready events the linker
  recorded when the node was offered (SGLang's ``record_offload_ready``), so it
  never copies a row the forward stream is still writing, and gathers the pages
  on a side stream before one copy to the pinned arena; on CPU the rows are
  final when SGLang offers the node;
- **at a lower priority**: the thread lowers its own scheduling priority
  (``nice``, per thread on Linux) before it creates its Mooncake client, whose
  transfer threads inherit it, so a forward that competes with a publish for
  a core gets the core (on the 2-core VM a publish ran beside the next
  request's prefill and its KV transfer);
- **after the forward's critical moments**: ``quiet()`` (the linker's) says how
  long to hold a round back: on a prefill worker of a CPU pool, until a short
  while after its last forward ended, when the request's KV has gone to its
  decode worker and the first token is being computed (a publish on the 2-core
  VM made exactly those slower); at most ``max_delay_s`` after the offload came;
  and never before an offload's ``not_before`` (a decode worker's copy of a
  prompt that has just arrived waits until the request's first token is out; a
  round takes no later offload that is not due yet);
- **through the storage process** when the worker shares its host (``storage``:
  the storage process's endpoint) and its pool is on the CPU: the arena is then a
  :class:`~bana_sglang.radix_global.shm_arena.SharedArena` and the storage process
  puts the framed pages into its own segment (a local copy) instead of this
  thread's transfer-engine put; a put it cannot take goes direct (and the arena is
  replaced before its next use);
- **bounded**: every queued offload holds SGLang's lock on its pages; past
  ``max_pending_pages`` the linker declines new offloads (counted as skipped)
  instead of letting locked pages fill the pool.

Results are reported in offload order (SGLang pairs them with its pending
offloads that way). No SGLang import.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import PageHash
from bana_sglang.radix_global.mooncake_kv import page_key
from bana_sglang.radix_global.page_format import HEADER_SIZE
from bana_sglang.radix_global.pool import Arena, KVPool
from bana_sglang.radix_global.shm_arena import (
    REMAP_AFTER_S,
    LocalStorage,
    LocalStorageError,
    SharedArena,
)
from bana_sglang.radix_global.store import PageStore, PutResult
from bana_sglang.wire.storage import MAX_ARENA_BYTES, MAX_PAGES

logger = logging.getLogger(__name__)


@dataclass
class Offload:
    """One node to publish: its pages, the indexed page before them, where they lie."""

    chain: list[PageHash]
    parent: PageHash | None
    page_ids: torch.Tensor  # pool page of each page (CPU int64)
    ready: list = field(default_factory=list)  # events to wait for before reading (CUDA)
    submitted: float = field(default_factory=time.monotonic)
    # not written before this time (``time.monotonic``): a decode worker's copy of a prompt
    # that has just arrived waits until the request's first token is out
    not_before: float = 0.0


@dataclass
class RoundStats:
    """One publishing round (seconds; ``cpu_s`` is this thread's CPU time)."""

    offloads: int = 0
    offered: int = 0
    written: int = 0
    committed: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    index_s: float = 0.0
    put_s: float = 0.0
    local_pages: int = 0  # of ``written``, put by the storage process from the shared arena


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def lower_thread_priority(nice: int) -> None:
    """Lower the calling thread's scheduling priority by ``nice`` (Linux: per thread)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # never fail publishing over a priority
        logger.debug("could not lower the publish thread's priority: %s", e)


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux, 15 bytes), so that
    ``top -H``, ``/proc/PID/task/*/comm`` and per-thread CPU accounting tell the
    store's threads from the scheduler's (Python 3.11 names only its own object)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError) as e:  # a name is never worth failing over
        logger.debug("could not name the thread %s: %s", name, e)


class Publisher:
    """The publish thread of one worker (see the module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        connect: Callable[[], PageStore],
        index: IndexClient,
        owner: str,
        *,
        arena_bytes: int,
        nice: int = 10,
        max_pending_pages: int = 1 << 30,
        on_round: Callable[[RoundStats], None] | None = None,
        quiet: Callable[[], float] | None = None,
        max_delay_s: float = 1.0,
        storage: str | None = None,
        storage_timeout_s: float = 5.0,
        arena_owner: str | None = None,
    ):
        self.pool = pool
        self.index = index
        self.owner = owner
        self.max_pending_pages = max_pending_pages
        self.results: queue.Queue[bool] = queue.Queue()
        self._connect = connect
        self._arena_bytes = arena_bytes
        self._nice = nice
        self._on_round = on_round
        self._quiet = quiet
        self._max_delay_s = max_delay_s
        # a CUDA pool keeps its pinned arena (a shared one is pageable: slower copies out)
        self._local = (
            LocalStorage(storage, arena_owner or owner, timeout_s=storage_timeout_s)
            if storage and not pool.device.is_cuda and 0 < arena_bytes <= MAX_ARENA_BYTES
            else None
        )
        self._remap_at = 0.0  # when to map a fresh shared arena (after a failed local put)
        self._queue: queue.Queue[Offload | None] = queue.Queue()
        self._next: Offload | None = None  # taken from the queue, not due in the last round
        self._lock = threading.Lock()
        self._pending = 0
        self._busy = threading.Event()
        self.store: PageStore | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bana-store-publish")
        self._thread.start()

    # -- the linker's side
    @property
    def pending_pages(self) -> int:
        return self._pending

    @property
    def busy(self) -> bool:
        """True while a round is being written (for measuring its effect on forwards)."""
        return self._busy.is_set()

    def accepts(self, pages: int) -> bool:
        """Whether ``pages`` more may be queued (under ``max_pending_pages``)."""
        return self._pending + pages <= self.max_pending_pages

    def submit(self, task: Offload) -> None:
        with self._lock:
            self._pending += len(task.chain)
        self._queue.put(task)

    def join(self) -> None:
        """Wait until every queued offload has its result."""
        self._queue.join()

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout)
        if self._local is not None:
            self._local.close()
        if self.store is not None:
            self.store.kv.close()

    # -- the thread
    def _run(self) -> None:
        name_native_thread("bana-publish")
        lower_thread_priority(self._nice)
        arena: Arena | SharedArena | None = None
        try:
            self.store = self._connect()  # its Mooncake threads inherit this thread's priority
            arena = self._arena_for_round(None)
        except Exception:
            logger.exception("the global store's publisher could not start; publishing is off")
        finally:
            self._ready.set()
        while True:
            task, self._next = self._next or self._queue.get(), None
            if task is None:
                self._queue.task_done()
                return
            _sleep_until(task.not_before)
            self._wait_quiet(task.submitted)
            tasks = [task]
            stop = False
            while True:  # everything queued since the last round that is due
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                if more.not_before > time.monotonic():  # the next round's first
                    self._next = more
                    break
                tasks.append(more)
            try:
                if arena is not None and self._local is not None:
                    arena = self._arena_for_round(arena)
                oks = self._round(tasks, arena) if arena is not None else [False] * len(tasks)
            except Exception:  # a failed publish is a skipped publish
                logger.exception("global store publish failed")
                oks = [False] * len(tasks)
            for t, ok in zip(tasks, oks):
                with self._lock:
                    self._pending -= len(t.chain)
                self.results.put(ok)
                self._queue.task_done()
            if stop:
                self._queue.task_done()
                return

    def _arena_for_round(self, arena: Arena | SharedArena | None) -> Arena | SharedArena:
        """The arena the next round frames into: the shared one while the storage
        process has it mapped; after a put it did not take, never that one again (it
        may still read it late) but a private one, until a fresh shared arena maps."""
        local = self._local
        if isinstance(arena, SharedArena):
            if not self._lost(arena):
                return arena
            self._retire(arena)
            arena = None
        if local is not None and time.monotonic() >= self._remap_at:
            fresh = self._shared_arena()
            if fresh is not None:
                if arena is not None:
                    self._retire(arena)
                return fresh
            self._remap_at = time.monotonic() + REMAP_AFTER_S
        assert self.store is not None
        return arena or Arena(self.pool.device, self._arena_bytes, self.store.kv)

    def _shared_arena(self) -> SharedArena | None:
        """A fresh shared arena the storage process has mapped (also registered with
        this worker's own client, for the direct put), or None (logged)."""
        assert self._local is not None and self.store is not None
        try:
            arena = SharedArena(self._arena_bytes)
        except OSError as e:
            logger.warning("no shared arena (%s): publishing with direct puts", e)
            self._local.close()
            self._local = None
            return None
        try:
            self.store.kv.register(arena.ptr, arena.nbytes)
            self._local.map(arena)
        except Exception as e:
            logger.warning("the storage process did not map the arena (%s): direct puts", e)
            self._retire(arena)
            return None
        finally:
            arena.unlink()  # the mappings keep the memory; nothing is left in /dev/shm
        logger.info("publishing through the storage process at %s", self._local.endpoint)
        return arena

    def _lost(self, arena: Arena | SharedArena) -> bool:
        """A shared arena whose put the storage process did not take (it may read it late)."""
        return isinstance(arena, SharedArena) and (self._local is None or self._local.arena is None)

    def _retire(self, arena: Arena | SharedArena) -> None:
        assert self.store is not None
        self.store.kv.unregister(arena.ptr)
        if isinstance(arena, SharedArena):
            arena.close()

    def _put(self, keys: list[PageHash], arena: Arena | SharedArena, st: RoundStats) -> PutResult:
        """Put ``keys`` framed in the arena's first slots: through the storage process
        when it has the arena mapped, else (or when it does not take them) directly."""
        store = self.store
        assert store is not None
        obj = store.object_size
        local = self._local
        if isinstance(arena, SharedArena) and not self._lost(arena):
            assert local is not None
            try:
                codes = local.put(
                    [page_key(p) for p in keys], [j * obj for j in range(len(keys))], obj
                )
            except LocalStorageError as e:
                logger.warning("the storage process did not take a put (%s): put directly", e)
                local.arena = None  # not written again: this round stops, the next replaces it
                # a restarted storage process maps a fresh arena at once; a silent one is
                # given a few seconds (each map waits for its answer)
                self._remap_at = time.monotonic() + (
                    0.0 if e.reason == "unknown_arena" else REMAP_AFTER_S
                )
            else:
                res = store.put_result(keys, codes)
                st.local_pages += res.written
                return res
        return store.put_objects(keys, [arena.ptr + j * obj for j in range(len(keys))])

    def _wait_quiet(self, since: float) -> None:
        """Hold a round back while the worker's forwards say so (``quiet()``: seconds
        until it is quiet), at most ``max_delay_s`` after its first offload came."""
        if self._quiet is None:
            return
        while True:
            wait = self._quiet()
            left = since + self._max_delay_s - time.monotonic()
            if wait <= 0 or left <= 0:
                return
            time.sleep(min(wait, left))

    def _round(self, tasks: Sequence[Offload], arena: Arena | SharedArena) -> list[bool]:
        store = self.store
        assert store is not None
        st = RoundStats(offloads=len(tasks), offered=sum(len(t.chain) for t in tasks))
        t0, c0 = time.perf_counter(), time.thread_time()
        dev = self.pool.device
        for t in tasks:
            for ev in t.ready:
                dev.synchronize(ev)
        grants = []
        for t in tasks:
            ti = time.perf_counter()
            grants.append(
                self.index.publish_intent(
                    t.chain, [store.footprint] * len(t.chain), self.owner, parent=t.parent
                )
            )
            st.index_s += time.perf_counter() - ti
        # (task, page index) of every granted page, in order
        work = [
            (ti, i) for ti, g in enumerate(grants) if g is not None for i in range(g.start, g.stop)
        ]
        written = [0] * len(tasks)
        self._busy.set()
        try:
            per = min(arena.slots(store.object_size), MAX_PAGES)
            for lo in range(0, len(work), per):
                chunk = work[lo : lo + per]
                n = self._frame(chunk, tasks, arena, store)
                tp = time.perf_counter()
                res = self._put([tasks[ti].chain[i] for ti, i in chunk], arena, st)
                st.put_s += time.perf_counter() - tp
                for ti, _ in chunk[: res.written]:
                    written[ti] += 1
                if res.failed is not None or res.written < n:
                    logger.debug("publish stopped at %s", res.failed)
                    break
                if self._lost(arena):  # the storage process may still read these slots
                    break
        finally:
            self._busy.clear()
        oks = []
        for ti, (t, g) in enumerate(zip(tasks, grants)):
            if g is None:
                oks.append(False)
                continue
            committed = 0
            if g.start != g.stop:
                ti0 = time.perf_counter()
                c = self.index.commit(g.intent, written[ti])
                st.index_s += time.perf_counter() - ti0
                committed = c or 0
            st.committed += committed
            oks.append(g.start + committed == len(t.chain))  # the index holds every page now
        st.written = sum(written)
        st.wall_s = time.perf_counter() - t0
        st.cpu_s = time.thread_time() - c0
        if self._on_round is not None:
            self._on_round(st)
        return oks

    def _frame(
        self,
        chunk: Sequence[tuple[int, int]],
        tasks: Sequence[Offload],
        arena: Arena | SharedArena,
        store: PageStore,
    ) -> int:
        """Write page header + payload of every ``chunk`` page into consecutive arena slots."""
        pool, dev, p = self.pool, self.pool.device, self.pool.page_size
        n, obj = len(chunk), store.object_size
        ids = torch.stack([tasks[ti].page_ids[i] for ti, i in chunk]).to(torch.int64)
        rows = arena.rows(n, obj)
        if dev.is_cuda:
            with dev.copy_stream():
                staged = torch.empty((n, obj), dtype=torch.uint8, device=dev.device)
                _fill_payloads(staged, pool, dev.to_device(ids), p)
                rows.copy_(staged, non_blocking=True)
                done = dev.record()
            dev.synchronize(done)
        else:
            _fill_payloads(rows, pool, ids, p)
        host = rows.numpy()
        fmt = store.format
        for j, (ti, i) in enumerate(chunk):
            page = tasks[ti].chain[i]
            mac = fmt.mac(page)
            mac.update(host[j, HEADER_SIZE:])
            header = fmt.header(page, mac.digest())
            host[j, : len(header)] = memoryview(header)
        return n


def _fill_payloads(rows: torch.Tensor, pool: KVPool, ids: torch.Tensor, page_size: int) -> None:
    """``rows[j, HEADER_SIZE:]`` = the payload of pool page ``ids[j]`` (layer-major: K then V)."""
    n = rows.shape[0]
    if not rows.is_cuda:  # numpy on this thread (see KVPool.host_pages)
        host, idx = rows.numpy(), ids.numpy()
        pool.check_page_ids(idx)
        nb, off = pool.page_rows_nbytes, HEADER_SIZE
        for part in pool.host_pages():
            np.take(part, idx, axis=0, out=host[:, off : off + nb], mode="clip")
            off += nb
        return
    payload = (
        rows[:, HEADER_SIZE:]
        .view(pool.dtype)
        .view(n, pool.num_layers, 2, page_size, *pool.row_shape)
    )
    dev = pool.device
    for layer in range(pool.num_layers):
        payload[:, layer, 0] = dev.gather_pages(pool.k[layer], ids, page_size)
        payload[:, layer, 1] = dev.gather_pages(pool.v[layer], ids, page_size)
