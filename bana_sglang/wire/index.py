"""Typed, versioned messages of the index channel (worker/router <-> index service).

The envelope (one msgpack frame per message, ``id``/``v``/``deadline`` on every
request, an :class:`Error` reply for malformed, unknown-type, unsupported-version
and stale requests) is :mod:`bana_sglang.wire`'s; deadlines are from the
sender's clock (all parties run on hosts with synchronised clocks). Every
request gets exactly one reply: its result, or an :class:`Error` whose
``reason`` says why (one of :data:`ERROR_REASONS`); besides the envelope's
(a page hash that is not 32 lowercase hex chars is ``malformed``):

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

from typing import Annotated, Union

import msgspec

from bana_sglang.wire.envelope import ENVELOPE_REASONS, Channel, Error, encode
from bana_sglang.wire.envelope import Reply as _Reply
from bana_sglang.wire.envelope import Request as _Envelope

PROTOCOL_VERSION = 1

ERROR_REASONS = (
    *ENVELOPE_REASONS,
    "invalid",
    "unknown_intent",
    "internal",
)

PageHashField = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
Size = Annotated[int, msgspec.Meta(ge=1)]


class _Request(_Envelope, kw_only=True, frozen=True):
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


class Clear(_Request, tag="clear"):
    """Forget every page, drop every pending intent and remove the pages from the
    store (a benchmark starts each arm and each rate from an empty store)."""


Request = Union[Lookup, PublishIntent, Commit, ReportLoss, Stats, Clear]


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
    """Done. ``count``: pages committed (Commit) or dropped (ReportLoss, Clear)."""

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


Reply = Union[LookupResult, IntentResult, Ok, StatsResult, Error]

CHANNEL = Channel("the index service", PROTOCOL_VERSION, Request, Reply)
decode_request = CHANNEL.decode_request
decode_reply = CHANNEL.decode_reply
__all__ = ["Error", "decode_reply", "decode_request", "encode"]
