"""Global KV cache store: one global prefix index over Mooncake-held KV pages.

Modules (one role each):

- ``keys``: :class:`~keys.KVLayout` (model identity + KV layout + TP rank) and
  its namespace digest; :func:`~keys.page_chain` (chained BLAKE2b page hashes
  over full pages); :func:`~keys.namespaced` (maps a foreign chained hash, e.g.
  SGLang's storage hash, into a layout's namespace).
- ``index``: :class:`~index.GlobalPrefixIndex`, pure and single-threaded:
  prefix-closed, capacity-bounded, LRU-among-leaves eviction, ``forget`` of
  lost pages with their descendants.
- ``messages``: typed, versioned msgspec messages of the index channel.
- ``service``: the index service process (ZMQ ROUTER on 127.0.0.1) and
  :class:`~service.IndexClient` (timeouts, fail-fast during outages, one log
  line per episode). The service removes evicted/forgotten/abandoned pages from
  the store itself and detects a store that restarted empty.
- ``mooncake_kv``: the only caller of ``MooncakeDistributedStore``: native codes
  -> ``StoreError``, outage gate.
- ``store``: :class:`~store.PageStore`, framed and verified pages (192-byte
  header: magic, version, layout digest, page hash, dtype, shape, length,
  CRC32s), zero-copy multi-buffer puts/gets.
- ``storage_server``: the dedicated storage process, the only one contributing
  memory (workers and the index use ``global_segment_size=0``).
- ``worker_cache``: :class:`~worker_cache.GlobalKVCache`, the fail-soft worker
  facade (lookup -> load -> report loss; intent -> put -> commit).
- ``bench_store``: smoke bandwidth of the page store.

Invariants across the subpackage: a load returns verified bytes of the right
page and layout or a miss; the index is prefix-closed and within capacity; no
index or store failure raises into a request path (misses instead); only the
index service removes pages from the store.

Integration with SGLang 0.5.23 (next step, not built here)
---------------------------------------------------------

Use the **unified-cache external linker** with the ``dynamic`` backend::

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
   ``batch_exists`` do).
2. Layer-wise overlap. The linker owns ``layer_done_counter``
   (``LayerWiseLoadCounter``); ``create_unified_radix_cache`` registers it with
   the KV pool (``register_layer_transfer_counter``) and the TP worker, so the
   forward of layer l waits only for layer l while a load thread reads layer
   l+1. Our page object is layer-major after a fixed header, so layer l of a
   page is one contiguous byte range: read it with
   ``batch_get_into_multi_buffer_ranges`` straight into the device slots, as
   the reference linker does, then ``complete(index, l)``.
3. Safe landing. Loads go to request-private slots and join the tree only
   after the forward (``finish_loads``); offloads come from the write-through
   chain (``offload_nodes``, parents first), which maps to intent -> put ->
   commit. On a PD decode node the linker only offloads.

Keys in the linker: the wrapper hands the linker SGLang's own chained storage
hashes (``mem_cache/utils.py: get_storage_hash_str``: SHA-256 chain seeded by
``extra_key``/``cache_salt``, anchored at the last device-cached page). They fix
the token prefix but not the model or layout, so the linker maps each through
``keys.namespaced(h, layout)``. Offloaded nodes start below the root: publish
them with ``parent=`` (the index accepts a chain after an indexed parent).

Two gaps to close in the integration: (a) the wrapper *aborts* requests whose
load did not land (``finish_loads``), which contradicts "a store error never
fails a request": verify headers (a ``[0, HEADER_SIZE)`` range read, batched)
in ``lookup`` so that nearly all failures become misses before the load starts,
and add a hook (``HookRegistry`` AROUND on ``finish_loads``' caller) that turns
the remaining failures into a recompute; (b) per-layer checksums (format
version 2 of the header) so each layer can be verified when it lands.

Not chosen: HiCache L3 (``HiCacheStorage``, ``--hicache-storage-backend
dynamic``) moves pages through a host pool tier (an extra hop) and probes keys
one by one; a full radix-cache backend via ``register_radix_cache_backend``
(``mem_cache/registry.py``) would re-implement ``UnifiedRadixCache``, which
HiCache, the linker and streaming sessions all require. The registry stays
useful for a thin factory ``create_unified_radix_cache(ctx,
cache_class=Subclass)`` if the linker ever needs tree context (e.g. a node's
parent hash) that the wrapper does not pass.
"""
