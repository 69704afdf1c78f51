"""The vocabulary of a migration record: its kind, its side, its state and the
action its scheduler thread has pending.

Every member is a :class:`enum.StrEnum`, so it is its wire string
(``MigrationInfo.state == "remote"``) and encodes byte for byte as before.
:mod:`bana_sglang.wire.agent` keeps its own tuples of the state strings (the
wire layer imports nothing of ``migrate``); a unit test keeps them equal to
:data:`SOURCE_STATES`, :data:`GUEST_STATES` and :data:`TERMINAL`.
"""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    """What moves: layers (weights, then their execution), KV pages, or a running request."""

    LAYERS = "layers"
    KV = "kv"
    REQUEST = "request"


class Side(enum.StrEnum):
    """``source``: the worker that gives; ``guest``: the peer that holds or serves."""

    SOURCE = "source"
    GUEST = "guest"


class State(enum.StrEnum):
    """Where a migration is (``docs/MIGRATION.md`` has the state machines)."""

    # source side
    ACCEPTED = "accepted"
    CHECKSUMMING = "checksumming"
    OFFERED = "offered"
    TRANSFERRING = "transferring"
    STAGED = "staged"
    SWITCHING = "switching"
    REMOTE = "remote"
    RECALLING = "recalling"
    HOME = "home"
    RESTORED = "restored"
    FAILED = "failed"
    CANCELLED = "cancelled"
    COPYING = "copying"
    STOPPING = "stopping"
    HANDED_OFF = "handed_off"
    # guest side (and FAILED)
    PULLING = "pulling"
    VERIFIED = "verified"
    SERVING = "serving"
    DROPPED = "dropped"


SOURCE_STATES: tuple[State, ...] = (
    State.ACCEPTED,
    State.CHECKSUMMING,
    State.OFFERED,
    State.TRANSFERRING,
    State.STAGED,
    State.SWITCHING,
    State.REMOTE,
    State.RECALLING,
    State.HOME,
    State.RESTORED,
    State.FAILED,
    State.CANCELLED,
    State.COPYING,
    State.STOPPING,
    State.HANDED_OFF,
)
GUEST_STATES: tuple[State, ...] = (
    State.PULLING,
    State.VERIFIED,
    State.SERVING,
    State.FAILED,
    State.DROPPED,
)
#: states a Watch reports as Done: nothing is in flight (``remote`` lasts until a recall)
TERMINAL: tuple[State, ...] = (
    State.STAGED,
    State.REMOTE,
    State.HOME,
    State.RESTORED,
    State.FAILED,
    State.CANCELLED,
    State.VERIFIED,
    State.SERVING,
    State.DROPPED,
    State.HANDED_OFF,
)
#: source states that hold nothing: the layers may be migrated again
SETTLED: tuple[State, ...] = (State.FAILED, State.CANCELLED, State.HOME, State.RESTORED)
#: a request migration that holds its request (no other migration may take it)
HOLDS_REQUEST: tuple[State, ...] = (State.COPYING, State.STOPPING)


class Pending(enum.StrEnum):
    """What the scheduler thread applies to a source migration at the next batch boundary."""

    INSTALL = "install"  # layers: install the remote span and free the weights
    HOME = "home"  # layers: swap the modules back (weights read back from the peer)
    CHECKPOINT = "checkpoint"  # layers: swap them back and reload the weights from disk
    KV_MOVE = "kv_move"  # KV: pick the pages, copy them to the host, free them
    KV_RECALL = "kv_recall"  # KV: read back every segment that fits in free pages
    REQ_STOP = "req_stop"  # request: pick it and pre-copy, or cut it at this boundary
