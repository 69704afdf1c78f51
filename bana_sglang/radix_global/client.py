"""The client of the global index service: calls that never hang and never raise.

:class:`IndexClient` is a :class:`bana_sglang.wire.transport.Client` of the
index channel (:mod:`bana_sglang.wire.index`). Every call has a timeout
(``BANA_INDEX_TIMEOUT_S``); after one timeout, or a full send queue, the client
fails fast for ``retry_interval_s`` (``BANA_INDEX_RETRY_S``) before it tries
the service again, logs once when an outage starts and once when it ends, and
recovers by itself. The high-level calls (:meth:`~IndexClient.lookup`,
:meth:`~IndexClient.publish_intent`, :meth:`~IndexClient.commit`,
:meth:`~IndexClient.report_loss`, :meth:`~IndexClient.stats`) turn an
unavailable service into a miss (or ``None``) and a refused request into a
logged ``None``; only :meth:`~IndexClient.call` raises
:class:`~bana_sglang.radix_global.errors.IndexUnavailable`.

No torch import here: the router asks the index through this client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from bana_sglang import envs
from bana_sglang.radix_global.errors import IndexUnavailable
from bana_sglang.radix_global.keys import PageHash
from bana_sglang.wire import index as m
from bana_sglang.wire.transport import FROM_ENV, ChannelError, Client

logger = logging.getLogger(__name__)

#: Requests queued towards a service that does not read them before sends fail
#: ("send queue full", an outage like a timeout).
SEND_HWM = 1000


class IndexMatch(NamedTuple):
    """A lookup answer. ``available`` is False when the service could not be asked
    (then ``length`` is 0: a miss)."""

    length: int
    sizes: tuple[int, ...]
    available: bool


class IndexClient:
    """Talks to the index service over a DEALER socket. Not thread-safe (the
    outage state is unguarded): one per thread. High-level calls never raise for
    an unavailable service."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float | None = None,
        retry_interval_s: float | None = None,
        name: str = "client",
        keys=FROM_ENV,
    ):
        self.endpoint = endpoint
        self.name = name
        self.timeout_s = timeout_s if timeout_s is not None else envs.BANA_INDEX_TIMEOUT_S.get()
        self.retry_interval_s = (
            retry_interval_s if retry_interval_s is not None else envs.BANA_INDEX_RETRY_S.get()
        )
        self._client = Client(
            endpoint, m.CHANNEL, timeout_s=self.timeout_s, send_hwm=SEND_HWM, keys=keys
        )
        self._down_since: float | None = None
        self._next_try = 0.0

    def close(self) -> None:
        self._client.close()

    @property
    def available(self) -> bool:
        return self._down_since is None

    def next_id(self) -> int:
        return self._client.next_id()

    def deadline(self) -> float:
        return time.time() + self.timeout_s

    def call(self, req: msgspec.Struct, *, timeout_s: float | None = None) -> m.Reply:
        """Send one request, wait for its reply. Raises :class:`IndexUnavailable`
        on timeout (or while failing fast after one)."""
        if self._down_since is not None and time.monotonic() < self._next_try:
            raise IndexUnavailable(
                "call", "index service unavailable (failing fast)", target=self.endpoint
            )
        try:
            reply = self._client.call(
                req, timeout_s=self.timeout_s if timeout_s is None else timeout_s
            )
        except ChannelError as e:  # the transport dropped the socket, and late replies with it
            self._went_down(e.detail)
            raise IndexUnavailable("call", e.detail, target=self.endpoint) from None
        if self._down_since is not None:
            logger.warning(
                "%s: index service %s reachable again after %.1fs",
                self.name,
                self.endpoint,
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        return reply

    def _went_down(self, why: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "%s: index service %s unavailable (%s); treating lookups as misses",
                self.name,
                self.endpoint,
                why,
            )
        self._next_try = time.monotonic() + self.retry_interval_s

    def _ask(self, req: msgspec.Struct) -> m.Reply | None:
        try:
            reply = self.call(req)
        except IndexUnavailable:
            return None
        if isinstance(reply, m.Error):
            logger.warning(
                "%s: index service refused %s: %s (%s)",
                self.name,
                type(req).__name__,
                reply.reason,
                reply.detail,
            )
            return None
        return reply

    # -- high level (never raise for an unavailable service)
    def lookup(
        self,
        chain: Sequence[PageHash],
        *,
        touch: bool = True,
        parent: PageHash | None = None,
        any_parent: bool = False,
    ) -> IndexMatch:
        reply = self._ask(
            m.Lookup(
                id=self.next_id(),
                deadline=self.deadline(),
                chain=list(chain),
                touch=touch,
                parent=parent,
                any_parent=any_parent,
            )
        )
        if not isinstance(reply, m.LookupResult):
            return IndexMatch(0, (), False)
        return IndexMatch(reply.length, tuple(reply.sizes), True)

    def publish_intent(
        self,
        chain: Sequence[PageHash],
        sizes: Sequence[int],
        owner: str,
        *,
        parent: PageHash | None = None,
    ) -> m.IntentResult | None:
        reply = self._ask(
            m.PublishIntent(
                id=self.next_id(),
                deadline=self.deadline(),
                chain=list(chain),
                sizes=list(sizes),
                owner=owner,
                parent=parent,
            )
        )
        return reply if isinstance(reply, m.IntentResult) else None

    def commit(self, intent: int, written: int) -> int | None:
        """Pages made visible, or None if the service could not be asked."""
        reply = self._ask(
            m.Commit(id=self.next_id(), deadline=self.deadline(), intent=intent, written=written)
        )
        return reply.count if isinstance(reply, m.Ok) else None

    def report_loss(self, pages: Sequence[PageHash], reporter: str) -> int | None:
        reply = self._ask(
            m.ReportLoss(
                id=self.next_id(), deadline=self.deadline(), pages=list(pages), reporter=reporter
            )
        )
        return reply.count if isinstance(reply, m.Ok) else None

    def clear(self) -> int | None:
        """Empty the store (index and pages); the pages forgotten, or None if the service
        could not be asked."""
        reply = self._ask(m.Clear(id=self.next_id(), deadline=self.deadline()))
        return reply.count if isinstance(reply, m.Ok) else None

    def stats(self) -> m.StatsResult | None:
        reply = self._ask(m.Stats(id=self.next_id(), deadline=self.deadline()))
        return reply if isinstance(reply, m.StatsResult) else None
