"""The router's choice of a (prefill, decode) pair for a request, and the load it counts.

:meth:`PairsMixin._pairs` yields the pairs a request is tried on (the policy's
choice among healthy workers that have not failed it, preferring ones not to be
avoided); :meth:`PairsMixin._begin` and :class:`PrefillCharge` count what a request
adds to a worker's in-flight load until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

from bana_sglang.router.policy import RouteRequest, RoutingError
from bana_sglang.router.workers import Worker
from bana_sglang.types import Tier

logger = logging.getLogger("bana_sglang.router.server")  # one logger for the router's lines


class PrefillCharge:
    """The tokens a request counts in its prefill worker's in-flight load, until
    :meth:`release`; :meth:`settle` lowers them to the globally uncached part once the
    index lookup answers (nothing changes after the release)."""

    __slots__ = ("worker", "tokens", "released")

    def __init__(self, worker: Worker, tokens: int):
        self.worker, self.tokens, self.released = worker, tokens, False

    def settle(self, lookup: asyncio.Future) -> None:
        if self.released or lookup.cancelled() or lookup.exception() is not None:
            return
        cached = lookup.result()
        if cached:
            cut = min(int(cached), self.tokens)
            self.tokens -= cut
            self.worker.lower(cut)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.worker.end(self.tokens)


class PairsMixin:
    """The router supplies its workers (``prefill``, ``decode``, ``by_id``), ``policy``,
    ``cfg``, ``metrics``, ``_routed`` and ``_lookups`` (see :class:`~.server.Router`)."""

    def _pick(
        self, tier: Tier, route: RouteRequest, exclude: set, avoid: set = frozenset()
    ) -> Worker | None:
        """The policy's choice among ``tier``'s workers not in ``exclude``: healthy ones
        not in ``avoid`` first, then healthy ones, then the ones marked down."""
        pool = self.prefill if tier is Tier.PREFILL else self.decode
        cands = [w for w in pool if w.healthy and w.id not in exclude and w.id not in avoid]
        if not cands:
            cands = [w for w in pool if w.healthy and w.id not in exclude]
        if not cands:  # every healthy one failed this request: try the ones marked down
            cands = [w for w in pool if w.id not in exclude]
        if not cands:
            return None
        now = time.monotonic()
        loads = [w.load(now) for w in cands]
        try:
            wid = (self.policy.pick_prefill if tier is Tier.PREFILL else self.policy.pick_decode)(
                route, loads
            )
        except RoutingError as e:
            logger.error("policy %s failed: %s", self.cfg.policy, e)
            return cands[0]
        return self.by_id[wid]

    def _pairs(
        self,
        route: RouteRequest,
        tried_p: set,
        tried_d: set,
        prefer_d: Worker | None = None,
        avoid: set = frozenset(),
    ):
        """Up to ``max_attempts`` (prefill, decode) pairs, skipping workers that
        already failed this request (the caller adds them to ``tried_*``) and, while
        there are others, those in ``avoid`` (ids of either tier); ``prefer_d``, while
        healthy, untried and not avoided, is the decode worker."""
        for _ in range(self.cfg.max_attempts):
            p = self._pick(Tier.PREFILL, route, tried_p, avoid)
            if (
                prefer_d is not None
                and prefer_d.healthy
                and prefer_d.id not in tried_d
                and prefer_d.id not in avoid
            ):
                d = prefer_d
            else:
                d = self._pick(Tier.DECODE, route, tried_d, avoid)
            if p is None or d is None:
                return
            yield p, d

    def _charge_prefill(self, p: Worker, route: RouteRequest) -> PrefillCharge:
        """Count ``route``'s uncached prompt tokens in ``p``'s load. While the global index
        lookup started for it is in flight, the whole prompt counts; its answer lowers
        the charge (the lookup runs beside the dispatch, not before it: the policy's
        choice never depends on it, see :meth:`Router._route_request`)."""
        charge = PrefillCharge(p, self._begin(p, route.uncached_tokens))
        lookup = self._lookups.get(route.request_id)
        if lookup is not None:
            if lookup.done():
                charge.settle(lookup)
            else:
                lookup.add_done_callback(charge.settle)
        return charge

    def _begin(self, w: Worker, tokens: int) -> int:
        """Count a request sent to ``w`` (router's own load and metrics); returns ``tokens``."""
        w.begin(tokens)
        child = self._routed.get(w.id)
        if child is None:
            child = self._routed[w.id] = self.metrics.routed.labels(w.url, w.tier.value)
        child.inc()
        return tokens
