"""Approximate per-worker prefix tree over chained page hashes.

The router's cache-aware baselines keep one of these per worker: an
*approximation* of what that worker has cached, built only from the router's
own routing decisions (SGLang's router does the same with a character tree of
the request text). Keys are chained page hashes (each hash determines its whole
prefix, as SGLang's ``get_hash_str`` chains and the Mooncake traces'
``hash_ids`` are), so a node is identified by its hash alone and the tree is a
parent map.

Invariants:
- Prefix closure: if a hash is stored, its parent is stored too (eviction removes
  leaves only, least recently used first).
- ``size`` (pages stored) never exceeds ``capacity`` after ``insert`` returns,
  unless the chain just inserted is itself longer (its pages are protected).
- Deterministic: the same sequence of calls gives the same tree.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Hashable, Sequence

logger = logging.getLogger(__name__)


class PagePrefixTree:
    """LRU prefix tree keyed by chained page hashes, bounded in pages."""

    __slots__ = ("capacity", "_parent", "_children", "_last", "_clock", "_leaves")

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}
        self._clock = 0
        # Lazy heap of (last_access, hash) candidates for eviction; entries are
        # validated on pop (stale access time or not a leaf any more).
        self._leaves: list[tuple[int, Hashable]] = []

    @property
    def size(self) -> int:
        return len(self._parent)

    def __contains__(self, h: Hashable) -> bool:
        return h in self._parent

    def match(self, hashes: Sequence[Hashable], *, touch: bool = False) -> int:
        """Number of leading pages of ``hashes`` present (prefix closure makes a
        first miss final). With ``touch`` the matched pages become most recent."""
        parent = self._parent
        n = 0
        for h in hashes:
            if h not in parent:
                break
            n += 1
        if touch and n:
            self._clock += 1
            for h in hashes[:n]:
                self._last[h] = self._clock
            heapq.heappush(self._leaves, (self._clock, hashes[n - 1]))
        return n

    def insert(self, hashes: Sequence[Hashable]) -> int:
        """Insert the chain; returns the number of pages newly added."""
        self._clock += 1
        now = self._clock
        parent = self._parent
        prev: Hashable | None = None
        added = 0
        for h in hashes:
            if h not in parent:
                parent[h] = prev
                self._children[h] = 0
                if prev is not None:
                    self._children[prev] += 1
                added += 1
            self._last[h] = now
            prev = h
        if prev is not None:
            heapq.heappush(self._leaves, (now, prev))
        if self.capacity is not None and len(parent) > self.capacity:
            self._evict(len(parent) - self.capacity, protect=set(hashes))
        return added

    def _evict(self, n: int, protect: set[Hashable]) -> None:
        heap = self._leaves
        deferred: list[tuple[int, Hashable]] = []
        while n > 0 and heap:
            t, h = heapq.heappop(heap)
            if h not in self._parent or self._last.get(h) != t or self._children[h] != 0:
                continue  # stale entry
            if h in protect:
                deferred.append((t, h))
                continue
            p = self._parent.pop(h)
            del self._children[h]
            del self._last[h]
            n -= 1
            if p is not None:
                self._children[p] -= 1
                if self._children[p] == 0:
                    heapq.heappush(heap, (self._last[p], p))
        for item in deferred:
            heapq.heappush(heap, item)
        if n > 0:
            logger.debug("prefix tree could not evict %s pages (all protected)", n)
