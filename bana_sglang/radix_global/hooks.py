"""The SGLang hooks of the global store (registered by :mod:`bana_sglang.plugin`
in every SGLang process; each acts only on a worker that runs our linker).

Cheap to import: no linker, no torch. A worker's
:class:`~bana_sglang.radix_global.linker.BanaGlobalLinker` is recognised by its
class name and builds its own wrapper, so a stock process never loads the
linker module.
"""

from __future__ import annotations

from bana_sglang.radix_global.config import LINKER_NAME


def decode_queue_hook(original, scheduler, *args, **kwargs):
    """AROUND hook on the PD decode scheduler's ``process_decode_queue``.

    SGLang 0.5.23 polls the tree cache's transfer events on a decode worker only
    with HiCache (``enable_decode_hicache``). With an external linker the
    offloads of finished requests then complete but are never acknowledged:
    their tree nodes stay locked and the decode KV pool fills until every new
    request waits forever (seen: 92% KV usage, 24 requests stuck in
    pre-allocation). Poll them here, once per decode-queue pass."""
    if getattr(scheduler, "enable_unified_cache_external_linker", False) and not getattr(
        scheduler, "enable_decode_hicache", False
    ):
        scheduler.tree_cache.check_hicache_events()
    return original(scheduler, *args, **kwargs)


def prebuilt_hook(original, batch, *args, **kwargs):
    """AROUND hook on the PD decode batch's ``process_prebuilt``: a request whose KV
    has just arrived from its prefill worker is put into the decode worker's tree
    there, before its first token goes out, and the write-through offers our linker
    every page of its prompt. Publishing them at once would run on the first
    token's way; while ``arrivals`` is set, :meth:`BanaGlobalLinker.offload` holds
    them back until the first token is out."""
    linker = _bana_linker(batch)
    if linker is None:
        return original(batch, *args, **kwargs)
    linker.arrivals = True
    try:
        return original(batch, *args, **kwargs)
    finally:
        linker.arrivals = False


def init_cache_linker_hook(original, cache, cache_linker):
    """AROUND hook on ``UnifiedRadixCache.init_cache_linker``: our linker gets
    its own wrapper (:meth:`BanaGlobalLinker.make_wrapper`: the parent page of each
    offloaded node, the device-tree hit of each match); any other linker keeps
    SGLang's."""
    if type(cache_linker).__name__ != LINKER_NAME:
        return original(cache, cache_linker)
    cache.linker = cache_linker.make_wrapper(cache)
    return None


def _bana_linker(owner):
    """The BanaGlobalLinker of ``owner``'s tree cache (a scheduler's or a batch's), or None."""
    wrapper = getattr(getattr(owner, "tree_cache", None), "linker", None)
    linker = getattr(wrapper, "cache_linker", None)
    return linker if type(linker).__name__ == LINKER_NAME else None


def run_batch_hook(original, scheduler, batch, *args, **kwargs):
    """AROUND hook on ``Scheduler.run_batch`` of a prefill worker with our linker: tells
    the linker when forwards run (its publisher waits for a quiet moment) and times
    the prefill forwards that load nothing, which is what the linker's cost model
    compares a load with (and how it measures what a concurrent publish costs a
    forward). Decode workers' batches pass untouched."""
    linker = _bana_linker(scheduler)
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    if linker is None or mode == "decode" or batch is None:
        return original(scheduler, batch, *args, **kwargs)
    timed = (
        getattr(batch, "extend_num_tokens", 0)
        and getattr(batch, "hicache_consumer_index", -1) < 0
        and batch.forward_mode.is_extend()
    )
    timer = linker.device.timer(linker.forward_stream)
    publishing = linker.publisher.busy
    linker.forward_began()
    timer.start()
    try:
        result = original(scheduler, batch, *args, **kwargs)
    finally:
        timer.stop()
        linker.forward_ended()
    if timed:
        linker.observe_forward(batch.extend_num_tokens, timer, publishing or linker.publisher.busy)
    return result
