"""A synchronous client of a migration agent (light: ZMQ and msgspec only, so
the router and the command line do not import torch).

It is a :class:`bana_sglang.wire.transport.Client` of the agent channel whose
one failure, no reply in time, is :class:`AgentUnavailable`."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import zmq

from bana_sglang.migrate.errors import MigrateError
from bana_sglang.wire import agent as m
from bana_sglang.wire.envelope import Channel
from bana_sglang.wire.transport import ChannelError, Client

logger = logging.getLogger(__name__)


class AgentUnavailable(MigrateError, RuntimeError):
    """No reply from an agent within the timeout."""


class AgentClient:
    """Synchronous client of one agent (DEALER socket; one call at a time).

    ``channel``: the channel whose replies it decodes (default: the agent's).
    A reply to an earlier, timed-out call is skipped; an ``Error`` with id 0
    (a request the agent could not read) is returned as the reply."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 5.0,
        ctx: zmq.Context | None = None,
        channel: Channel | None = None,
    ):
        self._client = Client(endpoint, channel or m.CHANNEL, timeout_s=timeout_s, ctx=ctx)

    @property
    def endpoint(self) -> str:
        return self._client.endpoint

    @property
    def timeout_s(self) -> float:
        return self._client.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._client.timeout_s = value

    def close(self) -> None:
        self._client.close()

    def call(
        self, make: Callable[..., msgspec.Struct], *, timeout_s: float | None = None, **fields
    ) -> m.Reply:
        """Build a request with ``make(id=, deadline=, **fields)``, send it, return its reply."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self._client.request(make, timeout_s=timeout, **fields)
        except ChannelError as e:  # the socket is gone, and late replies with it
            raise AgentUnavailable(self._no_reply(e, f" within {timeout:.1f}s")) from None

    def send_raw(self, frame: bytes, *, timeout_s: float | None = None) -> m.Reply:
        """Send an arbitrary frame (tests of malformed input); the first reply."""
        try:
            return self._client.send_raw(frame, timeout_s=timeout_s)
        except ChannelError as e:
            raise AgentUnavailable(self._no_reply(e, "")) from None

    def _no_reply(self, e: ChannelError, within: str) -> str:
        msg = f"no reply from the agent at {self.endpoint}"
        return msg + within if e.detail.startswith("no reply") else f"{msg}: {e.detail}"
