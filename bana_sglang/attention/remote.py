"""The seam between the ``bana_cpu`` backend and KV-block migration.

While some KV pages of this process's running requests live on a peer
(:mod:`bana_sglang.migrate.kv`), the backend's decode step asks the peer for the
attention over those pages and merges it with its own part. The backend knows
that peer only as a :class:`RemoteKV`, installed with :func:`set_remote_kv` by
the migration agent; this package imports nothing from ``migrate``.

Invariant: at most one :class:`RemoteKV` per process (one agent per scheduler).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class RemoteKV(Protocol):
    """KV pages of running requests held by a peer, and the attention over them."""

    segments: dict[int, Any]  # request pool index -> its remote segment

    def plan(self, rows: list[int]) -> dict[int, Any]:
        """The remote segments of these request pool rows (empty: all local)."""

    def attend_begin(
        self, layer: int, q: torch.Tensor, remote: dict[int, Any], scale: float
    ) -> Any:
        """Send this layer's queries of the planned rows; the peer computes while we do."""

    def attend_end(self, pending: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per row, the peer's partial output and log-sum-exp (rows whose peer failed are absent)."""


_active: RemoteKV | None = None


def set_remote_kv(remote: RemoteKV | None) -> None:
    """Install (or, with None, remove) this process's remote KV."""
    global _active
    _active = remote


def remote_kv() -> RemoteKV | None:
    """The installed remote KV, or None."""
    return _active
