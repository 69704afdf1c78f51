"""The SGLang flags that attach the global store to a worker (cheap to import:
the launcher plans command lines without loading SGLang)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bana_sglang import envs

LINKER_NAME = "BanaGlobalLinker"
LINKER_MODULE = "bana_sglang.radix_global.linker"


def linker_args(index_endpoint: str, master_addr: str, *, owner: str | None = None) -> list[str]:
    """SGLang flags that put :class:`~bana_sglang.radix_global.linker.BanaGlobalLinker`
    on a worker (page size and metrics not included)."""
    extra: dict[str, Any] = {"index": index_endpoint, "master": master_addr}
    if owner:
        extra["owner"] = owner
    cfg = {"linker": LINKER_NAME, "linker_module_path": LINKER_MODULE, "linker_extra_config": extra}
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps(cfg, separators=(",", ":")),
    ]


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


def init_cache_linker_hook(original, cache, cache_linker):
    """AROUND hook on ``UnifiedRadixCache.init_cache_linker``; the work is in
    :func:`bana_sglang.radix_global.linker.init_cache_linker_hook` (imported only
    when a linker is attached, so stock processes never load it)."""
    if type(cache_linker).__name__ != LINKER_NAME:
        return original(cache, cache_linker)
    from bana_sglang.radix_global.linker import init_cache_linker_hook as hook

    return hook(original, cache, cache_linker)


@dataclass(frozen=True)
class LinkerConfig:
    index: str
    master: str
    owner: str

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, default_owner: str) -> LinkerConfig:
        extra = dict(extra or {})
        unknown = set(extra) - {"index", "master", "owner"}
        if unknown:
            raise ValueError(
                f"{LINKER_NAME}: unknown linker_extra_config keys {sorted(unknown)}; "
                "known: index, master, owner"
            )
        index = extra.get("index") or envs.BANA_INDEX_ENDPOINT.get() or None
        master = extra.get("master") or (
            envs.BANA_STORE_MASTER.get() if envs.BANA_STORE_MASTER.is_set else None
        )
        if not index or not master:
            raise ValueError(
                f"{LINKER_NAME} needs linker_extra_config.index (tcp://host:port of "
                "the index service) and .master (host:port of mooncake_master)"
            )
        return cls(str(index), str(master), str(extra.get("owner") or default_owner))
