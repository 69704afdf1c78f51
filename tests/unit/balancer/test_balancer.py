"""Unit tests of the pure balancer on constructed snapshots."""

from __future__ import annotations

import pytest

from bana_sglang.balancer.actions import (
    BalancerConfig,
    BalancerError,
    KVBlockMigration,
    LayerMigration,
    MigrationCostModel,
    ModelShape,
    RequestMigration,
    RunningRequest,
)
from bana_sglang.balancer.policy import BALANCERS, get_balancer, utilisation
from bana_sglang.types import RequestId, Tier, WorkerId, WorkerLoad, split_speeds

GB = 1_000_000_000
SHAPE = ModelShape(
    num_layers=32,
    layer_weight_bytes=500_000_000,
    kv_bytes_per_token=131_072,
    page_size=512,
    prefill_tokens_per_s=20_000,
)
COST = MigrationCostModel(bandwidth_bytes_per_s=25 * GB, fixed_s=0.005)
CFG = BalancerConfig(consecutive=3, cooldown_s=20.0, min_interval_s=2.0, budget_s=2.0)


def W(name, tier, *, busy=0.0, queued=0, kv_used=0, kv_total=400_000, running=0, step=0.0):
    return WorkerLoad(
        WorkerId(name),
        tier,
        running_requests=running,
        queued_prefill_tokens=queued,
        kv_used_tokens=kv_used,
        kv_total_tokens=kv_total,
        busy_fraction=busy,
        decode_step_s=step,
    )


def bana(**cfg):
    return get_balancer(
        "bana", shape=SHAPE, cost=COST, config=BalancerConfig(**{**CFG.__dict__, **cfg})
    )


def prefill_hot(queued=20_000):
    """p0 busy with a 1 s backlog: below ``sustained_backlog_s``, so the streak applies."""
    return [
        W("p0", Tier.PREFILL, busy=1.0, queued=queued),
        W("p1", Tier.PREFILL, busy=0.9),
        W("d0", Tier.DECODE, busy=0.1, kv_used=40_000),
        W("d1", Tier.DECODE, busy=0.2, kv_used=80_000),
    ]


def plan_after(b, loads, k, t0=0.0, **kw):
    plans = [b.plan(loads, t0 + i, **kw) for i in range(k)]
    return plans


def test_registry():
    assert set(BALANCERS) == {"bana", "none"}
    with pytest.raises(BalancerError, match="valid: bana, none"):
        get_balancer("greedy")
    with pytest.raises(BalancerError):
        BalancerConfig(release_threshold=2.0, imbalance_threshold=1.5)


def test_cost_model():
    assert COST.seconds(25 * GB) == pytest.approx(1.005)
    assert COST.max_bytes(1.005) == pytest.approx(25 * GB, rel=1e-9)


def test_imbalanced_prefill_moves_layers_to_the_coolest_decode_worker():
    b = bana()
    plans = plan_after(b, prefill_hot(), 3)
    assert all(p.empty for p in plans[:2])  # hysteresis: needs 3 observations
    p = plans[2]
    assert len(p.actions) == 1
    a = p.actions[0]
    assert isinstance(a, LayerMigration) and a.src == "p0" and a.dst == "d0"
    assert 1 <= a.num_layers <= SHAPE.num_layers * CFG.max_layer_fraction
    assert a.layers[1] == SHAPE.num_layers and a.bytes == a.num_layers * SHAPE.layer_weight_bytes
    assert p.seconds <= CFG.budget_s and p.peak_after < p.peak_before


def test_budget_limits_the_number_of_layers():
    tight = bana(budget_s=0.005 + 2 * SHAPE.layer_weight_bytes / COST.bandwidth_bytes_per_s)
    p = plan_after(tight, prefill_hot(), 3)[2]
    assert p.actions[0].num_layers == 2
    none_fit = bana(budget_s=0.01)
    assert plan_after(none_fit, prefill_hot(), 3)[2].empty


def memory_bound():
    return [
        W("d0", Tier.DECODE, busy=0.3, kv_used=390_000),
        W("d1", Tier.DECODE, busy=0.3, kv_used=100_000),
        W("p0", Tier.PREFILL, busy=0.5),
    ]


def test_memory_bound_decode_moves_kv_blocks_to_a_decode_peer():
    p = plan_after(bana(), memory_bound(), 3)[2]
    a = p.actions[0]
    assert isinstance(a, KVBlockMigration) and (a.src, a.dst) == ("d0", "d1")
    moved = a.pages * SHAPE.page_size
    assert 0 < moved <= 145_000 + SHAPE.page_size  # about half the usage gap
    assert a.bytes == moved * SHAPE.kv_bytes_per_token


def test_memory_bound_decode_with_running_requests_migrates_one():
    running = {
        WorkerId("d0"): [
            RunningRequest(RequestId("a"), 20_000, 100),
            RunningRequest(RequestId("b"), 60_000, 500),
            RunningRequest(RequestId("c"), 400_000, 5),
        ]
    }
    p = plan_after(bana(), memory_bound(), 3, running=running)[2]
    a = p.actions[0]
    assert isinstance(a, RequestMigration) and a.request == "b" and a.dst == "d1"
    assert a.bytes == 60_000 * SHAPE.kv_bytes_per_token


def test_balanced_cluster_never_acts():
    loads = [W(f"p{i}", Tier.PREFILL, busy=0.7) for i in range(4)] + [
        W(f"d{i}", Tier.DECODE, busy=0.6, kv_used=250_000) for i in range(4)
    ]
    b = bana()
    assert all(b.plan(loads, float(t)).empty for t in range(50))
    idle = [W("p0", Tier.PREFILL, busy=0.3), W("d0", Tier.DECODE)]  # imbalanced but cold
    assert all(b.plan(idle, float(t)).empty for t in range(10))


def test_none_balancer_is_static():
    b = get_balancer("none")
    assert all(b.plan(prefill_hot(), float(t)).empty for t in range(10))


def test_oscillation_guard():
    """Flip the hot spot every observation: the balancer may act once, then the
    cool-down, the streak reset and the no-reversal rule keep it quiet."""
    b = bana()
    a_hot = [W("p0", Tier.PREFILL, busy=1.0, queued=200_000), W("p1", Tier.PREFILL, busy=0.05)]
    b_hot = [W("p0", Tier.PREFILL, busy=0.05), W("p1", Tier.PREFILL, busy=1.0, queued=200_000)]
    acts = []
    for t in range(60):
        p = b.plan(a_hot if (t // 4) % 2 == 0 else b_hot, float(t))
        acts += [(t, a.src, a.dst) for a in p.actions]
    assert acts, "a sustained imbalance must be acted on"
    times = [t for t, *_ in acts]
    assert all(t2 - t1 >= CFG.cooldown_s for t1, t2 in zip(times, times[1:]))
    for (t1, s1, d1), (t2, s2, d2) in zip(acts, acts[1:]):
        if (s2, d2) == (d1, s1):
            assert t2 - t1 >= 2 * CFG.cooldown_s


def test_rate_limit_and_streak_reset():
    b = bana(cooldown_s=0.5, min_interval_s=10.0)
    loads = prefill_hot()
    acted = [t for t in range(30) if not b.plan(loads, float(t)).empty]
    assert acted and all(t2 - t1 >= 10 for t1, t2 in zip(acted, acted[1:]))
    # Below the release threshold the streak resets: 2 hot, 1 calm, 2 hot -> no action.
    b2 = bana()
    calm = [W("p0", Tier.PREFILL, busy=0.7), W("d0", Tier.DECODE, busy=0.7)]
    seq = [prefill_hot(), prefill_hot(), calm, prefill_hot(), prefill_hot()]
    assert all(b2.plan(ld, float(t)).empty for t, ld in enumerate(seq))


def test_a_long_backlog_skips_the_streak_but_not_the_guards():
    """Queued prompt tokens that keep a worker busy for sustained_backlog_s are no
    transient peak: the first observation acts; a shorter backlog waits for the streak."""
    b = bana()
    long = prefill_hot(queued=int(CFG.sustained_backlog_s * SHAPE.prefill_tokens_per_s))
    first = b.plan(long, 0.0)
    assert len(first.actions) == 1 and first.reason.startswith("prefill backlog")
    assert isinstance(first.actions[0], LayerMigration) and first.actions[0].src == "p0"
    # the cool-down still holds both workers of that pair
    later = [b.plan(long, t) for t in (1.0, 2.0, 3.0, 4.0)]
    assert all(a.src != "p0" and a.dst != "d0" for p in later for a in p.actions)
    short = bana()
    below = prefill_hot(queued=int(0.9 * CFG.sustained_backlog_s * SHAPE.prefill_tokens_per_s))
    plans = plan_after(short, below, 3)
    assert plans[0].empty and plans[1].empty and plans[2].reason == "rebalance"
    # a backlog on a cold cluster (every worker below min_peak) is no reason either
    cold = [W("p0", Tier.PREFILL, busy=0.0, queued=1_000), W("d0", Tier.DECODE)]
    assert bana(sustained_backlog_s=0.01).plan(cold, 0.0).empty


def test_split_speeds_and_the_utilisation_they_give():
    """Half the layers away: the donor computes half of every chunk (twice the speed);
    the peer gives the guest layers the donor's rate of work on them, capped."""
    assert split_speeds(32, 0, 1.0) == (1.0, 1.0)
    assert split_speeds(32, 16, 0.5) == pytest.approx((2.0, 0.5))
    assert split_speeds(32, 8, 0.9) == pytest.approx((32 / 24, 1 - 0.9 / 3))
    assert split_speeds(32, 16, 1.0)[1] == pytest.approx(0.2)  # the cap: the peer keeps 20%
    assert split_speeds(32, 8, 0.0)[1] == pytest.approx(1 - 0.2 / 3)  # counted at least 20% busy
    for bad in (-1, 32, 40):
        with pytest.raises(ValueError, match="moved"):
            split_speeds(32, bad, 0.5)
    queued = int(CFG.queue_horizon_s * SHAPE.prefill_tokens_per_s)  # one horizon of work
    alone = W("p0", Tier.PREFILL, busy=0.5, queued=queued)
    fast = WorkerLoad(
        WorkerId("p0"),
        Tier.PREFILL,
        queued_prefill_tokens=queued,
        busy_fraction=0.5,
        prefill_speed=2.0,
    )
    assert utilisation(alone, SHAPE, CFG) == pytest.approx(1.5)
    assert utilisation(fast, SHAPE, CFG) == pytest.approx(1.0)


def test_engaged_workers_are_never_picked():
    """A worker still in a migration takes part in no other (an agent runs one at a time)."""
    p = plan_after(bana(), prefill_hot(), 3, engaged={WorkerId("d0")})[2]
    assert [(a.src, a.dst) for a in p.actions] == [("p0", "d1")]
    for engaged in ({"p0"}, {"d0", "d1"}, {"p0", "d0"}):
        p = plan_after(bana(), prefill_hot(), 3, engaged={WorkerId(w) for w in engaged})[2]
        assert not any({a.src, a.dst} & engaged for a in p.actions), (engaged, p)
    assert (
        plan_after(bana(), prefill_hot(), 3, engaged={WorkerId("d0"), WorkerId("d1")})[2]
        .actions[0]
        .dst
        == "p1"
    )


def test_one_action_per_eight_workers_in_one_plan():
    hot = (
        [W(f"p{i}", Tier.PREFILL, busy=1.0, queued=20_000) for i in range(3)]
        + [W(f"p{i}", Tier.PREFILL, busy=0.2) for i in range(3, 8)]
        + [W(f"d{i}", Tier.DECODE, busy=0.1, kv_used=40_000) for i in range(8)]
    )
    p = plan_after(bana(), hot, 3)[2]
    assert len(p.actions) == 2  # 16 workers: two actions
    pairs = [(a.src, a.dst) for a in p.actions]
    assert len({w for pair in pairs for w in pair}) == 4  # disjoint pairs
    assert all(src in ("p0", "p1", "p2") for src, _ in pairs)
    assert len(plan_after(bana(max_actions=1), hot, 3)[2].actions) == 1
    assert len(plan_after(bana(max_actions=5), hot, 3)[2].actions) == 3  # only three are hot
    with pytest.raises(BalancerError):
        BalancerConfig(max_actions=-1)


def test_layers_equalise_against_the_peers_compute_and_its_memory_takes_the_weights():
    """A decode peer with much KV in use but little compute busy can take about half of a
    hot donor's layers (its compute is what the layers use); the predicted peak counts
    the weights in its KV memory."""
    loads = [
        W("p0", Tier.PREFILL, busy=1.0, queued=20_000),
        W("p1", Tier.PREFILL, busy=0.9),
        W("d0", Tier.DECODE, busy=0.1, kv_used=200_000),
    ]
    a = plan_after(bana(), loads, 3)[2].actions[0]
    assert isinstance(a, LayerMigration) and a.dst == "d0"
    # U(p0) = 1.2: equalising against d0's compute (0.1) gives phi = 0.46 (14 layers);
    # against its U (KV usage 0.5) it would be 0.29 (9 layers)
    assert a.num_layers == 14
    b = bana()
    pred = b._predict(a, {w.worker_id: w for w in loads}, {"p0": 1.2, "d0": 0.5})
    assert pred["d0"] == pytest.approx(max(0.1 + 14 / 32 * 1.2, 0.5 + a.bytes / 131_072 / 400_000))
    full = [*loads[:2], W("d0", Tier.DECODE, busy=0.1, kv_used=395_000)]  # no room for the weights
    assert plan_after(bana(), full, 3)[2].empty


def test_tpot_guard_keeps_a_decode_peers_step_within_the_slo():
    """With a TPOT SLO, a decode peer takes only the layers whose time share keeps its
    step within tpot_headroom x SLO; a peer already there takes none (the next one does)."""
    hot = [W("p0", Tier.PREFILL, busy=1.0, queued=20_000), W("p1", Tier.PREFILL, busy=0.9)]
    a = plan_after(bana(tpot_slo_s=0.1), [*hot, W("d0", Tier.DECODE, busy=0.1, step=0.01)], 3)[
        2
    ].actions[0]
    assert a.num_layers == 14  # 0.01 s step: share <= 0.875, phi <= 0.47: the unguarded 14 layers
    a = plan_after(bana(tpot_slo_s=0.1), [*hot, W("d0", Tier.DECODE, busy=0.1, step=0.02)], 3)[
        2
    ].actions[0]
    assert a.num_layers == 13  # 0.02 s: share <= 0.75, phi <= 0.43
    capped = bana(tpot_slo_s=0.1)
    a = plan_after(capped, [*hot, W("d0", Tier.DECODE, busy=0.1, step=0.06)], 3)[2].actions[0]
    # share <= 1 - 0.06 / 0.08 = 0.25 -> phi <= 0.25 / 1.25 = 0.2 -> 6 layers
    assert a.num_layers == 6
    phi = a.num_layers / 32
    assert 0.06 / (1 - phi / (1 - phi) * 1.0) <= 0.08 + 1e-9
    slow = [
        *hot,
        W("d0", Tier.DECODE, busy=0.1, step=0.09),
        W("d1", Tier.DECODE, busy=0.3, step=0.03),
    ]
    p = plan_after(bana(tpot_slo_s=0.1), slow, 3)[2]
    assert [x.dst for x in p.actions] == ["d1"]
    alone = plan_after(bana(tpot_slo_s=0.1), slow[:3], 3)[2]
    assert all(x.dst != "d0" for x in alone.actions)  # a prefill peer, or nothing
    assert [x.dst for x in plan_after(bana(tpot_slo_s=0), slow[:3], 3)[2].actions] == [
        "d0"
    ]  # 0: no guard
    with pytest.raises(BalancerError):
        BalancerConfig(tpot_slo_s=-1)
    with pytest.raises(BalancerError):
        BalancerConfig(tpot_headroom=0)


def test_a_decode_host_short_of_memory_gets_its_guest_layers_back():
    """memory_recalls names the hosts whose requests wait for memory they do not have
    (KV usage with the waiting requests past recall_kv_usage); never a prefill host, a
    worker that hosts nothing, or a host merely full; 0 turns it off."""

    def D(name, used, waiting, tier=Tier.DECODE, inflight=0):
        return WorkerLoad(
            WorkerId(name),
            tier,
            kv_used_tokens=used,
            kv_waiting_tokens=waiting,
            inflight_tokens=inflight,
            kv_total_tokens=100_000,
        )

    loads = [
        D("d0", 99_000, 5_000),  # 1.04: its waiting requests need memory it has not got
        D("d1", 100_000, 0),  # full, nothing waiting
        D("d2", 60_000, 5_000),  # requests waiting for a batch slot, memory for them
        D("d3", 99_000, 5_000),  # pressed, but hosts nothing
        D("p0", 99_000, 5_000, Tier.PREFILL),
        # live, the router's in-flight count includes resident requests: not a wait
        D("d4", 70_000, 0, inflight=70_000),
    ]
    b = bana()
    assert b.memory_recalls(loads, {"d0", "d1", "d2", "p0", "d4"}) == ["d0"]
    assert b.memory_recalls(loads, set()) == []
    assert bana(recall_kv_usage=1.1).memory_recalls(loads, {"d0"}) == []  # 1.04 is below it
    assert bana(recall_kv_usage=0.9).memory_recalls(loads, {"d0", "d2"}) == ["d0"]
    assert bana(recall_kv_usage=0).memory_recalls(loads, {"d0"}) == []
    assert get_balancer("none").memory_recalls(loads, {"d0"}) == []
    with pytest.raises(BalancerError, match="recall_kv_usage"):
        BalancerConfig(recall_kv_usage=-0.5)
