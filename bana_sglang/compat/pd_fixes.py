"""Fixes for SGLang 0.5.23's PD transfer, on every device (CPU and GPU alike).

**A prefill worker whose KV sender thread dies on a finished room.** The Mooncake
KV manager's ``transfer_worker`` thread reads a room's status twice in a row
(``room not in request_status or check_status(room) == ...``) while the
scheduler thread removes finished rooms from ``request_status``. When the
removal falls between the two reads, ``check_status`` raises ``KeyError`` and
the thread ends with "Transfer thread failed ... Prefill instance ... is dead";
the process lives on, every later request routed to that worker waits for a KV
transfer that never comes, and decode gives each one up after
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s). Seen here on 2026-12-04: a
2P1D tiny-model cluster without the global store, twelve 1400-token prompts
sent one after another, request 13 hung for 300 s. (Mooncake issue 1400 reports
the same ``check_status`` ``KeyError`` from the scheduler's side.)

:func:`apply` wraps ``transfer_worker``: when the thread fails because the room
it was handling has left ``request_status`` (the room is finished or aborted, so
its chunk had nothing left to do), it drops the room's bookkeeping as the thread
itself does for a room it finds already cleared, logs a warning and goes back to
its queue instead of ending. Any other failure still ends the thread as before.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


def _room_gone(manager, exc: BaseException) -> object | None:
    """The room whose removal from ``request_status`` made the transfer thread
    fail, or None when ``exc`` is some other failure."""
    cause = exc.__cause__ or exc.__context__
    if not isinstance(cause, KeyError) or len(cause.args) != 1:
        return None
    room = cause.args[0]
    if not isinstance(room, int) or room in manager.request_status:
        return None
    return room


def _forget(manager, room) -> None:
    """What the thread's own tear-down does for a room already cleared."""
    for name in ("transfer_infos", "req_to_decode_prefix_len", "_staging_outstanding"):
        table = getattr(manager, name, None)
        if isinstance(table, dict):
            table.pop(room, None)


def resilient_transfer_worker(original):
    """``transfer_worker`` that outlives a room removed while its chunk was handled."""

    @functools.wraps(original)
    def transfer_worker(self, *args, **kwargs):
        while True:
            try:
                return original(self, *args, **kwargs)
            except RuntimeError as e:
                room = _room_gone(self, e)
                if room is None:
                    raise
                _forget(self, room)
                logger.warning(
                    "KV transfer thread: room %s finished while its chunk was being "
                    "handled (SGLang 0.5.23 race); the thread goes on with its queue",
                    room,
                )

    transfer_worker.__bana_resilient__ = True
    return transfer_worker


def apply() -> list[str]:
    """Patch this process's SGLang; returns the names of the fixes applied."""
    try:
        from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
    except ImportError:  # no Mooncake wheel: no Mooncake PD transfer to fix
        return []
    manager = mooncake_conn.MooncakeKVManager
    if getattr(manager.transfer_worker, "__bana_resilient__", False):
        return ["MooncakeKVManager.transfer_worker survives a finished room"]
    manager.transfer_worker = resilient_transfer_worker(manager.transfer_worker)
    return ["MooncakeKVManager.transfer_worker survives a finished room"]
