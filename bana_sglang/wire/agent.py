"""Typed, versioned messages of the migration control channel.

Operator (CLI, router admin endpoints) -> a worker's agent, and agent -> agent.
The envelope is :mod:`bana_sglang.wire`'s (one msgpack frame, ``id``/``v``/
``deadline`` on every request, exactly one reply per request). Bulk bytes
(weights, KV) never travel here: a :class:`HostLayers` offer carries only the
addresses, sizes and CRC32 of the tensors, which the peer then reads through
the Mooncake transfer engine.

Long operations answer at once (:class:`Accepted`) and are followed with
:class:`Watch`, which answers :class:`Progress`, :class:`Done` or
:class:`Failed` (with a reason). Reasons besides the envelope's: ``invalid``
(well-formed but not executable: a layer range outside the model, an
overlapping migration, an unknown migration id), ``peer_unreachable``,
``transfer``, ``checksum``, ``cancelled``, ``internal``.

Migration states on the source worker: ``accepted`` -> ``checksumming`` ->
``offered`` -> ``transferring`` -> ``staged`` (the peer holds a verified copy
of the layers' weights in its guest area). With ``switch``: -> ``switching``
-> ``remote`` (the peer executes the layers; this worker freed its copy) ->
``recalling`` -> ``home`` after a :class:`Recall`, or ``restored`` when the
peer failed after the switch and the layers were reloaded from the checkpoint.
Also ``failed`` and ``cancelled``. On the peer (guest side): ``pulling`` ->
``verified`` -> ``serving``, or ``failed``/``dropped``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from bana_sglang.wire.envelope import Channel, Error, encode
from bana_sglang.wire.envelope import Reply as _Reply
from bana_sglang.wire.envelope import Request as _Envelope

PROTOCOL_VERSION = 1

# Request migration, as the router sees it: the rids of requests the router can
# continue elsewhere start with PREFIX; a moved request's stream ends with a
# finish reason whose ``matched`` value is MARK followed by the migration id.
PREFIX = "bana-m-"
MARK = "bana-migrated:"
# A streamed chat answer's token ids, which SGLang 0.5.23 does not stream: a chat request
# with this header gets them from bana's workers in SSE events of this name, for the
# router's resume of the stream (bana_sglang.plugin.chat_ids).
CHAT_IDS_HEADER = "x-bana-stream-ids"
CHAT_IDS_EVENT = "bana_ids"

MigrationId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
Endpoint = Annotated[str, msgspec.Meta(pattern=r"^tcp://[^:/\s]+:[0-9]{1,5}$")]
OptionalEndpoint = Annotated[str, msgspec.Meta(pattern=r"^(tcp://[^:/\s]+:[0-9]{1,5})?$")]
LayerIndex = Annotated[int, msgspec.Meta(ge=0)]

SOURCE_STATES = (
    "accepted",
    "checksumming",
    "offered",
    "transferring",
    "staged",
    "switching",
    "remote",
    "recalling",
    "home",
    "restored",
    "failed",
    "cancelled",
    "copying",
    "stopping",
    "handed_off",
)
GUEST_STATES = ("pulling", "verified", "serving", "failed", "dropped")
# states a Watch reports as Done: nothing is in flight (``remote`` lasts until a recall)
TERMINAL = (
    "staged",
    "remote",
    "home",
    "restored",
    "failed",
    "cancelled",
    "verified",
    "serving",
    "dropped",
    "handed_off",
)


class _Request(_Envelope, kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION


class Ping(_Request, tag="ping"):
    """Who are you? (also a health probe)"""


class Status(_Request, tag="status"):
    """Which layers this worker executes, its migrations and the guest layers it holds."""


class MigrateLayers(_Request, tag="migrate_layers"):
    """Move layers ``[start, stop)`` of this worker to the agent at ``peer``:
    stage their weights there and, with ``switch``, have the peer execute them
    from the next batch boundary on (state ``remote``)."""

    migration: MigrationId
    start: LayerIndex
    stop: LayerIndex
    peer: Endpoint
    switch: bool = False


class Watch(_Request, tag="watch"):
    """The current state of ``migration`` (on the source, or a guest on the peer)."""

    migration: MigrationId


class Cancel(_Request, tag="cancel"):
    """Stop ``migration``; the peer drops what it received."""

    migration: MigrationId


class TensorDesc(msgspec.Struct, frozen=True, kw_only=True):
    """One parameter of a migrating layer, readable in the owner's registered memory."""

    layer: LayerIndex
    name: str  # the parameter's name inside its layer, e.g. "mlp.down_proj.weight"
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    addr: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    crc32: Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]  # the checksum's value
    # which checksum ``crc32`` holds: "crc32" (CPU tensors) or "sum32" (device tensors,
    # computed on the device: bana_sglang.migrate.transfer)
    checksum: Literal["crc32", "sum32"] = "crc32"


class HostLayers(_Request, tag="host_layers"):
    """Agent to agent: read these tensors of ``owner`` through the transfer
    engine (``session`` is the owner's ``host:rpc_port``) into a guest area."""

    migration: MigrationId
    owner: str
    session: str
    start: LayerIndex
    stop: LayerIndex
    tensors: list[TensorDesc]


class DropGuest(_Request, tag="drop_guest"):
    """Agent to agent: free the guest area of ``migration``."""

    migration: MigrationId


class MigrateKV(_Request, tag="migrate_kv"):
    """KV-block migration: move up to ``pages`` KV pages of this worker's running
    decode requests (the oldest complete pages of the longest requests, at least
    ``min_pages`` per request) to the agent at ``peer``, which from then on
    computes the partial attention over them (state ``remote``). A ``Recall``
    brings them home; each segment also comes home when its request ends."""

    migration: MigrationId
    peer: Endpoint
    pages: Annotated[int, msgspec.Meta(ge=1)]
    min_pages: Annotated[int, msgspec.Meta(ge=1)] = 1


class MigrateRequest(_Request, tag="migrate_request"):
    """Live request migration: at the next batch boundary, end the running
    request ``rid`` (empty: the migratable request with the most tokens left)
    with the ``migrated`` finish reason; its KV (prompt and answer so far) is
    published to the global store as at any request end, and the router, which
    sees that finish reason in the stream, continues the request on another
    decode worker (``peer``: that worker's agent endpoint; empty: the router's
    choice) and relays the rest into the same client stream. Only requests the
    router marked migratable (rid prefix ``bana-m-``) can move."""

    migration: MigrationId
    peer: OptionalEndpoint = ""
    rid: str = ""


class Handoff(_Request, tag="handoff"):
    """Router to agent: the tokens of a request this worker handed off, to continue it."""

    rid: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class OpenKVHost(_Request, tag="open_kv_host"):
    """Agent to agent: host KV pages of ``migration`` (``layers`` layers) for ``owner``."""

    migration: MigrationId
    owner: str
    layers: Annotated[int, msgspec.Meta(ge=1)]
    owner_endpoint: OptionalEndpoint = ""  # the owner's agent: where to ask for a recall (Reclaim)


class Reclaim(_Request, tag="reclaim"):
    """To a KV host: this worker needs its memory back; ask every lender whose
    pages it holds to recall them (each recalls at its next batch boundary what
    fits in its free pages; the rest come home when their requests end)."""

    reason: str = ""


class Recall(_Request, tag="recall"):
    """Bring the layers of a switched migration home: their weights read back
    from the peer's verified copy (``source="peer"``) or reloaded from the
    checkpoint on disk (``"checkpoint"``), checked against the CRC32 taken
    before they left; then this worker executes them again. For a KV-block
    migration: read every segment back that fits in free pages (``source`` is
    ignored); the rest come home when their requests end."""

    migration: MigrationId
    source: Literal["peer", "checkpoint"] = "peer"


class OpenGuest(_Request, tag="open_guest"):
    """Agent to agent, after staging: start executing the guest layers of
    ``migration`` for their owner, with a guest KV area of ``kv_rows`` slots
    (the owner's slot ids are used as they are)."""

    migration: MigrationId
    kv_rows: Annotated[int, msgspec.Meta(ge=1)]


Request = Union[
    Ping,
    Status,
    MigrateLayers,
    Watch,
    Cancel,
    HostLayers,
    DropGuest,
    Recall,
    OpenGuest,
    MigrateKV,
    OpenKVHost,
    MigrateRequest,
    Handoff,
    Reclaim,
]


class Pong(_Reply, tag="pong"):
    worker: str
    role: str
    num_layers: int
    pid: int
    version: int = PROTOCOL_VERSION


class Accepted(_Reply, tag="accepted"):
    migration: str


class Progress(_Reply, tag="progress"):
    migration: str
    state: str
    bytes_done: int
    bytes_total: int
    note: str = ""


class Done(_Reply, tag="done"):
    migration: str
    state: str
    bytes: int
    seconds: float
    note: str = ""


class Failed(_Reply, tag="failed"):
    migration: str
    reason: str
    detail: str = ""


class Ok(_Reply, tag="ok"):
    note: str = ""


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Layers ``[start, stop)`` of this worker run on ``executor`` (a worker name)."""

    start: int
    stop: int
    executor: str


class MigrationInfo(msgspec.Struct, frozen=True, kw_only=True):
    migration: str
    side: str  # "source" or "guest"
    peer: str  # the other worker's name (or endpoint until it answered)
    start: int
    stop: int
    state: str
    bytes_done: int
    bytes_total: int
    seconds: float
    reason: str = ""
    detail: str = ""
    crc32: list[int] = []  # per tensor, in offer order (a guest: computed over the bytes it holds)
    tensors: list[str] = []  # "LAYER.NAME" per tensor, same order
    executor: str = ""  # source side, switched: the worker executing the layers
    released_bytes: int = 0  # source: weight bytes freed here while the peer executes the layers
    guest_kv_bytes: int = 0  # guest: the guest KV area
    steps: int = 0  # forwards executed remotely (source) or served (guest)
    remote_seconds: float = 0.0  # source: time inside remote steps (transfers + the peer's compute)
    guest_seconds: float = 0.0  # the peer's compute time in those steps
    shipped_rows: int = 0  # source: KV rows sent because the peer did not hold them
    kind: str = "layers"  # "layers", "kv" (KV-block migration) or "request" (live request migration); start/stop 0
    kv: dict[
        str, float
    ] = {}  # kv source: segments, pages, bytes_out, recalled, dropped, attend_calls, ...


class GuestOpened(_Reply, tag="guest_opened"):
    """The guest executor's endpoint and transfer engine; ``addrs``: the guest
    weights' addresses, in offer order (a recall reads them back from there)."""

    migration: str
    worker: str
    endpoint: str
    session: str
    addrs: list[int]


class KVHostOpened(_Reply, tag="kv_host_opened"):
    """The KV host's endpoint (:mod:`.kvwire` channel) and transfer engine."""

    migration: str
    worker: str
    endpoint: str
    session: str


class HandoffInfo(_Reply, tag="handoff_info"):
    """A handed-off request: its prompt and the tokens it produced here (the
    last one's KV is not computed yet), and where its migration asked it to go."""

    rid: str
    migration: str
    peer: str  # the target decode worker's agent endpoint, or "" (the router picks)
    input_ids: list[int]
    output_ids: list[int]


class MovableRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A running request this decode worker could hand off (``MigrateRequest``)."""

    rid: str
    kv_tokens: int
    tokens_left: int


class StatusResult(_Reply, tag="status_result"):
    worker: str
    role: str
    num_layers: int
    placement: list[Placement]
    migrations: list[MigrationInfo]
    guest_bytes: int  # memory held for other workers' layers (weights, guest KV, hosted KV pages)
    transfer_session: str = ""  # this agent's transfer engine (host:port), once started
    kv_free_tokens: int = -1  # free KV slots in this worker's pool (-1: unknown)
    kv_total_tokens: int = -1
    kv_evictable_tokens: int = -1  # held by the radix tree, freed on demand
    kv_hosted_bytes: int = 0  # KV pages held for other workers (KV-block migration)
    running_requests: int = -1  # in the scheduler's running batch (-1: unknown)
    movable: list[
        MovableRequest
    ] = []  # running requests that could move (at most 32, most tokens left first)


Reply = Union[
    Pong,
    Accepted,
    Progress,
    Done,
    Failed,
    Ok,
    StatusResult,
    GuestOpened,
    KVHostOpened,
    HandoffInfo,
    Error,
]

CHANNEL = Channel("the migration agent", PROTOCOL_VERSION, Request, Reply)
decode_request = CHANNEL.decode_request
decode_reply = CHANNEL.decode_reply


def describe(reply: Reply) -> str:
    """A reply in a few words: the reason and detail of a failure, else its type."""
    if isinstance(reply, (Failed, Error)):
        return f"{reply.reason}: {reply.detail}"
    return type(reply).__name__


__all__ = ["Error", "decode_reply", "decode_request", "encode"]
