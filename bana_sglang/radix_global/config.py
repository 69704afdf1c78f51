"""How a worker attaches the global store: the SGLang flags and their parsed form.

:func:`linker_args` gives the SGLang flags that put
:class:`~bana_sglang.radix_global.linker.BanaGlobalLinker` on a worker (the
launcher adds them to every worker unless ``--no-global-store``);
:class:`LinkerConfig` is what the linker reads back from SGLang's
``linker_extra_config``. Cheap to import (no SGLang, no torch): the launcher
plans command lines without loading SGLang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bana_sglang import envs

LINKER_NAME = "BanaGlobalLinker"
LINKER_MODULE = "bana_sglang.radix_global.linker"


def linker_args(
    index_endpoint: str,
    master_addr: str,
    *,
    owner: str | None = None,
    storage: str | None = None,
) -> list[str]:
    """SGLang flags that put :class:`~bana_sglang.radix_global.linker.BanaGlobalLinker`
    on a worker (page size and metrics not included); ``storage``: the storage
    process's put endpoint, for a worker on its host."""
    extra: dict[str, Any] = {"index": index_endpoint, "master": master_addr}
    if owner:
        extra["owner"] = owner
    if storage:
        extra["storage"] = storage
    cfg = {"linker": LINKER_NAME, "linker_module_path": LINKER_MODULE, "linker_extra_config": extra}
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps(cfg, separators=(",", ":")),
    ]


@dataclass(frozen=True)
class LinkerConfig:
    """The linker's ``linker_extra_config``: the index endpoint, the Mooncake
    master, the owner name its pages are published under and, for a worker on the
    storage process's host, that process's put endpoint (publishes then go through
    it, :mod:`~bana_sglang.radix_global.shm_arena`)."""

    index: str
    master: str
    owner: str
    storage: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, default_owner: str) -> LinkerConfig:
        """Parse ``extra``; ``BANA_INDEX_ENDPOINT`` and ``BANA_STORE_MASTER`` fill
        in a missing ``index`` or ``master``."""
        extra = dict(extra or {})
        unknown = set(extra) - {"index", "master", "owner", "storage"}
        if unknown:
            raise ValueError(
                f"{LINKER_NAME}: unknown linker_extra_config keys {sorted(unknown)}; "
                "known: index, master, owner, storage"
            )
        storage = extra.get("storage") or None
        if storage is not None and not str(storage).startswith("tcp://"):
            raise ValueError(f"{LINKER_NAME}: storage must be tcp://host:port, got {storage!r}")
        index = extra.get("index") or envs.BANA_INDEX_ENDPOINT.get() or None
        master = extra.get("master") or (
            envs.BANA_STORE_MASTER.get() if envs.BANA_STORE_MASTER.is_set else None
        )
        if not index or not master:
            raise ValueError(
                f"{LINKER_NAME} needs linker_extra_config.index (tcp://host:port of "
                "the index service) and .master (host:port of mooncake_master)"
            )
        return cls(
            str(index),
            str(master),
            str(extra.get("owner") or default_owner),
            None if storage is None else str(storage),
        )
