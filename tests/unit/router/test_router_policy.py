"""Unit tests of the pure routing policies and the approximate prefix tree."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bana_sglang.router.policy import (
    POLICIES,
    CacheAwareConfig,
    RouteRequest,
    RoutingError,
    get_policy,
)
from bana_sglang.router.prefix_tree import PagePrefixTree
from bana_sglang.types import RequestId, Tier, WorkerId, WorkerLoad


def P(i: int, **kw) -> WorkerLoad:
    return WorkerLoad(worker_id=WorkerId(f"p{i}"), tier=Tier.PREFILL, kv_total_tokens=100_000, **kw)


def D(i: int, **kw) -> WorkerLoad:
    kw.setdefault("kv_total_tokens", 100_000)
    return WorkerLoad(worker_id=WorkerId(f"d{i}"), tier=Tier.DECODE, **kw)


def req(n=4096, hashes=(), rid="r", out=128) -> RouteRequest:
    return RouteRequest(RequestId(rid), n, tuple(hashes), out)


class Oracle:
    """A CacheOracle backed by plain dicts."""

    def __init__(self, global_pages=0, local=None):
        self.g, self.local = global_pages, local or {}

    def global_match(self, hashes):
        return min(self.g, len(hashes))

    def local_match(self, worker, hashes):
        return min(self.local.get(worker, 0), len(hashes))


def test_registry_names_and_clear_error():
    assert {"bana", "round_robin", "power_of_two", "cache_aware", "global_cache_aware"} <= set(
        POLICIES
    )
    assert get_policy().name == "bana"
    with pytest.raises(RoutingError) as e:
        get_policy("nope")
    for name in POLICIES:
        assert name in str(e.value)


def test_snapshot_is_frozen_and_derived_fields():
    w = D(0, kv_used_tokens=60_000, inflight_tokens=10_000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.kv_used_tokens = 1  # type: ignore[misc]
    assert w.kv_free_tokens == 30_000 and w.kv_usage == pytest.approx(0.7)


def test_bana_routes_by_load_only():
    pol = get_policy("bana", oracle=Oracle(global_pages=4, local={WorkerId("p0"): 8}))
    loads = [
        P(0, queued_prefill_tokens=50_000),
        P(1, queued_prefill_tokens=1_000),
        P(2, queued_prefill_tokens=9_000),
    ]
    # p0 holds the whole prefix locally, but it is the busiest: bana ignores placement.
    assert pol.pick_prefill(req(hashes=range(8)), loads) == "p1"


def test_load_aware_policies_compare_queues_at_each_workers_prefill_speed():
    """A donor whose layers partly run on a peer drains its queue faster, the peer
    slower: 10k queued tokens at speed 2 are 5k tokens of work, less than 6k at 1."""
    loads = [
        P(0, queued_prefill_tokens=10_000, prefill_speed=2.0),
        P(1, queued_prefill_tokens=6_000),
        P(2, queued_prefill_tokens=4_000, prefill_speed=0.5),
    ]
    assert loads[0].prefill_backlog_tokens == 5_000 and loads[2].prefill_backlog_tokens == 8_000
    assert get_policy("bana").pick_prefill(req(), loads) == "p0"
    assert get_policy("global_cache_aware").pick_prefill(req(), loads) == "p0"
    same = [dataclasses.replace(w, prefill_speed=1.0) for w in loads]
    assert get_policy("bana").pick_prefill(req(), same) == "p2"
    with pytest.raises(ValueError, match="prefill_speed"):
        P(3, prefill_speed=0.0)


def test_bana_spreads_a_hot_prefix_while_cache_aware_concentrates_it():
    hashes = tuple(range(16))
    bana, ca = get_policy("bana"), get_policy("cache_aware")
    queued = {f"p{i}": 0 for i in range(4)}
    picks = {"bana": [], "cache_aware": []}
    for name, pol in (("bana", bana), ("cache_aware", ca)):
        q = dict.fromkeys(queued, 0)
        for k in range(20):
            loads = [
                P(i, queued_prefill_tokens=q[f"p{i}"], queued_requests=q[f"p{i}"] // 4096)
                for i in range(4)
            ]
            w = pol.pick_prefill(req(hashes=hashes, rid=str(k)), loads)
            q[w] += 4096
            picks[name].append(w)
    assert len(set(picks["bana"])) == 4
    assert len(set(picks["cache_aware"][1:])) == 1  # every later request follows the prefix


def test_round_robin_cycles_per_tier():
    pol = get_policy("round_robin")
    loads = [P(0), P(1), P(2), D(0), D(1)]
    assert [pol.pick_prefill(req(), loads) for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    assert [pol.pick_decode(req(), loads) for _ in range(3)] == ["d0", "d1", "d0"]


def test_power_of_two_is_seeded_and_picks_the_lighter_of_two():
    loads = [P(i, queued_requests=i) for i in range(8)]
    a = [get_policy("power_of_two", seed=3).pick_prefill(req(), loads) for _ in range(5)]
    b = [get_policy("power_of_two", seed=3).pick_prefill(req(), loads) for _ in range(5)]
    assert a == b
    two = [P(0, queued_requests=5), P(1, queued_requests=1)]
    assert get_policy("power_of_two").pick_prefill(req(), two) == "p1"


def _ca_with_p0_holding(h):
    pol = get_policy("cache_aware", config=CacheAwareConfig())
    pol.trees[WorkerId("p0")] = t = PagePrefixTree()
    t.insert(h)
    return pol


def test_cache_aware_thresholds():
    h = tuple(range(10))
    # Balanced: longest match wins (ratio 1.0 > 0.5).
    pol = _ca_with_p0_holding(h)
    assert pol.pick_prefill(req(hashes=h), [P(0, running_requests=3), P(1)]) == "p0"
    # Imbalanced (40 - 2 > 32 and 40 > 1.5 * 2): least loaded wins despite the match.
    pol = _ca_with_p0_holding(h)
    assert (
        pol.pick_prefill(req(hashes=h), [P(0, running_requests=40), P(1, running_requests=2)])
        == "p1"
    )
    # Not imbalanced by the absolute threshold (30 - 2 <= 32): still cache affinity.
    pol = _ca_with_p0_holding(h)
    assert (
        pol.pick_prefill(req(hashes=h), [P(0, running_requests=30), P(1, running_requests=2)])
        == "p0"
    )
    # Low match ratio (3 of 10 pages): the smallest tree (p1, empty) wins.
    low = tuple(range(3)) + tuple(range(100, 107))
    assert pol.pick_prefill(req(hashes=low), [P(0), P(1)]) == "p1"


def test_global_cache_aware_trades_queue_against_cache():
    pf = lambda new, cached: new / 10_000  # noqa: E731  seconds
    tr = lambda tokens: tokens / 100_000  # noqa: E731
    hashes = tuple(range(16))  # 8192 tokens
    oracle = Oracle(global_pages=16, local={WorkerId("p0"): 16})
    pol = get_policy("global_cache_aware", oracle=oracle, prefill_time=pf, transfer_time=tr)
    # Equal queues: the worker holding the prefix locally (no transfer) wins.
    assert pol.pick_prefill(req(8192, hashes), [P(0), P(1)]) == "p0"
    # p0 deeply queued: p1 fetches the prefix from the global store instead.
    assert pol.pick_prefill(req(8192, hashes), [P(0, queued_prefill_tokens=50_000), P(1)]) == "p1"
    # Local-only variant does not count the global copy, but still picks by cost.
    loc = get_policy("local_cache_aware", oracle=oracle, prefill_time=pf, transfer_time=tr)
    assert loc.pick_prefill(req(8192, hashes), [P(0, queued_prefill_tokens=5_000), P(1)]) == "p0"


def test_decode_prefers_free_kv_then_less_work():
    pol = get_policy("bana")
    loads = [
        D(0, kv_used_tokens=90_000),
        D(1, kv_used_tokens=20_000, running_requests=9),
        D(2, kv_used_tokens=20_000, running_requests=2),
    ]
    assert pol.pick_decode(req(), loads) == "d2"


def test_colocated_workers_serve_both_tiers_and_missing_tier_errors():
    pol = get_policy("bana")
    c = WorkerLoad(WorkerId("c0"), Tier.COLOCATED, kv_total_tokens=10_000)
    assert pol.pick_prefill(req(), [c]) == "c0" and pol.pick_decode(req(), [c]) == "c0"
    with pytest.raises(RoutingError, match="no decode worker"):
        pol.pick_decode(req(), [P(0)])


def test_prefix_tree_match_insert_evict():
    t = PagePrefixTree(capacity=5)
    t.insert((1, 2, 3))
    assert t.match((1, 2, 9)) == 2
    t.insert((1, 2, 4, 5))  # 5 pages: 1,2,3,4,5
    t.insert((7, 8))  # evicts LRU leaves: 3 first, then 5
    assert t.size == 5 and 3 not in t and 7 in t and t.match((1, 2, 4)) == 3


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=30),
    st.integers(1, 12),
)
def test_prefix_tree_closure_and_capacity(chains, cap):
    t = PagePrefixTree(capacity=cap)
    for c in chains:
        # Chained hashes: a page's id encodes its whole prefix.
        hashes = tuple(tuple(c[: i + 1]) for i in range(len(c)))
        t.insert(hashes)
        assert t.size <= max(cap, len(hashes))
        for h in list(t._parent):  # prefix closure
            p = t._parent[h]
            assert p is None or p in t._parent
