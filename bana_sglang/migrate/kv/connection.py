"""A KV-block lender's connection to the host of one migration.

:class:`KVPeer` is a :class:`bana_sglang.wire.transport.Client` of the
:mod:`bana_sglang.wire.kv_blocks` channel plus the two step buffers the
migration's transfer-engine reads use. Requests are pipelined: the lender
posts one ``Attend`` per host and layer and waits for the replies later; a
``DropKV`` is posted and never waited for (its reply is skipped as a late
one). The socket lingers 2 s at close, so a ``DropKV`` posted just before a
migration settles still goes out.

Every failure of the host (no reply in time, a send that cannot go out, an
error reply, a failed read) is :class:`KVLost`.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq

from bana_sglang.migrate.errors import MigrateError
from bana_sglang.migrate.layers.owner import StepBuffer
from bana_sglang.wire import kv_blocks as w
from bana_sglang.wire.transport import ChannelError, Client

logger = logging.getLogger(__name__)

#: how long requests still queued at close keep being sent
LINGER_MS = 2000


class KVLost(MigrateError, RuntimeError):
    """The host of a KV-block migration failed; its segments are gone."""


class KVPeer:
    """The DEALER socket and step buffers of one KV-block migration."""

    def __init__(self, migration: str, endpoint: str, session: str, engine, timeout_s: float):
        self.migration, self.endpoint, self.session = migration, endpoint, session
        self.engine, self.timeout_s = engine, timeout_s
        self.send = StepBuffer(engine)
        self.recv = StepBuffer(engine)
        self._client = Client(endpoint, w.CHANNEL, timeout_s=timeout_s, linger_ms=LINGER_MS)
        self.payload: bytes | None = None

    def post(self, make, payload=None, **fields) -> int:
        """Send ``make(id=, deadline=, migration=, **fields)`` (and ``payload`` as its
        second frame) without waiting; its id. Raises :class:`KVLost` if it cannot go out."""
        c = self._client
        req = make(
            id=c.next_id(),
            deadline=time.time() + self.timeout_s,
            migration=self.migration,
            **fields,
        )
        try:
            return c.post(req) if payload is None else c.post(req, payload)
        except (ChannelError, zmq.ZMQError) as e:
            raise KVLost(f"sending to the KV host: {e}") from e

    def drop(self, keys: list[str]) -> None:
        """Tell the host to forget ``keys`` (not waited for: the host answers, nobody reads it).
        Best effort: a drop that cannot go out leaves the segment until the migration's end."""
        try:
            self.post(w.DropKV, keys=keys)
        except KVLost as e:
            logger.warning("KV-block migration %s: %s", self.migration, e)

    def wait(self, rid: int, timeout_s: float | None = None):
        """The reply to request ``rid``; raises :class:`KVLost` on silence or an error reply.
        A second frame of the reply (an inline payload) is left in ``self.payload``."""
        try:  # late answers (a drop not waited for, a step that timed out) are skipped
            reply = self._client.wait(rid, self.timeout_s if timeout_s is None else timeout_s)
        except ChannelError as e:  # the socket is gone
            raise KVLost(
                f"no answer from the KV host at {self.endpoint} within {self.timeout_s:.0f}s"
            ) from e
        if isinstance(reply, w.Error):
            raise KVLost(f"the KV host refused: {reply.reason}: {reply.detail}")
        frames = self._client.frames
        self.payload = frames[0].bytes if frames else None
        return reply

    def call(self, make, **fields):
        return self.wait(self.post(make, **fields))

    def read(self, dst: list[torch.Tensor], addrs: list[int]) -> None:
        try:
            self.engine.read(self.session, dst, addrs, timeout_s=self.timeout_s)
        except Exception as e:
            raise KVLost(f"reading from the KV host: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._client.close()
        self.send.close()
        self.recv.close()
