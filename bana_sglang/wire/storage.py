"""Typed, versioned messages of the storage channel (a worker on the storage
process's host -> the storage process).

A worker on the same host as the storage process publishes and loads its pages
through it rather than over the transfer engine: the worker has a shared-memory
arena (a 0600 file in ``/dev/shm`` it created), the storage process maps that
file once (:class:`MapArena`) and, for each batch, puts the framed objects from
it into its own Mooncake segment (:class:`PutPages`) or gets whole objects from
its segment into it (:class:`GetPages`), each a local copy. The envelope is
:mod:`bana_sglang.wire`'s; besides its reasons:

- ``invalid``: well-formed but refused (a path outside ``/dev/shm``, a file not
  the caller's own 0600 regular file, a size that does not match, an object out of
  the arena's bounds);
- ``unknown_arena``: no such arena (the storage process restarted: map again);
- ``internal``: a bug in the storage process (logged there with a traceback).

Every key is a page key (``bana/kv/`` and 32 hex digits): the channel stores KV
pages and nothing else.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from bana_sglang.wire.envelope import ENVELOPE_REASONS, Channel, Error
from bana_sglang.wire.envelope import Reply as _Reply
from bana_sglang.wire.envelope import Request as _Envelope

PROTOCOL_VERSION = 1

#: the largest arena the storage process maps, and the most pages per put
MAX_ARENA_BYTES = 1 << 30
MAX_PAGES = 4096

ERROR_REASONS = (
    *ENVELOPE_REASONS,
    "invalid",
    "unknown_arena",
    "internal",
)

PageKey = Annotated[str, msgspec.Meta(pattern="^bana/kv/[0-9a-f]{32}$")]
Offset = Annotated[int, msgspec.Meta(ge=0, lt=MAX_ARENA_BYTES)]
Owner = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]


class _Request(_Envelope, kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION


class MapArena(_Request, tag="map_arena"):
    """Map ``path`` (``nbytes``, the caller's own 0600 file in ``/dev/shm``) as
    ``owner``'s arena; an arena the same owner mapped before is dropped. ``pid``:
    the caller's process on this host; its arena is dropped once that process is
    gone (0: kept until the owner maps another or the storage process exits)."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_ARENA_BYTES)]
    owner: Owner
    pid: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] = 0


class PutPages(_Request, tag="put_pages"):
    """Store ``keys[i]`` from bytes ``[offsets[i], offsets[i] + size)`` of ``arena``
    (``owner``'s: an arena id of another owner, or of an earlier storage process, is
    ``unknown_arena``)."""

    arena: int
    owner: Owner
    keys: Annotated[list[PageKey], msgspec.Meta(min_length=1, max_length=MAX_PAGES)]
    offsets: Annotated[list[Offset], msgspec.Meta(min_length=1, max_length=MAX_PAGES)]
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_ARENA_BYTES)]


class GetPages(_Request, tag="get_pages"):
    """Read the whole objects ``keys[i]`` (``size`` bytes each) into bytes
    ``[offsets[i], offsets[i] + size)`` of ``arena`` (``owner``'s, as for :class:`PutPages`)."""

    arena: int
    owner: Owner
    keys: Annotated[list[PageKey], msgspec.Meta(min_length=1, max_length=MAX_PAGES)]
    offsets: Annotated[list[Offset], msgspec.Meta(min_length=1, max_length=MAX_PAGES)]
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_ARENA_BYTES)]


Request = Union[MapArena, PutPages, GetPages]


class Mapped(_Reply, tag="mapped"):
    """The arena's id, for :class:`PutPages` (random: never reused by a restarted process)."""

    arena: int


class Put(_Reply, tag="put"):
    """Mooncake's code per key (0: stored)."""

    codes: list[int]


class Got(_Reply, tag="got"):
    """Per key, the bytes read (``size``: the whole object) or Mooncake's negative code."""

    codes: list[int]


Reply = Union[Mapped, Put, Got, Error]

CHANNEL = Channel("the storage process", PROTOCOL_VERSION, Request, Reply)
