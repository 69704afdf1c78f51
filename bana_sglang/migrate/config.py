"""The migration agent's settings, fixed when the agent is built.

Inside a worker, :func:`bana_sglang.migrate.hooks.config_from_envs` builds one
:class:`MigrateConfig` from :mod:`bana_sglang.envs` (the launcher sets them per
worker); tests and tools build it directly. The defaults are the registry's.
"""

from __future__ import annotations

from dataclasses import dataclass

from bana_sglang import envs


@dataclass(frozen=True)
class MigrateConfig:
    """How an agent reaches its peers and how long it waits for them."""

    #: the address its transfer engine and guest executors advertise
    te_host: str = "127.0.0.1"
    #: the Mooncake transport of its transfer engine (``tcp`` or ``rdma``) and RDMA device
    protocol: str = "tcp"
    device: str = ""
    #: a peer agent silent this long is gone (``BANA_MIGRATE_PEER_TIMEOUT_S``). A peer
    #: answers at its scheduler's batch boundaries: a long CPU batch delays it by seconds.
    peer_timeout_s: float = envs.BANA_MIGRATE_PEER_TIMEOUT_S.default
    #: a remote step (one forward's layers on the peer) unanswered this long: the owner
    #: restores the layers from the checkpoint (``BANA_MIGRATE_STEP_TIMEOUT_S``)
    step_timeout_s: float = envs.BANA_MIGRATE_STEP_TIMEOUT_S.default
    #: a KV lender's wait for its host in one decode step; 0: ``step_timeout_s``
    #: (``BANA_KV_STEP_TIMEOUT_S``)
    kv_step_timeout_s: float = envs.BANA_KV_STEP_TIMEOUT_S.default
    #: a KV host asks for its memory back below this free share of its own KV pool
    #: (``BANA_KV_HOST_RECLAIM_BELOW``)
    kv_reclaim_below: float = envs.BANA_KV_HOST_RECLAIM_BELOW.default
    #: a migrating request decodes on this long after its pages start to copy to the
    #: store; 0: it stops at the first batch boundary (``BANA_REQUEST_PRECOPY_S``)
    request_precopy_s: float = envs.BANA_REQUEST_PRECOPY_S.default

    @property
    def kv_timeout_s(self) -> float:
        """The KV lender's step timeout, resolved."""
        return self.kv_step_timeout_s or self.step_timeout_s
