"""The exceptions of the migration agent.

:class:`MigrateError` is the base of every migrate exception (also of the
clients': ``AgentUnavailable``, ``KVLost``, ``RemoteFailed``). :class:`TransferError` ends one step of a
migration with a channel reason (``peer_unreachable``, ``peer_refused``,
``checksum``, ``cancelled``, ``invalid``, ...) and a detail, which the record
then reports (``MigrationInfo.reason``/``detail``, a ``Failed`` reply).
"""

from __future__ import annotations


class MigrateError(Exception):
    """Base of the migration agent's exceptions."""


class TransferError(MigrateError):
    """A migration step failed with ``reason`` (a channel reason) and ``detail``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
