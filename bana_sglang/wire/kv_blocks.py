"""Typed, versioned messages of the KV-block channel (lender D -> host H).

After a KV-block migration, worker H holds pages of D's running requests and
computes, for each decode step and layer, the attention of those requests'
queries over the pages it holds. D merges that partial result with its own
(see :mod:`bana_sglang.kernels.merge`). This channel is served by H's :class:`~.kvhost.KVHost`
thread, not by H's scheduler, so H's batches never delay D's steps.

No tensor travels here: each side packs its tensors into a buffer registered
with the Mooncake transfer engine and names it by ``session``/``addr`` and a
``layout``; the other side reads it with one transfer-engine read.

- :class:`HostKV`: H reads ``segments`` of D's KV (per segment ``[tokens,
  layers, 2, kv_heads, head_dim]``: K then V of every layer, page after page)
  from D's buffer and keeps each in its own registered tensor; it answers the
  tensors' addresses, from which D reads them back on recall.
- :class:`Attend`: queries ``[len(keys), q_heads, head_dim]`` of one layer;
  H answers ``output`` ``[len(keys), q_heads, v_head_dim]`` and ``lse``
  ``[len(keys), q_heads]`` (natural log, float32) in its buffer. With
  ``inline`` (payloads under :data:`INLINE_MAX` bytes: a decode step's queries
  are a few KB) the packed tensors ride as raw bytes in a second ZMQ frame of
  the request and of the reply, laid out as ``layout`` says, instead of two
  transfer-engine reads: per layer and step, the round trip is what counts.
- :class:`DropKV`: forget segments (after a recall, or when the request ended).

Envelope and errors as in :mod:`bana_sglang.wire`; reasons added here:
``invalid`` (an unknown migration or segment, a layout that does not fit),
``transfer`` (the read from D failed), ``internal``.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from bana_sglang.wire.envelope import Channel, Error, encode
from bana_sglang.wire.envelope import Reply as _Reply
from bana_sglang.wire.envelope import Request as _Envelope
from bana_sglang.wire.layer_steps import TensorSlot

PROTOCOL_VERSION = 1
INLINE_MAX = 256 * 1024  # Attend payloads up to this size travel inline (second frame)

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class _Request(_Envelope, kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """``tokens`` KV rows of one request, at byte ``offset`` of D's buffer."""

    key: Key
    tokens: Annotated[int, msgspec.Meta(ge=1)]
    offset: NonNeg


class HostKV(_Request, tag="host_kv"):
    migration: str
    session: str
    addr: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: NonNeg
    layers: Annotated[int, msgspec.Meta(ge=1)]
    kv_heads: Annotated[int, msgspec.Meta(ge=1)]
    head_dim: Annotated[int, msgspec.Meta(ge=1)]
    dtype: str
    segments: list[Segment]


class Attend(_Request, tag="attend"):
    """Partial attention of one query token per key over the rows H holds for it."""

    migration: str
    layer: NonNeg
    keys: list[Key]
    scale: float
    session: str
    addr: NonNeg  # 0 with inline
    nbytes: NonNeg
    layout: list[TensorSlot]
    inline: bool = False  # the packed queries are the request's second frame; answer the same way


class DropKV(_Request, tag="drop_kv"):
    migration: str
    keys: list[Key] = []  # empty: every segment of the migration


Request = Union[HostKV, Attend, DropKV]


class KVHosted(_Reply, tag="kv_hosted"):
    addrs: list[int]  # per segment, where H holds it (registered with H's transfer engine)
    seconds: float


class Attended(_Reply, tag="attended"):
    addr: int  # 0 when inline (the reply's second frame holds the bytes)
    nbytes: int
    layout: list[TensorSlot]
    compute_s: float
    inline: bool = False


class Dropped(_Reply, tag="dropped"):
    segments: int
    bytes: int


Reply = Union[KVHosted, Attended, Dropped, Error]

CHANNEL = Channel("the KV-block host", PROTOCOL_VERSION, Request, Reply)
decode_request = CHANNEL.decode_request
decode_reply = CHANNEL.decode_reply
__all__ = [
    "CHANNEL",
    "Attend",
    "Attended",
    "DropKV",
    "Dropped",
    "Error",
    "HostKV",
    "KVHosted",
    "Segment",
    "decode_reply",
    "decode_request",
    "encode",
]
