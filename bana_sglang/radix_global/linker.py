"""SGLang 0.5.23 integration: the global store as a unified-cache external linker.

Enabled on a worker with::

    --page-size 16 --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "BanaGlobalLinker",
        "linker_module_path": "bana_sglang.radix_global.linker",
        "linker_extra_config": {"index": "tcp://127.0.0.1:P", "master": "127.0.0.1:M"}}'

(``python -m bana_sglang.launch`` passes this by default; ``--no-global-store``
turns it off.) Why this hook and not HiCache L3 or a radix-cache backend: see
:mod:`bana_sglang.radix_global`.

What happens per request (``UnifiedCacheLinkerWrapper`` drives the calls):

- ``match_prefix``: SGLang's device tree answers first; for the uncached tail
  the wrapper passes SGLang's chained storage hashes. :meth:`BanaGlobalLinker.lookup`
  maps them into this model's and layout's namespace, asks the index once for
  the longest cached prefix, asks the :class:`~cost.CostModel` whether loading
  those pages beats computing their tokens on this worker (measured, see
  :mod:`.cost`), and asks the store whether it holds them (one round trip to the
  master, no data), so that a page the index lists but the store lost is a miss.
- ``init_load_back`` -> :meth:`load` queues the pages into request-private KV
  slots; ``start_layer_wise_loading`` hands the batch to the load thread, which
  runs the :class:`~loader.Loader` (staged through the host arena or direct
  into the pool, ``BANA_STORE_MODE``) group of layers by group, completing each
  layer on the :class:`~layer_counter.LayerCounter` the forward waits on (a CPU
  worker on the storage process's host has it copy the whole pages into a shared
  arena instead, ``BANA_STORE_LOCAL_LOADS``). Each
  page's header comes with its first layers and is checked before they are
  used; the last layer is released only after every page's MAC matched.
- After an insert into the device tree, the write-through chain offloads new
  nodes (parents first) -> :meth:`offload`: the :class:`~publisher.Publisher`
  thread publishes them in batches, at a lower priority (prefill workers
  publish prompts; decode workers the prompts that arrive and what they
  generate). A decode worker holds back the offer SGLang makes when a request's
  KV arrives from its prefill worker (``hooks.prebuilt_hook``: that offer comes
  before the request's first token) until the first token is out
  (``BANA_STORE_PUBLISH_ARRIVAL_DELAY_MS``); whichever worker asks the index first
  writes the prompt's pages.

The worker's pool may be on the CPU or on a CUDA device
(:class:`~device.Device`): on CUDA the load's copies run on a side stream after
the scheduler's queued work, the forward waits for each layer's event on the
GPU, and a publish waits for SGLang's offload-ready events before it reads.

Failure behaviour: an index or store outage makes lookups misses and
publishing a no-op (each logged once per episode by the clients); nothing
raises into the scheduler. A load that fails *after* it started (store died
mid-read, MAC mismatch) fails its batch's layer counter: SGLang then drops
those requests' output with a 503 "External KV cache load failed" (never
wrong tokens), the bad pages are reported to the index, and the router
retries the request, which now misses and recomputes. A staged load that hangs
(its storage process stopped mid-transfer) fails the same way once the forward
has waited ``BANA_STORE_LOAD_TIMEOUT_S`` for one layer; its late bytes never
reach the pool (:class:`~layer_counter.LoadGate`), and lookups miss until the
load thread is back from it, so that the retry recomputes instead of queueing
behind the stuck read.

Limits: MHA pools with K and V of the same head dim (no MLA/SWA/Mamba), TP size
1 per layout (TP rank is part of the key).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    UnifiedCacheLinker,
    UnifiedCacheLinkerWrapper,
)

from bana_sglang import envs
from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.config import LINKER_NAME, LinkerConfig
from bana_sglang.radix_global.cost import CostModel
from bana_sglang.radix_global.keys import (
    KVLayout,
    PageHash,
    model_identity,
    namespaced,
    namespaced_chain,
)
from bana_sglang.radix_global.layer_counter import LayerCounter, LoadCancelled, LoadGate
from bana_sglang.radix_global.linker_metrics import StoreDurations, StoreMetrics
from bana_sglang.radix_global.loader import Loader
from bana_sglang.radix_global.mooncake_kv import StoreConfig
from bana_sglang.radix_global.pool import Arena, KVPool
from bana_sglang.radix_global.publisher import (
    Offload,
    Publisher,
    RoundStats,
    name_native_thread,
)
from bana_sglang.radix_global.shm_arena import LocalLoads
from bana_sglang.radix_global.store import PageStore
from bana_sglang.wire.storage import MAX_ARENA_BYTES

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- linker


class _Load(NamedTuple):
    chain: list[PageHash]
    page_ids: torch.Tensor  # pool pages, CPU int64


class LoadFailed(RuntimeError):
    pass


class BanaGlobalLinker(UnifiedCacheLinker):
    """The global KV cache store behind SGLang's unified-cache linker interface."""

    def __init__(self, server_args, params, *, components, extra_config=None, forward_stream=None):
        unsupported = set(components) - {ComponentType.FULL}
        if unsupported:
            raise ValueError(
                f"{LINKER_NAME} supports full-attention KV only, not "
                f"{sorted(c.name for c in unsupported)}"
            )
        self.forward_stream = forward_stream
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        k, v = getattr(kvcache, "k_buffer", None), getattr(kvcache, "v_buffer", None)
        if not k or not v or len(k) != len(v):
            raise ValueError(
                f"{LINKER_NAME} needs an MHA KV pool with k_buffer/v_buffer, "
                f"got {type(kvcache).__name__}"
            )
        if k[0].shape[1:] != v[0].shape[1:] or k[0].dtype != v[0].dtype:
            raise ValueError(f"{LINKER_NAME} needs K and V of the same shape and dtype")
        self.pool = KVPool(k, v, int(params.page_size))
        self.device = self.pool.device
        self.page_size = self.pool.page_size
        self.num_layers = self.pool.num_layers
        tp_rank, tp_size = 0, 1
        group = params.attn_tp_cache_group or params.tp_cache_group
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and group is not None
        ):
            tp_rank, tp_size = (
                torch.distributed.get_rank(group=group),
                torch.distributed.get_world_size(group=group),
            )
        self.layout = KVLayout(
            model=model_identity(server_args.model_path),
            dtype=str(k[0].dtype).removeprefix("torch."),
            page_size=self.page_size,
            num_kv_heads=int(k[0].shape[1]),
            head_dim=int(k[0].shape[2]),
            num_layers=self.num_layers,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        role = getattr(server_args, "disaggregation_mode", "null")
        self.cfg = LinkerConfig.from_extra(
            extra_config, f"{role}@{server_args.host}:{server_args.port}"
        )
        self.metrics = StoreMetrics()
        self.durations = StoreDurations()
        self.pools = {PoolName.KV: kvcache}
        self.mode = envs.BANA_STORE_MODE.get()
        timeout_s = envs.BANA_STORE_LOAD_TIMEOUT_S.get()
        self.layer_done_counter = LayerCounter(
            self.num_layers,
            self.device,
            self._waited,
            # a direct load lands in the pool itself: a late transfer could not be stopped
            timeout_s=timeout_s if timeout_s > 0 and self.mode == "staged" else None,
            on_timeout=self._timed_out,
        )
        self._loading: LoadGate | None = None  # the gate of the load the load thread is in
        self.cost = CostModel(self.page_size, policy=envs.BANA_STORE_LOAD_POLICY.get())
        settle_ms = envs.BANA_STORE_PUBLISH_SETTLE_MS.get()
        if settle_ms < 0:  # auto: a CPU forward competes with publishing for the cores
            settle_ms = 0 if self.device.is_cuda else 50
        self._settle_s = settle_ms / 1e3
        self._arrival_delay_s = envs.BANA_STORE_PUBLISH_ARRIVAL_DELAY_MS.get() / 1e3
        self._forwarding = False
        self._last_forward_end = 0.0
        arena_bytes = envs.BANA_STORE_ARENA_BYTES.get()

        # Two store clients: one for lookups and loads (the request path), one for
        # publishing, owned by the publish thread (a Mooncake client serialises its
        # calls; on a shared client every lookup would wait behind a put).
        store_cfg = StoreConfig.from_env(self.cfg.master)
        self.store = PageStore.connect(self.layout, store_cfg)
        arena = None
        if self.mode == "staged" or self.device.is_cuda:
            arena = Arena(self.device, arena_bytes, self.store.kv)
        if self.mode == "direct":
            for buf in self.pool.buffers():  # ranged reads land straight in the pool
                self.store.kv.register(buf.data_ptr(), buf.numel() * buf.element_size())
        self.local_loads = None
        if (
            self.cfg.storage
            and envs.BANA_STORE_LOCAL_LOADS.get()
            and self.mode == "staged"
            and not self.device.is_cuda
            and arena_bytes <= MAX_ARENA_BYTES
        ):
            self.local_loads = LocalLoads(
                self.cfg.storage, f"{self.cfg.owner}/tp{tp_rank}/load", arena_bytes
            )
        self.loader = Loader(
            self.pool,
            self.mode,
            arena,
            growth=envs.BANA_STORE_GROUP_GROWTH.get(),
            min_slice_bytes=envs.BANA_STORE_MIN_SLICE_BYTES.get(),
            local=self.local_loads,
        )
        if self.mode == "direct":
            self.loader.register_headers(self.store.kv)
        self.index = IndexClient(self.cfg.index, name=f"{self.cfg.owner}/lookup")
        self._loss_index = IndexClient(self.cfg.index, name=f"{self.cfg.owner}/load")
        total_pages = k[0].shape[0] // self.page_size
        self.publisher = Publisher(
            self.pool,
            lambda: PageStore.connect(self.layout, store_cfg),
            IndexClient(self.cfg.index, name=f"{self.cfg.owner}/publish"),
            self.cfg.owner,
            arena_bytes=arena_bytes,
            nice=envs.BANA_STORE_PUBLISH_NICE.get(),
            max_pending_pages=max(1, total_pages // 4),
            on_round=self._published,
            quiet=self._quiet if role == "prefill" else None,
            max_delay_s=envs.BANA_STORE_PUBLISH_MAX_DELAY_MS.get() / 1e3,
            storage=self.cfg.storage,
            # one shared arena per scheduler process: TP ranks of a worker map their own
            arena_owner=f"{self.cfg.owner}/tp{tp_rank}",
        )

        self.pending_loads: dict[str, _Load] = {}
        self.load_queue: queue.Queue[tuple[int, list[_Load], object] | None] = queue.Queue()
        self.next_offload_parent: str | None = None  # set by BanaLinkerWrapper per node
        self.arrivals = False  # set by hooks.prebuilt_hook (decode workers): offers are held
        self._wait_acc = 0.0
        self._timers: collections.deque = collections.deque()
        self._load_thread = threading.Thread(
            target=self._serve, daemon=True, name="bana-store-load"
        )
        self._load_thread.start()
        _warm_page_hashing(self.page_size)
        logger.info(
            "global KV store linker: index %s, master %s, layout %s (digest %s), %d-token pages "
            "of %d bytes, %s loads into a %s pool, load policy %s",
            self.cfg.index,
            self.cfg.master,
            self.layout.model,
            self.layout.digest[:12],
            self.page_size,
            self.store.object_size,
            self.mode,
            self.device.device,
            self.cost.policy,
        )

    # -- helpers
    def _chain(self, sglang_hashes: Sequence[str]) -> list[PageHash]:
        return namespaced_chain(sglang_hashes, self.layout)

    @staticmethod
    def _kv(transfers: list[PoolTransfer]) -> PoolTransfer | None:
        return next((t for t in transfers if t.name == PoolName.KV), None)

    def _waited(self, seconds: float) -> None:
        self.metrics.add("load_wait_seconds", seconds)
        self._wait_acc += seconds

    def _timed_out(self, index: int, layer: int) -> None:
        """The forward gave load ``index`` up at ``layer`` (scheduler thread)."""
        self.metrics.add("load_timeouts")
        logger.warning(
            "global store load %d: layer %d did not land within %g s; its requests are "
            "answered 503 (retried by the router) and lookups miss until the read returns",
            index,
            layer,
            self.layer_done_counter.timeout_s,
        )

    # -- lookup (scheduler thread)
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return []
        loading = self._loading
        if loading is not None and loading.timed_out:
            # the load thread is still in a load given up on: a hit would wait behind it
            self.metrics.add("stuck_lookups")
            return []
        chain = self._chain(kv.keys)
        self.metrics.add("lookups")
        t0 = time.perf_counter()
        match = self.index.lookup(chain, any_parent=True)
        t1 = time.perf_counter()
        self.durations.observe("lookup_index_seconds", t1 - t0)
        n = match.length
        if n:
            decision = self.cost.decide(n)
            if not decision.load:
                self.metrics.add("recomputed_hit_pages", n)
                logger.debug(
                    "rid=%s: recomputing %d hit pages (load %.1f ms > compute %.1f ms)",
                    rid,
                    n,
                    decision.load_s * 1e3,
                    decision.compute_s * 1e3,
                )
                return []
            # a page the index lists but the store lost is a miss now, not a failed load;
            # headers and MACs are checked as the pages land
            n, miss = self.store.present(chain[:n])
            if miss is not None:
                self._report(miss, self.index)
            self.durations.observe("lookup_header_seconds", time.perf_counter() - t1)
        if n:
            self.metrics.add("global_hit_pages", n)
            self.metrics.add("global_hit_tokens", n * self.page_size)
            logger.debug("global store hit: rid=%s %d of %d tail pages", rid, n, len(chain))
        return list(range(1, n + 1))

    def _report(self, miss, index: IndexClient) -> None:
        if miss.reason in ("unavailable",):
            return
        logger.info(
            "page %s listed by the index but unusable in the store (%s %s); reporting it",
            miss.page,
            miss.reason,
            miss.detail,
        )
        index.report_loss([miss.page], self.cfg.owner)

    # -- loads
    def _pages(self, transfers: list[PoolTransfer]) -> tuple[PoolTransfer, torch.Tensor] | None:
        """The KV transfer and its pool pages, when it is a whole number of pages to move."""
        kv = self._kv(transfers)
        if kv is None or kv.device_indices is None or not kv.keys:
            return None
        slots = kv.device_indices.to(torch.int64).cpu()
        if slots.numel() != len(kv.keys) * self.page_size:
            return None
        try:
            return kv, self.pool.page_ids(slots)
        except ValueError:
            logger.warning("KV slots that are not whole aligned pages: not moved", exc_info=True)
            return None

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if rid in self.pending_loads:
            raise RuntimeError(f"a global-store load for rid={rid} is already queued")
        got = self._pages(transfers)
        if got is None:
            return False
        kv, page_ids = got
        self.pending_loads[rid] = _Load(self._chain(kv.keys), page_ids)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = list(self.pending_loads.values()), {}
        index = self.layer_done_counter.update_producer()
        # what the scheduler queued before this load (CUDA): the copies start after it
        self.load_queue.put((index, pending, self.device.ready_event()))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed = self.layer_done_counter.finish(counter_index)
        self.durations.observe("load_wait_batch_seconds", self._wait_acc)
        self._wait_acc = 0.0
        if not landed:
            self.metrics.add("load_failures")
        return landed

    def _serve(self) -> None:
        name_native_thread("bana-load")
        if self.local_loads is not None:
            self.local_loads.arena()  # mapped now rather than by the first load
        while True:
            task = self.load_queue.get()
            try:
                if task is None:
                    return
                index, loads, ready = task
                gate = self._loading = self.layer_done_counter.gate(index)
                try:
                    self._load_batch(index, loads, ready, gate)
                except LoadCancelled:
                    logger.info("global store load %d: stopped, the forward gave it up", index)
                except BaseException as e:  # any failure fails the batch, never hangs it
                    logger.exception("global store load batch failed")
                    self.layer_done_counter.fail(index, e)
                finally:
                    self._loading = None
            finally:
                self.load_queue.task_done()

    def _load_batch(self, index: int, loads: list[_Load], ready, gate: LoadGate) -> None:
        gate.check()  # given up while it was queued (behind a stuck one): nothing to do
        t0 = time.perf_counter()
        chain = [p for ld in loads for p in ld.chain]
        page_ids = torch.cat([ld.page_ids for ld in loads])
        read = self.store.layerwise(chain, headers_inline=True)
        miss = read.start(session=not self.loader.goes_local(len(chain), self.store.object_size))
        t_started = time.perf_counter()
        if miss is not None:
            read.close()
            self._report(miss, self._loss_index)
            raise LoadFailed(f"page {miss.page}: {miss.reason} {miss.detail}")
        counter = self.layer_done_counter
        miss, stats = self.loader.load(
            read, page_ids, lambda layer, ev: counter.complete(index, layer, ev), ready, gate
        )
        if miss is not None:
            self._report(miss, self._loss_index)
            raise LoadFailed(f"page {miss.page}: {miss.reason} {miss.detail}")
        counter.complete(index, self.num_layers - 1, stats.event)
        seconds = time.perf_counter() - t0
        logger.debug(
            "load of %d pages: %.1f ms (session %.1f, reads %.1f, MACs %.1f, copies %.1f; "
            "%d groups)",
            len(chain),
            seconds * 1e3,
            (t_started - t0) * 1e3,
            stats.read_s * 1e3,
            stats.verify_s * 1e3,
            stats.copy_s * 1e3,
            stats.groups,
        )
        self.cost.observe_load(len(chain), seconds)
        self.metrics.add("loaded_pages", len(chain))
        self.metrics.add("loaded_bytes", stats.bytes)
        self.metrics.add("load_seconds", seconds)
        self.metrics.add("load_read_seconds", stats.read_s)
        self.metrics.add("load_session_seconds", t_started - t0)
        self.metrics.add("load_verify_seconds", stats.verify_s)
        self.metrics.add("load_copy_seconds", stats.copy_s)
        self.metrics.add("local_loaded_pages", stats.local_pages)
        self.durations.observe("load_batch_seconds", seconds)

    # -- forwards (the scheduler's run_batch hook)
    def forward_began(self) -> None:
        self._forwarding = True

    def forward_ended(self) -> None:
        self._forwarding = False
        self._last_forward_end = time.monotonic()

    def _quiet(self) -> float:
        """Seconds until publishing should start (the publisher's ``quiet``): a while
        after the last prefill forward, so the request's KV transfer and its first
        decode step do not share the cores with a publish."""
        if self._forwarding:
            return self._settle_s or 0.0
        return self._last_forward_end + self._settle_s - time.monotonic()

    def observe_forward(self, tokens: int, timer, publishing: bool) -> None:
        """A prefill forward without a load computed ``tokens`` in ``timer``'s time."""
        self._timers.append((tokens, timer, publishing))
        while self._timers:
            tokens, timer, publishing = self._timers[0]
            seconds = timer.seconds()
            if seconds is None:  # CUDA: not done yet
                break
            self._timers.popleft()
            self.cost.observe_prefill(tokens, seconds)
            self.metrics.add("forward_tokens", tokens)
            self.metrics.add("forward_seconds", seconds)
            if publishing:
                self.metrics.add("forward_tokens_publishing", tokens)
                self.metrics.add("forward_seconds_publishing", seconds)

    # -- offloads (publishing)
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        parent, self.next_offload_parent = self.next_offload_parent, None
        got = self._pages(transfers)
        if got is None:
            return False
        kv, page_ids = got
        if not self.publisher.accepts(len(kv.keys)):
            self.metrics.add("publish_skipped_pages", len(kv.keys))
            return False
        ready = self.record_offload_ready() if self.device.is_cuda else []
        not_before = 0.0
        if self.arrivals:  # a prompt whose KV has just arrived: after its first token is out
            not_before = time.monotonic() + self._arrival_delay_s
            self.metrics.add("publish_held_arrival_pages", len(kv.keys))
        self.publisher.submit(
            Offload(
                self._chain(kv.keys),
                namespaced(parent, self.layout) if parent else None,
                page_ids,
                ready,
                not_before=not_before,
            )
        )
        return True

    def _published(self, st: RoundStats) -> None:
        self.metrics.add("published_pages", st.committed)
        self.metrics.add("published_bytes", st.written * self.store.object_size)
        self.metrics.add("published_local_pages", st.local_pages)
        self.metrics.add("publish_skipped_pages", st.offered - st.committed)
        self.metrics.add("publish_seconds", st.wall_s)
        self.metrics.add("publish_cpu_seconds", st.cpu_s)
        self.durations.observe("publish_round_seconds", st.wall_s)
        self.durations.observe("publish_round_cpu_seconds", st.cpu_s)
        self.durations.observe("publish_index_seconds", st.index_s)

    def num_completed_offloads(self) -> int:
        return self.publisher.results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.publisher.results.get_nowait()

    # -- lifecycle
    def make_wrapper(self, cache) -> BanaLinkerWrapper:
        """The wrapper ``cache`` (a ``UnifiedRadixCache``) drives this linker
        through (installed by :func:`bana_sglang.radix_global.hooks.init_cache_linker_hook`)."""
        return BanaLinkerWrapper(cache, self)

    def reset(self) -> None:
        self.pending_loads.clear()
        self.load_queue.join()
        self.publisher.join()
        while True:
            try:
                self.publisher.results.get_nowait()
            except queue.Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self.load_queue.put(None)
        self._load_thread.join(timeout=10)
        self.publisher.close()
        if self.local_loads is not None:
            self.local_loads.close()
        logger.info("global KV store linker stats: %s", self.metrics.summary())
        for client in (self.index, self._loss_index, self.publisher.index):
            client.close()
        self.store.kv.close()


def _warm_page_hashing(page_size: int) -> None:
    """SGLang hashes the pages a lookup asks for with a C++ extension that it loads
    (about 50 ms here; building it, on a machine without the cached build, takes
    seconds) on its first use: the first request's lookup. Pay that at start-up."""
    try:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        get_storage_hash_str([0] * page_size, None, page_size=page_size)
    except Exception:  # the first lookup pays it (or fails the same way) instead
        logger.warning("could not load SGLang's page hashing at start-up", exc_info=True)


# ---------------------------------------------------------------------- wrapper


class BanaLinkerWrapper(UnifiedCacheLinkerWrapper):
    """SGLang's wrapper plus two things the linker interface does not carry:
    the parent page of each offloaded node (the index is a prefix tree: a
    chain that starts below the root is attached after its parent's last
    page), and the device-tree hit of each match (for the local-hit metric)."""

    def match(self, key, req, result):
        linker = self.cache_linker
        linker.metrics.add("local_hit_tokens", result.device_prefix_len)
        linker.metrics.add("lookup_tokens", len(key))
        return super().match(key, req, result)

    def _offload_node(self, node_id, transfers):
        prefix = self.cache.tree_core.get_prefix_hash_values(node_id)
        self.cache_linker.next_offload_parent = prefix[-1] if prefix else None
        try:
            return super()._offload_node(node_id, transfers)
        finally:
            self.cache_linker.next_offload_parent = None
