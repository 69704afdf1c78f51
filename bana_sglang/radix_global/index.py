"""The global prefix index: a tree over chained page hashes, pure and single-threaded.

Every node is one KV page held in the store, keyed by its chained hash
(:func:`keys.page_chain`); its parent is the page before it in the chain. The
index knows each page's size, publisher, last use and hit count, and decides
what to evict. It does no I/O: the service (:mod:`service`) turns its
decisions into store removals.

Invariants (checked by :meth:`GlobalPrefixIndex.check_invariants` and the
property test ``tests/unit/radix_global/test_radix_index.py``):

- prefix closure: a page is present only if its parent is present. ``insert``
  accepts a page only when its parent is present (or is accepted earlier in the
  same call); ``evict_for`` removes leaves only; ``forget`` removes a page
  together with all its descendants;
- capacity: ``used_bytes == sum(sizes of present pages) <= capacity_bytes`` after
  every call;
- eviction order: each page ``evict_for`` removes is, at the moment it is
  removed, a leaf with the smallest ``last_use`` among unprotected leaves
  (LRU among leaves; ties broken by the order leaves were last touched);
- ``last_use`` of a parent is >= that of each child (every use of a page
  touches its whole prefix), so a page that becomes a leaf by eviction of its
  last child is never "newer" than it really is.

Complexity: ``longest_prefix``/``insert`` O(chain length + evictions * log n);
``evict_for`` O(victims * log n) amortised (a lazy leaf min-heap, compacted when
stale entries dominate); ``forget`` O(size of the dropped subtrees).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from bana_sglang.radix_global.keys import OwnerId, PageHash


@dataclass(frozen=True)
class PageInfo:
    """A snapshot of one indexed page."""

    page: PageHash
    parent: PageHash | None
    depth: int  # position in its chain (0 = first page)
    size: int  # bytes the page takes in the store (header + payload)
    owner: OwnerId  # who published it
    last_use: int  # logical clock of the last lookup/insert that touched it
    hits: int  # lookups that matched it


class Match(NamedTuple):
    """Result of :meth:`GlobalPrefixIndex.longest_prefix`: ``length`` leading pages
    of the chain are indexed; ``pages`` describes them in chain order."""

    length: int
    pages: tuple[PageInfo, ...]


class InsertResult(NamedTuple):
    """``present``: pages of the chain that were already indexed (leading run);
    ``accepted``: pages added now; ``rejected``: the rest of the chain (not added);
    ``reason``: why the first rejected page was refused (None when nothing was);
    ``evicted``: pages evicted to make room (to be removed from the store)."""

    present: int
    accepted: tuple[PageHash, ...]
    rejected: tuple[PageHash, ...]
    reason: str | None
    evicted: tuple[PageInfo, ...]


class IndexStats(NamedTuple):
    pages: int
    leaves: int
    used_bytes: int
    capacity_bytes: int
    lookups: int
    lookup_pages: int  # pages asked for by lookups
    hit_pages: int  # pages matched by lookups
    inserted: int
    evicted: int
    forgotten: int


class _Node:
    __slots__ = (
        "children",
        "depth",
        "hits",
        "last_use",
        "owner",
        "page",
        "parent",
        "size",
        "stamp",
    )

    def __init__(
        self,
        page: PageHash,
        parent: PageHash | None,
        depth: int,
        size: int,
        owner: OwnerId,
        tick: int,
    ):
        self.page = page
        self.parent = parent
        self.depth = depth
        self.size = size
        self.owner = owner
        self.children: set[PageHash] = set()
        self.last_use = tick
        self.hits = 0
        self.stamp = -1  # sequence number of this node's valid leaf-heap entry; -1: none

    def info(self) -> PageInfo:
        return PageInfo(
            self.page, self.parent, self.depth, self.size, self.owner, self.last_use, self.hits
        )


class GlobalPrefixIndex:
    """A capacity-bounded, prefix-closed index of stored KV pages (see module doc)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.used_bytes = 0
        self._nodes: dict[PageHash, _Node] = {}
        self._heap: list[tuple[int, int, PageHash]] = []  # (last_use, seq, page), lazy
        self._leaves = 0
        self._tick = 0
        self._seq = 0
        self._lookups = self._lookup_pages = self._hit_pages = 0
        self._inserted = self._evicted = self._forgotten = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, page: object) -> bool:
        return page in self._nodes

    def get(self, page: PageHash) -> PageInfo | None:
        node = self._nodes.get(page)
        return node.info() if node else None

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def stats(self) -> IndexStats:
        return IndexStats(
            len(self._nodes),
            self._leaves,
            self.used_bytes,
            self.capacity_bytes,
            self._lookups,
            self._lookup_pages,
            self._hit_pages,
            self._inserted,
            self._evicted,
            self._forgotten,
        )

    def _prefix(
        self, chain: Sequence[PageHash], parent: PageHash | None = None, any_parent: bool = False
    ) -> list[_Node]:
        """Nodes of the longest indexed prefix of ``chain`` (parents must match;
        ``chain[0]``'s parent must be ``parent`` unless ``any_parent``)."""
        out: list[_Node] = []
        for i, page in enumerate(chain):
            node = self._nodes.get(page)
            if node is None or (node.parent != parent and not (i == 0 and any_parent)):
                break
            out.append(node)
            parent = page
        return out

    def longest_prefix(
        self,
        chain: Sequence[PageHash],
        *,
        touch: bool = True,
        hit: bool = True,
        parent: PageHash | None = None,
        any_parent: bool = False,
    ) -> Match:
        """How many leading pages of ``chain`` are indexed. ``chain`` starts at the
        root, or after ``parent`` (a chain continuing a known prefix), or, with
        ``any_parent``, wherever ``chain[0]`` is (safe with chained hashes: a
        page's hash fixes its whole prefix). With ``touch`` (the default) this
        is a use: matched pages get a new ``last_use``; with ``hit`` too, it
        counts as a lookup and each matched page gets one hit."""
        nodes = self._prefix(chain, parent, any_parent)
        if touch and hit:
            self._lookups += 1
            self._lookup_pages += len(chain)
            self._hit_pages += len(nodes)
        if touch:
            self._touch(nodes, hit=hit)
        return Match(len(nodes), tuple(n.info() for n in nodes))

    # ------------------------------------------------------------------ updates
    def insert(
        self,
        chain: Sequence[PageHash],
        sizes: Sequence[int],
        owner: OwnerId,
        *,
        parent: PageHash | None = None,
    ) -> InsertResult:
        """Index the pages of ``chain`` that are not indexed yet. ``chain`` starts
        at the root (page 0), or right after ``parent``, which must be indexed.
        ``sizes[i]`` is page i's size in bytes (ignored for pages already
        present). Evicts LRU leaves (never the chain's own pages nor ``parent``)
        when full; stops at the first page that cannot be accepted."""
        if len(sizes) != len(chain):
            raise ValueError(f"insert: {len(chain)} pages but {len(sizes)} sizes")
        anchor = self._nodes.get(parent) if parent is not None else None
        if parent is not None and anchor is None:
            return InsertResult(0, (), tuple(chain), "parent not indexed", ())
        present = self._prefix(chain, parent)
        touched = ([anchor] if anchor else []) + present
        if touched:
            self._touch(touched, hit=False)
        else:
            self._tick += 1  # new pages get a fresh last_use
        protect = {n.page for n in touched}
        accepted: list[PageHash] = []
        evicted: list[PageInfo] = []
        reason: str | None = None
        parent_node = present[-1] if present else anchor
        base_depth = anchor.depth + 1 if anchor else 0
        i = len(present)
        while i < len(chain):
            page, size = chain[i], int(sizes[i])
            if page in self._nodes:
                reason = "conflict: page already indexed under another parent"
                break
            if page in protect:
                reason = "conflict: page repeats earlier in the chain"
                break
            if size <= 0:
                reason = f"invalid size {size}"
                break
            if size > self.free_bytes:
                evicted.extend(self.evict_for(size, protect=protect))
                if size > self.free_bytes:
                    reason = "capacity: page does not fit even after eviction"
                    break
            node = _Node(
                page,
                parent_node.page if parent_node else None,
                base_depth + i,
                size,
                owner,
                self._tick,
            )
            self._nodes[page] = node
            self.used_bytes += size
            if parent_node is not None:
                if not parent_node.children:  # it stops being a leaf
                    parent_node.stamp = -1
                    self._leaves -= 1
                parent_node.children.add(page)
            self._push_leaf(node)
            self._leaves += 1
            self._inserted += 1
            protect.add(page)
            accepted.append(page)
            parent_node = node
            i += 1
        return InsertResult(len(present), tuple(accepted), tuple(chain[i:]), reason, tuple(evicted))

    def evict_for(self, nbytes: int, *, protect: Iterable[PageHash] = ()) -> list[PageInfo]:
        """Evict LRU leaves until ``nbytes`` more bytes fit (or nothing evictable
        is left); pages in ``protect`` stay. Returns the evicted pages in
        eviction order; the caller removes them from the store. Evicts nothing
        when ``nbytes`` exceeds the whole capacity."""
        if nbytes > self.capacity_bytes or nbytes <= self.free_bytes:
            return []
        protected = set(protect)
        kept: list[tuple[int, int, PageHash]] = []
        out: list[PageInfo] = []
        while nbytes > self.free_bytes and self._heap:
            entry = heapq.heappop(self._heap)
            node = self._nodes.get(entry[2])
            if node is None or node.stamp != entry[1]:
                continue  # stale entry
            if node.page in protected:
                kept.append(entry)
                continue
            out.append(node.info())
            self._remove_leaf(node)
            self._evicted += 1
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return out

    def forget(self, pages: Iterable[PageHash]) -> list[PageInfo]:
        """The store lost ``pages``: drop them and all their descendants (so that
        closure holds). Unknown pages are ignored. Returns what was dropped."""
        dropped: list[PageInfo] = []
        for page in pages:
            top = self._nodes.get(page)
            if top is None:
                continue
            stack = [top]
            subtree: list[_Node] = []
            while stack:
                node = stack.pop()
                subtree.append(node)
                stack.extend(self._nodes[c] for c in node.children)
            for node in reversed(subtree):  # leaves first: each removal is a leaf removal
                dropped.append(node.info())
                self._remove_leaf(node)
                self._forgotten += 1
        return dropped

    def clear(self) -> list[PageInfo]:
        """Forget everything (e.g. the store restarted and lost every key)."""
        dropped = [n.info() for n in self._nodes.values()]
        self._forgotten += len(dropped)
        self._nodes.clear()
        self._heap.clear()
        self.used_bytes = 0
        self._leaves = 0
        return dropped

    # ------------------------------------------------------------------ internals
    def _touch(self, nodes: list[_Node], *, hit: bool) -> None:
        if not nodes:
            return
        self._tick += 1
        for node in nodes:
            node.last_use = self._tick
            if hit:
                node.hits += 1
        # a chain that starts below the root uses its ancestors too
        up = nodes[0].parent
        while up is not None:
            anc = self._nodes[up]
            anc.last_use = self._tick
            up = anc.parent
        last = nodes[-1]  # only the deepest matched page can be a leaf
        if not last.children:
            self._push_leaf(last)

    def _push_leaf(self, node: _Node) -> None:
        self._seq += 1
        node.stamp = self._seq
        heapq.heappush(self._heap, (node.last_use, self._seq, node.page))
        if len(self._heap) > 64 and len(self._heap) > 4 * max(self._leaves, 1):
            self._compact()

    def _compact(self) -> None:
        self._heap = [
            e for e in self._heap if (n := self._nodes.get(e[2])) is not None and n.stamp == e[1]
        ]
        heapq.heapify(self._heap)

    def _remove_leaf(self, node: _Node) -> None:
        assert not node.children, "only leaves are removed"
        del self._nodes[node.page]
        self.used_bytes -= node.size
        self._leaves -= 1
        node.stamp = -1
        if node.parent is not None:
            parent = self._nodes[node.parent]
            parent.children.discard(node.page)
            if not parent.children:
                self._leaves += 1
                self._push_leaf(parent)

    # ------------------------------------------------------------------ testing aid
    def leaves(self) -> list[PageInfo]:
        return [n.info() for n in self._nodes.values() if not n.children]

    def check_invariants(self) -> None:
        """Raise AssertionError if closure, accounting or the leaf heap are broken."""
        used = 0
        leaves = 0
        valid = {(e[1], e[2]) for e in self._heap}
        for page, node in self._nodes.items():
            used += node.size
            if node.parent is None:
                assert node.depth == 0, f"root {page} at depth {node.depth}"
            else:
                parent = self._nodes.get(node.parent)
                assert parent is not None, f"orphan {page}: parent {node.parent} missing"
                assert page in parent.children, f"{page} missing from its parent's children"
                assert node.depth == parent.depth + 1
                assert parent.last_use >= node.last_use, f"parent of {page} older than it"
            for c in node.children:
                assert self._nodes[c].parent == page
            if not node.children:
                leaves += 1
                assert (node.stamp, page) in valid, f"leaf {page} has no valid heap entry"
        assert used == self.used_bytes, f"used_bytes {self.used_bytes} != sum {used}"
        assert self.used_bytes <= self.capacity_bytes, "over capacity"
        assert leaves == self._leaves, f"leaf count {self._leaves} != {leaves}"
