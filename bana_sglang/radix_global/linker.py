"""SGLang 0.5.23 integration: the global store as a unified-cache external linker.

Enabled on a worker with::

    --page-size 16 --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "BanaGlobalLinker",
        "linker_module_path": "bana_sglang.radix_global.linker",
        "linker_extra_config": {"index": "tcp://127.0.0.1:P", "master": "127.0.0.1:M"}}'

(``python -m bana_sglang.launch`` passes this by default; ``--no-global-store``
turns it off.) Why this hook and not HiCache L3 or a radix-cache backend: see
:mod:`bana_sglang.radix_global` (one index round trip per request, the layer
counter that lets layer l+1 load while layer l computes, request-private
landing slots).

What happens per request (``UnifiedCacheLinkerWrapper`` drives the calls):

- ``match_prefix``: SGLang's device tree answers first; for the uncached tail
  the wrapper passes SGLang's chained storage hashes (which fix the tokens,
  ``extra_key`` and ``cache_salt``). :meth:`BanaGlobalLinker.lookup` maps them
  into this model's and layout's namespace (:func:`keys.namespaced`), asks the
  index once for the longest cached prefix, and verifies those pages' headers
  in the store (one batched ranged read) so that a page the index lists but
  the store lost is a miss (reported to the index), not a failed load.
- ``init_load_back`` -> :meth:`load` queues the pages into request-private
  KV slots; ``start_layer_wise_loading`` hands the batch to the load thread,
  which reads layer l of every page straight into the KV pool (zero copy:
  the pool is registered with the transfer engine) and marks layer l done;
  the forward of layer l waits for exactly that (the pool's
  ``get_key_buffer`` hook), so the read of layer l+1 overlaps the compute of
  layer l. The last layer is released only after the pages' MACs
  (keyed BLAKE2b, fed layer by layer) match.
- After an insert into the device tree, the write-through chain offloads new
  nodes (parents first) -> :meth:`offload`: the publish thread asks the index
  for an intent, writes the pages straight from the KV pool slots (locked by
  SGLang until the offload is acknowledged), and commits. Prefill workers
  publish prompts; decode workers publish finished requests (prompt and
  answer), so the next turn of a conversation hits on any prefill worker.

Failure behaviour: an index or store outage makes lookups misses and
publishing a no-op (each logged once per episode by the clients); nothing
raises into the scheduler. A load that fails *after* it started (store died
mid-read, checksum mismatch) fails its batch's layer counter: SGLang then
drops those requests' output with a 503 "External KV cache load failed"
(never wrong tokens), the bad pages are reported to the index, and the
router retries the request, which now misses and recomputes.

Limits: CPU KV pools (the GPU path needs the CUDA Mooncake
wheel or a staging copy), MHA pools with K and V of the same head dim (no
MLA/SWA/Mamba), TP size 1 per layout (TP rank is part of the key).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
    UnifiedCacheLinkerWrapper,
)

from bana_sglang.counters import CounterSet
from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.config import LINKER_NAME, LinkerConfig
from bana_sglang.radix_global.keys import KVLayout, PageHash, model_identity, namespaced
from bana_sglang.radix_global.mooncake_kv import StoreConfig
from bana_sglang.radix_global.store import PageStore
from bana_sglang.radix_global.worker_cache import GlobalKVCache

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- metrics


class _Metrics(CounterSet):
    """The store's per-worker counters (``bana_store_*_total`` on the worker's
    ``/metrics``; plain numbers always, logged at close)."""

    NAMES: ClassVar[dict[str, str]] = {
        "lookups": "Lookups of the global index (requests with an uncached tail)",
        "local_hit_tokens": "Prompt tokens found in the worker's own device tree",
        "global_hit_pages": "Pages found in the global store for an uncached tail",
        "global_hit_tokens": "Tokens found in the global store for an uncached tail",
        "lookup_tokens": "Prompt tokens looked up (device tree + global index)",
        "loaded_pages": "Pages loaded from the global store",
        "loaded_bytes": "Bytes loaded from the global store",
        "load_seconds": "Time the load thread spent loading (start to last layer)",
        "load_wait_seconds": "Time the forward pass waited for a layer to land",
        "load_failures": "Load batches that failed after starting",
        "published_pages": "Pages this worker wrote and committed to the global store",
        "published_bytes": "Bytes this worker wrote to the global store",
        "publish_seconds": "Time spent publishing (intent, write, commit)",
        "publish_skipped_pages": "Pages offered but not written (present, pending elsewhere, no room, down)",
    }

    def __init__(self) -> None:
        super().__init__("bana_store", self.NAMES)

    def summary(self) -> str:
        v = self.values
        hidden = 1.0 - v["load_wait_seconds"] / v["load_seconds"] if v["load_seconds"] else 0.0
        return (
            f"lookups={v['lookups']:.0f} local_hit_tokens={v['local_hit_tokens']:.0f} "
            f"global_hit_tokens={v['global_hit_tokens']:.0f} loaded={v['loaded_bytes'] / 1e6:.1f}MB "
            f"in {v['load_seconds']:.2f}s (hidden {hidden:.0%}) published={v['published_pages']:.0f} pages "
            f"{v['published_bytes'] / 1e6:.1f}MB failures={v['load_failures']:.0f}"
        )


class _TimedCounter(LayerWiseLoadCounter):
    """SGLang's layer counter, timing how long the forward waits for each layer."""

    def __init__(self, num_layers: int, metrics: _Metrics):
        super().__init__(num_layers)
        self._metrics = metrics

    def wait_until(self, threshold: int) -> None:
        futures = self.futures.get(self.consumer_index)
        if futures is None or futures[threshold].done():
            return super().wait_until(threshold)
        t0 = time.perf_counter()
        super().wait_until(threshold)
        self._metrics.add("load_wait_seconds", time.perf_counter() - t0)


# ---------------------------------------------------------------------- linker


class _Load(NamedTuple):
    chain: list[PageHash]
    slots: torch.Tensor  # int64 KV slots, len(chain) * page_size, page-aligned


class _Offload(NamedTuple):
    chain: list[PageHash]
    parent: PageHash | None
    slots: torch.Tensor


class LoadFailed(RuntimeError):
    pass


def _page_starts(slots: torch.Tensor, page_size: int) -> list[int]:
    """First slot of every page; raises when a page's slots are not one aligned run
    (SGLang's paged allocator always gives such runs when page_size > 1)."""
    if slots.numel() % page_size:
        raise ValueError(f"{slots.numel()} slots is not a whole number of {page_size}-token pages")
    pages = slots.view(-1, page_size)
    starts = pages[:, 0]
    if page_size > 1 and not bool(((pages - starts[:, None]) == torch.arange(page_size)).all()):
        raise ValueError("KV slots of a page are not contiguous")
    return starts.tolist()


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
        if k[0].device.type != "cpu":
            raise ValueError(
                f"{LINKER_NAME} in this version reads into CPU KV pools only "
                f"(the pool is on {k[0].device}); run the worker with --device cpu"
            )
        if k[0].shape[1:] != v[0].shape[1:] or k[0].dtype != v[0].dtype:
            raise ValueError(f"{LINKER_NAME} needs K and V of the same shape and dtype")
        self.k_buffer, self.v_buffer = list(k), list(v)
        self.page_size = int(params.page_size)
        self.num_layers = len(k)
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
            dtype=str(k[0].dtype),
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
        self.metrics = _Metrics()
        self.pools = {PoolName.KV: kvcache}
        self.layer_done_counter = _TimedCounter(self.num_layers, self.metrics)

        # Two store clients: one for lookups and loads (the request path), one for
        # publishing. A Mooncake client serialises its calls, and puts were seen to
        # stall for up to Mooncake's 60 s transfer timeout on the overloaded 2-core
        # machine: on a shared client every lookup would have waited behind them.
        store_cfg = StoreConfig.from_env(self.cfg.master)
        self.store = PageStore.connect(self.layout, store_cfg)
        publish_store = PageStore.connect(self.layout, store_cfg)
        for buf in self.k_buffer + self.v_buffer:  # zero copy both ways
            self.store.register(buf)
            publish_store.register(buf)
        self.index = IndexClient(self.cfg.index, name=f"{self.cfg.owner}/lookup")
        self._publisher = GlobalKVCache(
            self.layout,
            IndexClient(self.cfg.index, name=f"{self.cfg.owner}/publish"),
            publish_store,
            self.cfg.owner,
        )
        self._loss_index = IndexClient(self.cfg.index, name=f"{self.cfg.owner}/load")

        self.pending_loads: dict[str, _Load] = {}
        self.load_queue: queue.Queue[tuple[int, list[_Load]] | None] = queue.Queue()
        self.offload_queue: queue.Queue[_Offload | None] = queue.Queue()
        self.offload_results: queue.Queue[bool] = queue.Queue()
        self.next_offload_parent: str | None = None  # set by BanaLinkerWrapper per node
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(self.load_queue, self._load_task),
                daemon=True,
                name="bana-store-load",
            ),
            threading.Thread(
                target=self._serve,
                args=(self.offload_queue, self._offload_task),
                daemon=True,
                name="bana-store-publish",
            ),
        ]
        for t in self._threads:
            t.start()
        logger.info(
            "global KV store linker: index %s, master %s, layout %s (digest %s), %d-token pages "
            "of %d bytes",
            self.cfg.index,
            self.cfg.master,
            self.layout.model,
            self.layout.digest[:12],
            self.page_size,
            self.store.object_size,
        )

    # -- helpers
    def _chain(self, sglang_hashes: Sequence[str]) -> list[PageHash]:
        return [namespaced(h, self.layout) for h in sglang_hashes]

    def _parts(self, start: int, layers: range | None = None) -> list[torch.Tensor]:
        """Page payload parts in the store's layer-major order: K then V per layer."""
        end = start + self.page_size
        out: list[torch.Tensor] = []
        for layer in layers if layers is not None else range(self.num_layers):
            out += [self.k_buffer[layer][start:end], self.v_buffer[layer][start:end]]
        return out

    @staticmethod
    def _kv(transfers: list[PoolTransfer]) -> PoolTransfer | None:
        return next((t for t in transfers if t.name == PoolName.KV), None)

    # -- lookup (scheduler thread)
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = self._kv(transfers)
        if kv is None or not kv.keys:
            return []
        chain = self._chain(kv.keys)
        self.metrics.add("lookups")
        match = self.index.lookup(chain, any_parent=True)
        n = match.length
        if n:
            read = self.store.layerwise(chain[:n])
            miss = read.start()
            read.close()  # headers only: payloads are checked when they are loaded
            if miss is not None:
                n = len(read.pages)
                self._report(miss, self.index)
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
    def _slots(self, transfers: list[PoolTransfer]) -> tuple[PoolTransfer, torch.Tensor] | None:
        """The KV transfer and its slots, when it is a whole number of pages to move."""
        kv = self._kv(transfers)
        if kv is None or kv.device_indices is None or not kv.keys:
            return None
        slots = kv.device_indices.to(torch.int64).cpu()
        if slots.numel() != len(kv.keys) * self.page_size:
            return None
        return kv, slots

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if rid in self.pending_loads:
            raise RuntimeError(f"a global-store load for rid={rid} is already queued")
        got = self._slots(transfers)
        if got is None:
            return False
        kv, slots = got
        self.pending_loads[rid] = _Load(self._chain(kv.keys), slots)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = list(self.pending_loads.values()), {}
        index = self.layer_done_counter.update_producer()
        self.load_queue.put((index, pending))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed = self.layer_done_counter.finish(counter_index)
        if not landed:
            self.metrics.add("load_failures")
        return landed

    @staticmethod
    def _serve(q: queue.Queue, handle) -> None:
        """A worker thread: ``handle`` each task until None; ``join()`` works on ``q``."""
        while True:
            task = q.get()
            try:
                if task is None:
                    return
                handle(task)
            finally:
                q.task_done()

    def _load_task(self, task: tuple[int, list[_Load]]) -> None:
        index, loads = task
        try:
            self._load_batch(index, loads)
        except BaseException as e:  # any failure fails the batch, never hangs it
            logger.exception("global store load batch failed")
            self.layer_done_counter.fail(index, e)

    def _load_batch(self, index: int, loads: list[_Load]) -> None:
        t0 = time.perf_counter()
        chain = [p for ld in loads for p in ld.chain]
        starts = [s for ld in loads for s in _page_starts(ld.slots, self.page_size)]
        read = self.store.layerwise(chain)
        miss = read.start()
        if miss is not None:
            read.close()
            self._report(miss, self._loss_index)
            raise LoadFailed(f"page {miss.page}: {miss.reason} {miss.detail}")
        last = self.num_layers - 1
        for layer in range(self.num_layers):
            miss = read.read_layer(layer, [self._parts(s, range(layer, layer + 1)) for s in starts])
            if miss is not None:
                read.close()
                self._report(miss, self._loss_index)
                raise LoadFailed(f"layer {layer} of page {miss.page}: {miss.reason} {miss.detail}")
            if layer < last:  # the last layer is released once the checksums match
                self.layer_done_counter.complete(index, layer)
        miss = read.finish()
        if miss is not None:
            self._report(miss, self._loss_index)
            raise LoadFailed(f"page {miss.page}: {miss.reason}")
        self.layer_done_counter.complete(index, last)
        self.metrics.add("loaded_pages", len(chain))
        self.metrics.add("loaded_bytes", len(chain) * self.layout.page_nbytes)
        self.metrics.add("load_seconds", time.perf_counter() - t0)

    # -- offloads (publishing)
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        parent, self.next_offload_parent = self.next_offload_parent, None
        got = self._slots(transfers)
        if got is None:
            return False
        kv, slots = got
        self.offload_queue.put(
            _Offload(
                self._chain(kv.keys), namespaced(parent, self.layout) if parent else None, slots
            )
        )
        return True

    def _offload_task(self, task: _Offload) -> None:
        try:
            ok = self._publish(task)
        except BaseException:  # a failed publish is a skipped publish
            logger.exception("global store publish failed")
            ok = False
        self.offload_results.put(ok)

    def _publish(self, task: _Offload) -> bool:
        t0 = time.perf_counter()
        parts = [self._parts(s) for s in _page_starts(task.slots, self.page_size)]
        res = self._publisher.publish(task.chain, parts, parent=task.parent)
        self.metrics.add("published_pages", res.committed)
        self.metrics.add("published_bytes", res.written * self.layout.page_nbytes)
        self.metrics.add("publish_skipped_pages", len(task.chain) - res.committed)
        self.metrics.add("publish_seconds", time.perf_counter() - t0)
        if res.note and res.note != "present":
            logger.debug(
                "publish of %d pages: %d committed (%s)", len(task.chain), res.committed, res.note
            )
        return res.complete

    def num_completed_offloads(self) -> int:
        return self.offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self.offload_results.get_nowait()

    # -- lifecycle
    def make_wrapper(self, cache) -> BanaLinkerWrapper:
        """The wrapper ``cache`` (a ``UnifiedRadixCache``) drives this linker
        through (installed by :func:`bana_sglang.radix_global.hooks.init_cache_linker_hook`)."""
        return BanaLinkerWrapper(cache, self)

    def reset(self) -> None:
        self.pending_loads.clear()
        self.load_queue.join()
        self.offload_queue.join()
        while True:
            try:
                self.offload_results.get_nowait()
            except queue.Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self.load_queue.put(None)
        self.offload_queue.put(None)
        for t in self._threads:
            t.join(timeout=10)
        logger.info("global KV store linker stats: %s", self.metrics.summary())
        for client in (self.index, self._loss_index, self._publisher.index):
            client.close()
        self.store.kv.close()
        self._publisher.store.kv.close()


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
