"""The envelope shared by every typed ZMQ channel of bana_sglang.

A channel is a set of :mod:`msgspec` request and reply structs, tagged by a
``type`` field and encoded with msgpack, one ZMQ frame per message (no pickle,
no positional frames). Every request carries ``id`` (chosen by the client,
echoed in the reply), ``v`` (the channel's protocol version) and ``deadline``
(absolute Unix time in seconds). :class:`Channel` turns a request frame into a
request or an :class:`Error` reply whose ``reason`` says why:

- ``malformed``: not msgpack, not a map, a field missing or of the wrong type;
- ``unknown_type``: a ``type`` the channel does not know;
- ``unsupported_version``: ``v`` differs from the channel's version;
- ``stale_deadline``: the deadline had passed when the receiver read it (the
  sender has given up; the request is not executed).

Channels add their own reasons (``invalid``, ``internal``, ...).
"""

from __future__ import annotations

import time
import typing
from typing import Any

import msgspec

#: the reasons every channel's server may answer before a handler runs
ENVELOPE_REASONS = ("malformed", "unknown_type", "unsupported_version", "stale_deadline")


class Request(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    """Base of every request: ``id``, ``deadline`` and the protocol version ``v``."""

    id: int
    deadline: float
    v: int = 1


class Reply(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    id: int


class Error(Reply, tag="error"):
    reason: str
    detail: str = ""


class _Envelope(msgspec.Struct):
    """The fields every request has, read before the full decode so that an
    unknown type or version gets a precise error (unknown fields are ignored)."""

    type: str
    id: int = 0
    v: int = -1


_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def tags(union: Any) -> tuple[str, ...]:
    """The ``type`` tags of the structs in a ``Union`` of tagged structs, in order."""
    return tuple(cls.__struct_config__.tag for cls in typing.get_args(union) or (union,))


class Channel:
    """Decoding and validation of one channel's requests and replies.

    ``requests`` and ``replies`` are ``Union``s of tagged structs; the request
    types a receiver knows are read from the first, so a struct added to the
    Union is known everywhere at once."""

    def __init__(self, name: str, version: int, requests: Any, replies: Any):
        self.name = name
        self.version = version
        self.request_types = tags(requests)
        self.request_classes: tuple[type, ...] = typing.get_args(requests) or (requests,)
        self._requests = msgspec.msgpack.Decoder(requests)
        self._replies = msgspec.msgpack.Decoder(replies)

    def decode_request(self, data: bytes, *, now: float | None = None) -> Any:
        """One request frame -> a request struct, or an :class:`Error` reply
        (with the request id when it could be read)."""
        try:
            env = _envelope_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return Error(id=0, reason="malformed", detail=str(e))
        if env.type not in self.request_types:
            return Error(
                id=env.id,
                reason="unknown_type",
                detail=f"type {env.type!r}; {self.name} knows: {', '.join(self.request_types)}",
            )
        if env.v != self.version:
            return Error(
                id=env.id,
                reason="unsupported_version",
                detail=f"got v={env.v}, {self.name} speaks v={self.version}",
            )
        try:
            req = self._requests.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return Error(id=env.id, reason="malformed", detail=str(e))
        now = time.time() if now is None else now
        if req.deadline < now:
            return Error(
                id=req.id,
                reason="stale_deadline",
                detail=f"deadline passed {now - req.deadline:.3f}s before {self.name} read it",
            )
        return req

    def decode_reply(self, data: bytes) -> Any:
        """Decode a reply; raises ``msgspec.DecodeError``/``ValidationError`` if malformed."""
        return self._replies.decode(data)
