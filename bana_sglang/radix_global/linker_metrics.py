"""The global store's per-worker counters and histograms (``bana_store_*`` on a
worker's ``/metrics``), which :class:`~linker.BanaGlobalLinker` keeps."""

from __future__ import annotations

from typing import ClassVar

from bana_sglang.counters import CounterSet, HistogramSet


class StoreMetrics(CounterSet):
    """The store's per-worker counters (``bana_store_*_total`` on the worker's
    ``/metrics``; plain numbers always, logged at close)."""

    NAMES: ClassVar[dict[str, str]] = {
        "lookups": "Lookups of the global index (requests with an uncached tail)",
        "local_hit_tokens": "Prompt tokens found in the worker's own device tree",
        "global_hit_pages": "Pages found in the global store for an uncached tail",
        "global_hit_tokens": "Tokens found in the global store for an uncached tail",
        "recomputed_hit_pages": "Hit pages computed again: loading them was predicted slower",
        "lookup_tokens": "Prompt tokens looked up (device tree + global index)",
        "loaded_pages": "Pages loaded from the global store",
        "loaded_bytes": "Bytes loaded from the global store",
        "load_seconds": "Time the load thread spent loading (start to last layer)",
        "load_read_seconds": "Time loads spent reading (Mooncake, or the storage process's copy)",
        "load_session_seconds": "Time loads spent opening Mooncake read sessions before reading",
        "load_verify_seconds": "Time loads spent checking headers and MACs",
        "load_copy_seconds": "Time loads spent copying into the KV pool",
        "local_loaded_pages": "Pages of those the storage process copied into this worker's "
        "shared-memory load arena (the rest: read over the transfer engine)",
        "load_wait_seconds": "Time the forward pass waited for a layer to land",
        "load_failures": "Load batches that failed after starting",
        "load_timeouts": "Load batches given up: a layer did not land within the deadline",
        "stuck_lookups": "Lookups answered as misses while a given-up load was still stuck",
        "published_pages": "Pages this worker wrote and committed to the global store",
        "published_bytes": "Bytes this worker wrote to the global store",
        "published_local_pages": "Pages of those the storage process put from this worker's "
        "shared-memory arena (the rest: this worker's own transfer-engine puts)",
        "publish_seconds": "Wall time of publishing rounds (intent, frame, write, commit)",
        "publish_cpu_seconds": "CPU time of the publish thread in its rounds",
        "publish_skipped_pages": "Pages offered but not written (present, pending elsewhere, "
        "no room, down, backlog full)",
        "publish_held_arrival_pages": "Pages a decode worker took when a request's KV "
        "arrived and held back until the request's first token was out",
        "forward_tokens": "Tokens of prefill forwards without a load",
        "forward_seconds": "Time of prefill forwards without a load",
        "forward_tokens_publishing": "Tokens of such forwards that ran while a publish was written",
        "forward_seconds_publishing": "Time of such forwards that ran while a publish was written",
    }

    def __init__(self) -> None:
        super().__init__("bana_store", self.NAMES)

    def summary(self) -> str:
        v = self.values
        hidden = 1.0 - v["load_wait_seconds"] / v["load_seconds"] if v["load_seconds"] else 0.0
        return (
            f"lookups={v['lookups']:.0f} local_hit_tokens={v['local_hit_tokens']:.0f} "
            f"global_hit_tokens={v['global_hit_tokens']:.0f} "
            f"recomputed_hit_pages={v['recomputed_hit_pages']:.0f} "
            f"loaded={v['loaded_bytes'] / 1e6:.1f}MB "
            f"in {v['load_seconds']:.2f}s (hidden {hidden:.0%}) published={v['published_pages']:.0f} "
            f"pages {v['published_bytes'] / 1e6:.1f}MB in {v['publish_cpu_seconds']:.2f}s CPU "
            f"failures={v['load_failures']:.0f}"
        )


class StoreDurations(HistogramSet):
    """Per-event durations (``bana_store_<name>`` histograms): the per-request breakdown."""

    NAMES: ClassVar[dict[str, str]] = {
        "lookup_index_seconds": "Index round trip of one lookup",
        "lookup_header_seconds": "Existence check of one lookup's hit pages in the store",
        "load_batch_seconds": "One load batch, start to last layer",
        "load_wait_batch_seconds": "Time one forward waited for its load's layers",
        "publish_round_seconds": "Wall time of one publishing round",
        "publish_round_cpu_seconds": "CPU time of one publishing round",
        "publish_index_seconds": "Index round trips (intent, commit) of one publishing round",
    }

    def __init__(self) -> None:
        super().__init__("bana_store", self.NAMES)
