"""Typed, versioned messages of the remote-layer step channel (owner -> guest).

After a layer migration switched, the owner X runs layers ``[start, stop)`` of
every forward on the guest Y. Per forward, X sends one :class:`RunLayers` to
Y's guest executor and waits for one :class:`LayersDone`. The tensors (the
hidden state and residual at the layer boundary, positions, KV slot ids, KV
rows Y does not hold yet, and on the way back the new K/V rows) never travel
here: each side packs them into one registered buffer, described by a
``layout``, and the other side reads that buffer with one Mooncake
transfer-engine read.

Envelope and errors as in :mod:`bana_sglang.wire`; reasons added here:
``invalid`` (unknown migration, a layout that does not fit), ``transfer``
(the read from X failed), ``internal``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from bana_sglang.wire.envelope import Channel, Error, encode
from bana_sglang.wire.envelope import Reply as _Reply
from bana_sglang.wire.envelope import Request as _Envelope

PROTOCOL_VERSION = 1

NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class TensorSlot(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor inside a packed buffer: bytes ``[offset, offset + nbytes)``."""

    name: str
    dtype: str  # torch dtype name without "torch."
    shape: list[NonNeg]
    offset: NonNeg


class _Request(_Envelope, kw_only=True, frozen=True):
    v: int = PROTOCOL_VERSION


class RunLayers(_Request, tag="run_layers"):
    """Run the guest layers of ``migration`` on one forward batch.

    ``mode`` is the attention the batch needs: ``extend`` (new tokens attend to
    their prefix and to each other, causally) or ``decode`` (one token per
    request). ``seq_lens``/``extend_lens`` are per request; the request's KV
    slot ids (``kv_slots``, concatenated in request order) and everything else
    are in X's buffer at ``addr`` (``nbytes``, registered with the transfer
    engine at ``session``), laid out as ``layout`` says."""

    migration: str
    step: NonNeg
    mode: Literal["extend", "decode"]
    session: str
    addr: Annotated[int, msgspec.Meta(ge=1)]
    nbytes: NonNeg
    layout: list[TensorSlot]
    seq_lens: list[NonNeg]
    extend_lens: list[NonNeg]


class Ping(_Request, tag="ping"):
    migration: str


Request = Union[RunLayers, Ping]


class LayersDone(_Reply, tag="layers_done"):
    """The outputs, in Y's registered buffer at ``addr`` (``nbytes``, ``layout``):
    ``hidden_states``, ``residual`` and ``new_k``/``new_v`` (``[layers, tokens,
    kv_heads, head_dim]``, the rows the batch wrote, which X stores in its own
    pool so its KV stays complete). ``compute_s``: Y's time running the layers."""

    step: int
    addr: int
    nbytes: int
    layout: list[TensorSlot]
    compute_s: float
    shipped_rows: int  # KV rows X sent with this step (missing on Y before)


class Pong(_Reply, tag="pong"):
    migration: str
    steps: int


Reply = Union[LayersDone, Pong, Error]

CHANNEL = Channel("the guest-layer executor", PROTOCOL_VERSION, Request, Reply)
decode_request = CHANNEL.decode_request
decode_reply = CHANNEL.decode_reply
__all__ = [
    "CHANNEL",
    "Error",
    "LayersDone",
    "RunLayers",
    "TensorSlot",
    "decode_reply",
    "decode_request",
    "encode",
]
