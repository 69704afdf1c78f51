"""GlobalPrefixIndex: a stateful property test against a naive model, plus focused cases.

The property test drives random sequences of insert, lookup, evict and page
loss over chains that share prefixes, and checks after every step: prefix
closure, the capacity limit, exact agreement with a naive model, and that every
evicted page was, when evicted, an unprotected leaf with the smallest last use.
"""

from __future__ import annotations

import time

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from bana_sglang.radix_global.index import GlobalPrefixIndex
from bana_sglang.radix_global.keys import KVLayout, OwnerId, PageHash, page_chain

LAYOUT = KVLayout("test-model", "float32", page_size=2, num_kv_heads=1, head_dim=4, num_layers=1)
CAPACITY = 2000
# 3-symbol alphabet, page size 2: many chains share prefixes
token_lists = st.lists(st.integers(0, 2), min_size=2, max_size=14)


class _Model:
    """The naive reference: dict of pages, full scans everywhere."""

    def __init__(self) -> None:
        self.parent: dict[PageHash, PageHash | None] = {}
        self.size: dict[PageHash, int] = {}
        self.last: dict[PageHash, int] = {}
        self.clock = 0

    def children(self, page: PageHash) -> list[PageHash]:
        return [p for p, par in self.parent.items() if par == page]

    def leaves(self) -> set[PageHash]:
        parents = set(self.parent.values())
        return {p for p in self.parent if p not in parents}

    def prefix(self, chain: list[PageHash]) -> int:
        n, par = 0, None
        for page in chain:
            if self.parent.get(page, "absent") != par:
                break
            n, par = n + 1, page
        return n

    def touch(self, pages: list[PageHash]) -> None:
        self.clock += 1
        for p in pages:
            self.last[p] = self.clock

    def remove(self, page: PageHash) -> None:
        del self.parent[page], self.size[page], self.last[page]

    def check_victims(self, victims, protect: set[PageHash]) -> None:
        for v in victims:
            candidates = self.leaves() - protect
            assert v.page in candidates, f"evicted {v.page} is not an unprotected leaf"
            oldest = min(self.last[p] for p in candidates)
            assert self.last[v.page] == oldest, "evicted a leaf that is not least recently used"
            self.remove(v.page)

    def subtree(self, page: PageHash) -> set[PageHash]:
        out, stack = set(), [page]
        while stack:
            p = stack.pop()
            out.add(p)
            stack.extend(self.children(p))
        return out


class IndexMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.index = GlobalPrefixIndex(CAPACITY)
        self.model = _Model()
        self.seen: list[list[PageHash]] = []

    def _chain(self, tokens: list[int]) -> list[PageHash]:
        chain = page_chain(tokens, LAYOUT)
        self.seen.append(chain)
        return chain

    @rule(tokens=token_lists, sizes=st.lists(st.integers(50, 450), min_size=7, max_size=7))
    def insert(self, tokens, sizes):
        chain = self._chain(tokens)
        sizes = sizes[: len(chain)]
        present = self.model.prefix(chain)
        res = self.index.insert(chain, sizes, OwnerId("w"))
        assert res.present == present
        assert res.accepted == tuple(chain[present : present + len(res.accepted)])
        assert res.rejected == tuple(chain[present + len(res.accepted) :])
        self.model.check_victims(res.evicted, set(chain))
        self.model.touch(chain[: present + len(res.accepted)])
        for i in range(present, present + len(res.accepted)):
            self.model.parent[chain[i]] = chain[i - 1] if i else None
            self.model.size[chain[i]] = sizes[i]
            self.model.last[chain[i]] = self.model.clock
        if res.rejected:  # only refused when it could not fit next to the chain itself
            assert res.reason and res.reason.startswith("capacity")
            assert sizes[present + len(res.accepted)] > self.index.free_bytes
            assert set(self.model.parent) <= set(chain), "refused while other pages were evictable"

    @rule(tokens=token_lists)
    def lookup(self, tokens):
        chain = self._chain(tokens)
        match = self.index.longest_prefix(chain)
        assert match.length == self.model.prefix(chain)
        assert [p.page for p in match.pages] == chain[: match.length]
        if match.length:
            self.model.touch(chain[: match.length])

    @rule(nbytes=st.integers(0, CAPACITY + 100))
    def evict(self, nbytes):
        victims = self.index.evict_for(nbytes)
        self.model.check_victims(victims, set())
        if nbytes > CAPACITY:
            assert victims == []
        else:
            assert self.index.free_bytes >= nbytes or len(self.index) == 0

    @rule(data=st.data())
    def lose_page(self, data):
        if not self.model.parent:
            return
        page = data.draw(st.sampled_from(sorted(self.model.parent)))
        expected = self.model.subtree(page)
        dropped = self.index.forget([page])
        assert {d.page for d in dropped} == expected
        for p in expected:
            self.model.remove(p)

    @invariant()
    def consistent(self):
        self.index.check_invariants()
        assert set(self.model.parent) == {p for c in self.seen for p in c if p in self.index}
        assert self.index.used_bytes == sum(self.model.size.values()) <= CAPACITY
        for _page, parent in self.model.parent.items():  # closure, independently of the index
            assert parent is None or parent in self.model.parent


IndexMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexProperties = IndexMachine.TestCase


# ---------------------------------------------------------------------- focused cases


def _chain(tokens) -> list[PageHash]:
    return page_chain(tokens, LAYOUT)


def test_page_needs_its_parent():
    idx = GlobalPrefixIndex(10_000)
    a = _chain([1, 1, 2, 2, 3, 3])
    b = _chain([9, 9, 2, 2, 3, 3])  # same later tokens, other first page: other hashes
    assert set(a).isdisjoint(b)
    idx.insert(a, [10] * 3, OwnerId("w"))
    # a chain whose second page is already indexed under another parent is refused there
    res = idx.insert([b[0], a[1]], [10, 10], OwnerId("w"))
    assert res.accepted == (b[0],) and res.rejected == (a[1],) and res.reason.startswith("conflict")
    assert idx.longest_prefix([b[0], a[1]]).length == 1
    idx.check_invariants()


def test_lru_among_leaves_and_no_orphans():
    idx = GlobalPrefixIndex(600)
    a, b = _chain([0] * 6), _chain([1] * 6)
    idx.insert(a, [100] * 3, OwnerId("w"))
    idx.insert(b, [100] * 3, OwnerId("w"))
    idx.longest_prefix(a)  # a is now more recently used
    victims = idx.evict_for(300)
    assert [v.page for v in victims] == [b[2], b[1], b[0]]  # leaf first, up the chain
    idx.check_invariants()
    assert idx.longest_prefix(a).length == 3


def test_insert_evicts_others_not_its_own_prefix():
    idx = GlobalPrefixIndex(500)
    a, b = _chain([0] * 8), _chain([1] * 8)
    idx.insert(a, [100] * 4, OwnerId("w"))
    res = idx.insert(b[:1], [100], OwnerId("w"))  # fits
    assert res.evicted == ()
    res = idx.insert(b, [100] * 4, OwnerId("w"))
    assert {v.page for v in res.evicted} == set(a[1:])
    assert res.accepted == tuple(b[1:])
    assert idx.longest_prefix(a).length == 1
    res = idx.insert(_chain([2] * 2), [501], OwnerId("w"))
    assert res.accepted == () and res.reason.startswith("capacity") and res.evicted == ()
    idx.check_invariants()


def test_forget_drops_descendants_only():
    idx = GlobalPrefixIndex(10_000)
    trunk = _chain([5] * 4)
    left, right = _chain([5] * 4 + [1] * 4), _chain([5] * 4 + [2] * 4)
    idx.insert(left, [10] * 4, OwnerId("w"))
    idx.insert(right, [10] * 4, OwnerId("w"))
    dropped = idx.forget([left[2]])
    assert {d.page for d in dropped} == {left[2], left[3]}
    assert idx.longest_prefix(right).length == 4
    assert idx.longest_prefix(left).length == 2
    assert idx.forget(["f" * 32]) == []
    assert len(idx.forget([trunk[0]])) == 4
    assert len(idx) == 0
    idx.check_invariants()


def test_hits_and_last_use():
    idx = GlobalPrefixIndex(10_000)
    a = _chain([3] * 6)
    idx.insert(a, [10] * 3, OwnerId("w0"))
    idx.longest_prefix(a[:2])
    m = idx.longest_prefix(a)
    assert [p.hits for p in m.pages] == [2, 2, 1]
    assert m.pages[0].owner == "w0" and m.pages[2].depth == 2
    s = idx.stats()
    assert (s.lookups, s.hit_pages, s.lookup_pages) == (2, 5, 5)


def test_large_tree_is_fast():
    """2k chains x 16 pages into room for 8k pages (constant eviction): a full
    scan per operation would make this quadratic (minutes); it takes ~1-3 s."""
    idx = GlobalPrefixIndex(8_000 * 100)
    t0 = time.perf_counter()
    chains = []
    for i in range(2_000):
        c = [PageHash(f"{i:016x}{j:016x}") for j in range(16)]
        chains.append(c)
        idx.insert(c, [100] * 16, OwnerId("w"))
    for c in chains[-1000:]:
        idx.longest_prefix(c)
    elapsed = time.perf_counter() - t0
    assert idx.used_bytes <= idx.capacity_bytes and len(idx) == 8_000
    idx.check_invariants()
    assert elapsed < 30, f"too slow: {elapsed:.1f}s"


def test_chains_continuing_a_known_parent():
    """The linker sees only the tail after the device-cached prefix: inserts and
    lookups may start below the root, after an indexed parent."""
    idx = GlobalPrefixIndex(10_000)
    full = _chain(list(range(16)))  # 8 pages
    idx.insert(full[:3], [10] * 3, OwnerId("w"))
    res = idx.insert(full[3:6], [10] * 3, OwnerId("w"), parent=full[2])
    assert res.accepted == tuple(full[3:6])
    assert idx.get(full[5]).depth == 5
    assert idx.longest_prefix(full).length == 6
    assert idx.longest_prefix(full[3:], parent=full[2]).length == 3
    assert idx.longest_prefix(full[3:]).length == 0  # not a root
    assert idx.longest_prefix(full[4:], any_parent=True).length == 2
    orphan = idx.insert(full[7:], [10], OwnerId("w"), parent=full[6])  # parent absent
    assert orphan.accepted == () and orphan.reason == "parent not indexed"
    # eviction for an anchored insert never takes the anchor
    small = GlobalPrefixIndex(30)
    small.insert(full[:2], [10, 10], OwnerId("w"))
    res = small.insert(full[2:4], [10, 10], OwnerId("w"), parent=full[1])
    assert res.accepted == (full[2],) and res.reason.startswith("capacity")
    small.check_invariants()
    idx.check_invariants()
