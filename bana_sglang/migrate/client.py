"""A synchronous client of a migration agent (light: ZMQ and msgspec only, so
the router and the command line do not import torch)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from bana_sglang import wire
from bana_sglang.wire import agent as m

logger = logging.getLogger(__name__)


class AgentUnavailable(RuntimeError):
    """No reply from an agent within the timeout."""


class AgentClient:
    """Synchronous client of one agent (DEALER socket; one call at a time)."""

    def __init__(
        self, endpoint: str, *, timeout_s: float = 5.0, ctx: zmq.Context | None = None, channel=None
    ):
        self.endpoint = endpoint
        # the channel whose replies this client decodes (default: the agent's)
        self._decode_reply = (channel or m.CHANNEL).decode_reply
        self.timeout_s = timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def call(
        self, make: Callable[..., msgspec.Struct], *, timeout_s: float | None = None, **fields
    ) -> m.Reply:
        """Build a request with ``make(id=, deadline=, **fields)``, send it, return its reply."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            rid = next(self._ids)
            req = make(id=rid, deadline=time.time() + timeout, **fields)
            sock = self._socket()
            sock.send(m.encode(req))
            end = time.monotonic() + timeout
            while (left := end - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    continue
                try:
                    reply = self._decode_reply(sock.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    logger.warning("undecodable reply from %s: %s", self.endpoint, e)
                    continue
                if reply.id == rid or (isinstance(reply, wire.Error) and reply.id == 0):
                    return reply
            self.close()  # late replies go with the socket
            raise AgentUnavailable(
                f"no reply from the agent at {self.endpoint} within {timeout:.1f}s"
            )

    def send_raw(self, frame: bytes, *, timeout_s: float | None = None) -> m.Reply:
        """Send an arbitrary frame (tests of malformed input); the first reply."""
        with self._lock:
            sock = self._socket()
            sock.send(frame)
            if not sock.poll(
                int((self.timeout_s if timeout_s is None else timeout_s) * 1000), zmq.POLLIN
            ):
                self.close()
                raise AgentUnavailable(f"no reply from the agent at {self.endpoint}")
            return self._decode_reply(sock.recv())
