"""Global KV cache store: one global prefix index over Mooncake-held KV pages.

Modules (one role each):

- ``keys``: :class:`~keys.KVLayout` (model identity + KV layout + TP rank) and
  its namespace digest; :func:`~keys.page_chain` (chained BLAKE2b page hashes
  over full pages); :func:`~keys.namespaced` (maps a foreign chained hash, e.g.
  SGLang's storage hash, into a layout's namespace).
- ``index``: :class:`~index.GlobalPrefixIndex`, pure and single-threaded:
  prefix-closed, capacity-bounded, LRU-among-leaves eviction, ``forget`` of
  lost pages with their descendants.
- ``service``: the index service process, answering the index channel
  (:mod:`bana_sglang.wire.index`) on a :class:`bana_sglang.wire.transport.Server`.
  It removes evicted/forgotten/abandoned pages from the store itself and
  detects a store that restarted empty.
- ``client``: :class:`~client.IndexClient` (timeouts, fail-fast during outages,
  one log line per episode); torch-free, so the router uses it too.
- ``mooncake_kv``: the only caller of ``MooncakeDistributedStore``: native codes
  -> ``StoreError``, outage gate; :class:`~mooncake_kv.StoreConfig`.
- ``page_format``: the stored form of a page (192-byte header: magic, version,
  layout digest, page hash, dtype, shape, length, a keyed BLAKE3 MAC; then the
  payload) and its verification.
- ``store``: :class:`~store.PageStore`, framed and verified pages, zero-copy
  multi-buffer puts/gets, and :class:`~layerwise.LayerwiseRead`, ranged reads of
  groups of layers of many pages.
- ``device``: the seam between CPU and CUDA pools (streams, events, pinned
  memory, indexed copies between host rows and pool pages, forward timers).
- ``pool``: :class:`~pool.KVPool` (a worker's per-layer K/V buffers as pages) and
  :class:`~pool.Arena` (a registered host buffer pages move through).
- ``loader``: :class:`~loader.Loader`, a load group of layers by group, staged
  through the arena or direct into the pool, every page verified.
- ``publisher``: :class:`~publisher.Publisher`, the publish thread: batched,
  framed one slice per page, fenced, at a lower priority, after a quiet moment.
- ``layer_counter``: :class:`~layer_counter.LayerCounter`, what a forward waits
  on per layer (GPU-side event waits on CUDA).
- ``cost``: :class:`~cost.CostModel`, load or recompute a hit, from measured
  load and prefill times.
- ``storage_server``: the dedicated storage process, the only one contributing
  memory (workers and the index use ``global_segment_size=0``).
- ``worker_cache``: :class:`~worker_cache.GlobalKVCache`, the fail-soft facade
  over index client + page store (lookup -> load -> report loss; intent -> put
  -> commit) that the store's tests and tools use.
- ``linker``: :class:`~linker.BanaGlobalLinker`, the store behind SGLang's
  unified-cache external linker (imports SGLang and torch).
- ``linker_metrics``: the linker's ``bana_store_*`` counters and histograms.
- ``config``: the SGLang flags that attach the linker to a worker and the
  linker's parsed configuration (cheap: the launcher imports it).
- ``hooks``: the SGLang hooks the plugin registers for the linker.
- ``summary``: the per-worker store counters, scraped from ``/metrics``.
- ``bench_store``: smoke bandwidth of the page store.

Invariants across the subpackage: a load returns verified bytes of the right
page and layout or a miss; the index is prefix-closed and within capacity; no
index or store failure raises into a request path (misses instead); only the
index service removes pages from the store.

Integration with SGLang 0.5.23
------------------------------

The launcher attaches the store to every worker (``--no-global-store`` turns it
off) through the **unified-cache external linker** with the ``dynamic``
backend (:func:`config.linker_args`)::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "BanaGlobalLinker",
        "linker_module_path": "bana_sglang.radix_global.linker",
        "linker_extra_config": {"index": "tcp://127.0.0.1:P", "master": "127.0.0.1:M"}}'

Why this hook (``mem_cache/unified_cache/unified_cache_linker.py``,
``linker_factory.py``; reference backend
``mem_cache/storage/mooncake_store/mooncake_direct_linker.py``):

1. One lookup per request. ``UnifiedCacheLinkerWrapper.match`` calls
   ``linker.lookup(rid, transfers)`` once with the page keys of the
   device-uncached tail; the linker turns that into one index ``Lookup``
   (``any_parent=True``, since the tail starts below the root) instead of one
   existence probe per page (what ``MooncakeDirectLinker`` and HiCache's
   ``batch_exists`` do), then asks the store once whether it holds those pages,
   so a page the index lists but the store lost is a miss.
2. Layer-wise overlap. The linker owns ``layer_done_counter`` (a
   :class:`~layer_counter.LayerCounter`, SGLang's counter protocol);
   ``create_unified_radix_cache`` registers it with the KV pool and the TP
   worker, so the forward of layer l waits only for layer l while the load
   thread reads the next group. The payload is layer-major after the header, so
   a range of layers of a page is one contiguous byte range, read with
   ``batch_get_into_multi_buffer_ranges``.
3. Safe landing. Loads go to request-private slots and join the tree only
   after the forward (``finish_loads``); offloads come from the write-through
   chain (``offload_nodes``, parents first), which maps to intent -> put ->
   commit.

Keys in the linker: the wrapper hands the linker SGLang's own chained storage
hashes (``mem_cache/utils.py: get_storage_hash_str``: SHA-256 chain seeded by
``extra_key``/``cache_salt``, anchored at the last device-cached page). They fix
the token prefix but not the model or layout, so the linker maps each through
``keys.namespaced(h, layout)``. Offloaded nodes start below the root: they are
published with ``parent=`` (the index accepts a chain after an indexed parent;
:class:`linker.BanaLinkerWrapper` passes the parent page).

Limits: SGLang's wrapper aborts a request whose load did not land, so a store
failure *after* a load started (the presence check in ``lookup`` turns a lost
page into a miss before that) costs the request a 503 "External KV cache load
failed"; the bad pages are reported to the index, and the router's retry misses
and recomputes. The MAC covers the whole page, so it is checked when the last
layer lands; that layer is released only after it matches, so a corrupt page
never produces output.

Not chosen: HiCache L3 (``HiCacheStorage``, ``--hicache-storage-backend
dynamic``) moves pages through a host pool tier (an extra hop) and probes keys
one by one; a full radix-cache backend via ``register_radix_cache_backend``
(``mem_cache/registry.py``) would re-implement ``UnifiedRadixCache``, which
HiCache, the linker and streaming sessions all require.
"""
