"""Typed, versioned messages of the index channel (worker/router <-> index service).

Wire format: one ZMQ frame per message, msgpack-encoded :mod:`msgspec` structs,
tagged by a ``type`` field. No pickle, no positional frames.

Every request carries ``id`` (chosen by the client, echoed in the reply), ``v``
(the protocol version) and ``deadline`` (absolute Unix time in seconds, from the
sender's clock; all parties run on hosts with synchronised clocks). Every
request gets exactly one reply: its result, or an :class:`Error` whose
``reason`` says why (one of :data:`ERROR_REASONS`):

- ``malformed``: not msgpack, not a map, a field missing or of the wrong type,
  a page hash that is not 32 lowercase hex chars;
- ``unknown_type``: a ``type`` this service does not know;
- ``unsupported_version``: ``v`` differs from :data:`PROTOCOL_VERSION`;
- ``stale_deadline``: the deadline had passed when the service read it (the
  client has given up; the request is not executed);
- ``invalid``: well-formed but inconsistent (e.g. sizes/chain length mismatch);
- ``unknown_intent``: a commit for an intent that expired or never existed;
- ``internal``: a bug in the service (logged there with a traceback).

Publishing is two-phase: :class:`PublishIntent` (the service answers which
contiguous range of the chain the caller should write, and marks those pages
pending so no other worker writes them too), then :class:`Commit` (how many of
those pages were written; they become visible to lookups). An intent not
committed by its lease deadline is dropped and its pages are removed from the
store.
"""

from __future__ import annotations

import time
from typing import Annotated, Union

import msgspec

PROTOCOL_VERSION = 1

ERROR_REASONS = ("malformed", "unknown_type", "unsupported_version", "stale_deadline",
                 "invalid", "unknown_intent", "internal")

PageHashField = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
Size = Annotated[int, msgspec.Meta(ge=1)]


class _Request(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    id: int
    deadline: float
    v: int = PROTOCOL_VERSION


class Lookup(_Request, tag="lookup"):
    """Longest indexed prefix of ``chain``. ``touch``: count it as a use (LRU, hits).
    ``chain`` starts at the root, or right after ``parent``, or (``any_parent``)
    wherever its first page is indexed."""

    chain: list[PageHashField]
    touch: bool = True
    parent: PageHashField | None = None
    any_parent: bool = False


class PublishIntent(_Request, tag="publish_intent"):
    """``owner`` wants to publish ``chain`` (from page 0, or right after the
    indexed page ``parent``); ``sizes[i]`` is page i's stored size in bytes."""

    chain: list[PageHashField]
    sizes: list[Size]
    owner: str
    parent: PageHashField | None = None


class Commit(_Request, tag="commit"):
    """The first ``written`` pages of intent ``intent``'s range are in the store
    (0 aborts the intent)."""

    intent: int
    written: Annotated[int, msgspec.Meta(ge=0)]


class ReportLoss(_Request, tag="report_loss"):
    """``reporter`` found these pages missing or corrupt in the store."""

    pages: list[PageHashField]
    reporter: str


class Stats(_Request, tag="stats"):
    """Index and service counters; doubles as a health probe."""


Request = Union[Lookup, PublishIntent, Commit, ReportLoss, Stats]
REQUEST_TYPES = ("lookup", "publish_intent", "commit", "report_loss", "stats")


class _Reply(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    id: int


class LookupResult(_Reply, tag="lookup_result"):
    """``length`` leading pages are indexed; ``sizes``/``hits`` per matched page."""

    length: int
    sizes: list[int]
    hits: list[int]


class IntentResult(_Reply, tag="intent_result"):
    """Write pages ``[start, stop)`` of the chain, then commit ``intent`` before
    ``lease_deadline``. ``start == stop``: nothing to write (all present, pending
    elsewhere, or no room); ``note`` says which."""

    intent: int
    start: int
    stop: int
    lease_deadline: float
    note: str = ""


class Ok(_Reply, tag="ok"):
    """Done. ``count``: pages committed (Commit) or dropped (ReportLoss)."""

    count: int = 0
    note: str = ""


class StatsResult(_Reply, tag="stats_result"):
    pages: int
    leaves: int
    used_bytes: int
    capacity_bytes: int
    pending_pages: int
    pending_bytes: int
    lookups: int
    hit_pages: int
    lookup_pages: int
    inserted: int
    evicted: int
    forgotten: int
    store_removals_queued: int
    store_resets: int
    store_attached: bool


class Error(_Reply, tag="error"):
    reason: str
    detail: str = ""


Reply = Union[LookupResult, IntentResult, Ok, StatsResult, Error]


class _Envelope(msgspec.Struct):
    """The fields every request has, read before the full decode so that an
    unknown type or version gets a precise error (unknown fields are ignored)."""

    type: str
    id: int = 0
    v: int = -1


_request_decoder = msgspec.msgpack.Decoder(Request)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes, *, now: float | None = None) -> Request | Error:
    """Decode and validate one request frame; every failure becomes an :class:`Error`
    reply (with the request id when it could be read)."""
    try:
        env = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Error(id=0, reason="malformed", detail=str(e))
    if env.type not in REQUEST_TYPES:
        return Error(id=env.id, reason="unknown_type",
                     detail=f"type {env.type!r}; known: {', '.join(REQUEST_TYPES)}")
    if env.v != PROTOCOL_VERSION:
        return Error(id=env.id, reason="unsupported_version",
                     detail=f"got v={env.v}, this service speaks v={PROTOCOL_VERSION}")
    try:
        req = _request_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Error(id=env.id, reason="malformed", detail=str(e))
    now = time.time() if now is None else now
    if req.deadline < now:
        return Error(id=req.id, reason="stale_deadline",
                     detail=f"deadline passed {now - req.deadline:.3f}s before the service read it")
    return req


def decode_reply(data: bytes) -> Reply:
    """Decode a reply; raises ``msgspec.DecodeError``/``ValidationError`` if malformed."""
    return _reply_decoder.decode(data)
