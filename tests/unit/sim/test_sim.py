"""Simulator tests: same policy objects as the live system, determinism,
conservation of requests, KV capacity, profiles, workloads, CLI. Small slices."""

from __future__ import annotations

import collections
import json

import pytest

import bana_sglang.balancer.policy as balancer_mod
import bana_sglang.router.policy as policy_mod
from bana_sglang.sim import config as sim_config
from bana_sglang.sim import engine as sim_engine
from bana_sglang.sim import workloads
from bana_sglang.sim.__main__ import main as sim_main
from bana_sglang.sim.config import SYSTEMS, SimConfig, SimConfigError, system_config
from bana_sglang.sim.engine import Simulation, simulate
from bana_sglang.sim.profiles import PROFILE_DIR, ProfileError, list_profiles, load_profile

ANCHOR = SimConfig(profile="a100_llama70b_tp8", num_workers=8)


@pytest.fixture(scope="module")
def trace_slice():
    return workloads.mooncake(limit=400, time_scale=2.0)


def test_sim_uses_the_live_policy_registries_by_identity():
    assert sim_engine.get_policy is policy_mod.get_policy
    assert sim_engine.get_balancer is balancer_mod.get_balancer
    assert sim_config.POLICIES is policy_mod.POLICIES
    assert sim_config.BALANCERS is balancer_mod.BALANCERS
    sim = Simulation(system_config("bana", ANCHOR), [])
    assert type(sim.policy) is policy_mod.POLICIES["bana"]
    assert type(sim.balancer) is balancer_mod.BALANCERS["bana"]


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_every_request_finishes_exactly_once(system, trace_slice):
    sim = Simulation(system_config(system, ANCHOR), trace_slice, system=system, check=True)
    res = sim.run()
    assert sorted(r.rid for r in sim.records) == sorted(r.rid for r in trace_slice)
    assert res.finished == len(trace_slice) and not sim.rejected
    for r in sim.records:
        assert r.arrival <= r.first_token <= r.finish
        assert 0 <= r.hbm_hit_tokens + r.store_hit_tokens < r.input_len
    for w in sim.workers:  # everything released at the end
        assert w.kv_reserved == 0 and not w.batch and not w.queue and not w.pending


@pytest.mark.parametrize("system", ["global_cache_aware", "load_only", "colocated", "bana"])
def test_the_no_wait_floor_bounds_every_ttft_without_a_balancer(system, trace_slice):
    """A request's floor is its TTFT alone on an idle worker with the same hits; only
    layer migration (the ``bana`` balancer) can beat it, by pipelining a long prompt's
    chunks across two workers."""
    fast = workloads.mooncake(limit=400, time_scale=6.0)  # queues build: TTFT > floor for many
    sim = Simulation(system_config(system, ANCHOR), fast, system=system)
    res = sim.run()
    p = sim.p
    for r in sim.records:
        cached = r.hbm_hit_tokens + r.store_hit_tokens
        assert r.floor_s >= p.lone_prefill_seconds(r.input_len - cached, cached) > 0
    below = [r for r in sim.records if r.ttft < r.floor_s - 1e-9]
    if system == "bana":
        assert below, "layer migration never split a prompt below its floor"
        assert res.migrations > 0
    else:
        assert not below, below[:3]
    assert res.ttft_floor_mean == pytest.approx(
        sum(r.floor_s for r in sim.records) / len(sim.records)
    )
    assert res.ttft_mean > res.ttft_floor_mean or system == "bana"


def test_split_workers_report_their_prefill_speed_to_the_policies():
    """While layers are split, the donor's load says it drains its queue 1 / (1 - phi)
    times faster and the peer's says 1 - its share: the same ``split_speeds`` the
    simulator computes their prefill time with, so routing and balancing see them."""
    fast = workloads.mooncake(limit=400, time_scale=6.0)
    sim = Simulation(system_config("bana", ANCHOR), fast)
    seen = {"donor": 0, "peer": 0}
    plan = sim.balancer.plan

    def spy(loads, now, *a, **kw):
        by_id = {w.worker_id: w for w in loads}
        for w in sim.workers:
            speed = by_id[w.wid].prefill_speed
            if w.offload_phi > 0:
                assert speed == pytest.approx(1 / (1 - w.offload_phi)) and speed > 1
                seen["donor"] += 1
            elif w.lent_share > 0:
                assert speed == pytest.approx(1 - w.lent_share) and speed < 1
                seen["peer"] += 1
            else:
                assert speed == pytest.approx(1.0)
        return plan(loads, now, *a, **kw)

    sim.balancer.plan = spy
    sim.run()
    assert seen["donor"] > 0 and seen["peer"] > 0, seen


def test_lone_prefill_is_chunked_like_the_simulator():
    p = load_profile("h100_llama3_8b")
    c = p.max_prefill_tokens
    assert p.lone_prefill_seconds(c) == pytest.approx(p.prefill_seconds(c, 0))
    two = p.prefill_seconds(c, 0) + p.prefill_seconds(c // 2, c)
    assert p.lone_prefill_seconds(c + c // 2) == pytest.approx(two)
    assert p.lone_prefill_seconds(c // 2, 1000) == pytest.approx(p.prefill_seconds(c // 2, 1000))


def test_deterministic_with_a_seed(trace_slice):
    cfg = system_config("bana", ANCHOR)
    a = Simulation(cfg, trace_slice)
    b = Simulation(cfg, trace_slice)
    ra, rb = a.run(), b.run()
    assert a.records == b.records
    assert ra.row() | {"wall_s": 0} == rb.row() | {"wall_s": 0}


def test_global_store_raises_hits_and_migration_runs_under_pressure(trace_slice):
    fast = workloads.mooncake(limit=400, time_scale=6.0)
    loc = simulate(system_config("load_only", ANCHOR), fast)
    glob = simulate(system_config("bana_no_migration", ANCHOR), fast)
    assert glob.hit_rate > loc.hit_rate
    sim = Simulation(system_config("bana", ANCHOR), fast, check=True)
    res = sim.run()
    assert res.migrations > 0 and res.finished == len(fast)


def test_memory_pressure_uses_kv_and_request_migration(tmp_path):
    # A profile whose decode KV pool is small, so decode workers become memory-bound.
    doc = json.loads((PROFILE_DIR / "h100_llama3_8b.json").read_text())
    doc["hardware"]["mem_bytes"]["value"] = 20e9  # ~ 15K-token KV pool
    doc["assumptions"]["max_prefill_tokens"]["value"] = 4096
    p = tmp_path / "tiny_kv.json"
    p.write_text(json.dumps(doc))
    prof = load_profile(p)
    assert 8_000 < prof.kv_capacity_tokens < 20_000
    reqs = workloads.mixed(n=300, rate=30.0, seed=1)
    reqs = [r for r in reqs if r.input_len + r.output_len < prof.kv_capacity_tokens // 2]
    cfg = system_config("bana", SimConfig(profile=str(p), num_workers=6, prefill_fraction=0.34))
    sim = Simulation(cfg, reqs, check=True)
    acts = []
    orig = sim._start_action
    sim._start_action = lambda a: (acts.append(type(a).__name__), orig(a))[1]
    res = sim.run()
    assert res.finished == len(reqs)
    assert {"KVBlockMigration", "RequestMigration"} & set(acts)


def test_colocated_and_generated_workloads_finish():
    base = SimConfig(profile="h100_llama3_8b", num_workers=4)
    for name, kw in (
        ("bursty", dict(n=150)),
        ("mixed", dict(n=150)),
        ("shared_prefix", dict(n=150)),
        ("long_context", dict(n=20, rate=0.5)),
    ):
        reqs = workloads.get_workload(name, **kw)
        for system in ("colocated", "bana"):
            res = simulate(system_config(system, base), reqs, system=system)
            assert res.finished == len(reqs), (name, system)


def test_requests_too_big_for_any_worker_are_rejected_not_lost():
    big = workloads.long_context(n=5, min_len=100_000, max_len=120_000, rate=1.0)
    small = workloads.bursty(n=20, mean_in=500, mean_out=20)
    reqs = sorted(
        big
        + [
            workloads.SimRequest(r.rid + 100, r.arrival, r.input_len, r.output_len, r.hashes)
            for r in small
        ],
        key=lambda r: r.arrival,
    )
    sim = Simulation(SimConfig(profile="cpu_small", num_workers=2), reqs)
    res = sim.run()
    assert sorted(sim.rejected) == [0, 1, 2, 3, 4]
    assert res.rejected == 5 and res.finished == 20 and res.num_requests == 25


def test_workload_generators_are_deterministic_and_valid():
    for name in ("bursty", "mixed", "shared_prefix", "long_context"):
        a = workloads.get_workload(name, n=50, seed=7)
        assert a == workloads.get_workload(name, n=50, seed=7)
        assert all(r.input_len >= 1 and r.output_len >= 1 for r in a)
        assert all(len(r.hashes) == -(-r.input_len // workloads.PAGE) for r in a)
        assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    sp = workloads.shared_prefix(n=50, num_prefixes=2)
    assert len({r.hashes[0] for r in sp}) <= 2
    az = workloads.azure(limit=100)
    assert len(az) == 100 and az[0].arrival == 0.0
    with pytest.raises(workloads.WorkloadError, match="valid"):
        workloads.get_workload("nope")


def test_profiles_load_with_sources():
    names = list_profiles()
    assert {
        "cpu_small",
        "h100_llama3_8b",
        "h200_llama3_8b",
        "a100_llama3_8b",
        "a100_llama70b_tp8",
        "h100_llama70b_tp8",
    } <= set(names)
    for n in names:
        p = load_profile(n)
        assert p.sources and p.assumptions
        assert p.prefill_seconds(4096, 0) > p.prefill_seconds(1024, 0) > 0
        assert p.decode_step_seconds(64, 64 * 4096) >= p.decode_step_seconds(1, 4096)
    h100, h200 = load_profile("h100_llama3_8b"), load_profile("h200_llama3_8b")
    assert h200.decode_step_seconds(32, 32 * 8192) < h100.decode_step_seconds(32, 32 * 8192)
    with pytest.raises(ProfileError, match="known"):
        load_profile("no_such_profile")


def test_config_validation():
    with pytest.raises(SimConfigError, match="valid"):
        SimConfig(routing="nope")
    with pytest.raises(SimConfigError):
        SimConfig(colocated=True, balancer="bana")
    assert SimConfig(num_workers=16, prefill_fraction=0.5).num_prefill == 8
    for bad in (-0.1, 1.0):
        with pytest.raises(SimConfigError, match="decode_overlap"):
            SimConfig(decode_overlap=bad)


def test_decode_overlap_only_spares_the_decode_peers_steps(trace_slice):
    """Hiding part of a decode peer's guest-layer time under its own steps changes the
    decode side only: with no layer migration (no balancer) nothing moves; with the
    balancer the decode peers' steps, hence TPOT, get faster."""
    fast = workloads.mooncake(limit=400, time_scale=6.0)
    static = [
        simulate(system_config("bana_no_migration", ANCHOR, decode_overlap=o), fast)
        for o in (0.0, 0.9)
    ]
    assert static[0].row() | {"wall_s": 0} == static[1].row() | {"wall_s": 0}
    strict, hidden = (
        simulate(system_config("bana", ANCHOR, decode_overlap=o), fast) for o in (0.0, 0.9)
    )
    assert strict.migrations > 0 and hidden.tpot_mean < strict.tpot_mean


def test_cli_run(capsys):
    assert (
        sim_main(
            [
                "run",
                "--system",
                "bana",
                "--profile",
                "a100_llama70b_tp8",
                "--workers",
                "4",
                "--limit",
                "60",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["finished"] == 60 and out["system"] == "bana"


def test_profile_round_trip_for_calibration(tmp_path):
    from bana_sglang.sim.profiles import save_profile

    p = load_profile("cpu_small")
    q = load_profile(save_profile(p, tmp_path / "calibrated.json", {"mfu": "measured: test"}))
    assert q.kv_capacity_tokens == p.kv_capacity_tokens
    assert q.prefill_seconds(1000, 0) == pytest.approx(p.prefill_seconds(1000, 0))
    assert "mfu: measured: test" in q.assumptions


def test_workers_sharing_a_host_slow_each_other_down_while_both_compute(tmp_path):
    """Processor sharing on one host's cores: a prefill that runs while the decode
    worker decodes takes the profile's contention factor longer (the live CPU
    cluster's case: both workers on the same 2 cores); the decode steps it
    overlaps are slower too; on separate hosts nothing changes."""
    from dataclasses import replace

    from bana_sglang.sim.profiles import save_profile
    from bana_sglang.sim.workloads import SimRequest

    prof = save_profile(
        replace(load_profile("cpu_small"), host_contention_prefill=2.0, host_contention_decode=1.5),
        tmp_path / "shared.json",
    )
    p = load_profile(prof)
    alone = p.prefill_seconds(2000, 0)
    # a short prompt that decodes for a long time, then a long prompt during its decode
    reqs = [SimRequest(0, 0.0, 64, 3000, (101,)), SimRequest(1, 2.0, 2000, 2, (202,))]

    def run(shared: bool):
        cfg = SimConfig(
            profile=str(prof), num_workers=2, store="global", page_tokens=64, shared_host=shared
        )
        sim = Simulation(cfg, reqs, check=True)
        sim.run()
        return {r.rid: r for r in sim.records}

    apart, shared = run(False), run(True)
    assert apart[1].ttft == pytest.approx(alone, rel=0.02)
    assert shared[1].ttft == pytest.approx(2.0 * alone, rel=0.02)  # the decode ran throughout
    assert shared[1].first_token < shared[0].finish
    # request 0 decoded 1/1.5 of its steps during the overlap; the steps it lost run at
    # the end, at a larger KV (a little slower): about a third of the overlap, not less
    overlap = shared[1].first_token - 2.0
    lost = shared[0].finish - apart[0].finish
    assert overlap / 3 <= lost <= 1.1 * overlap / 3
    assert (
        Simulation(SimConfig(profile=str(prof), num_workers=2, shared_host=True), []).run().finished
        == 0
    )


def test_throughput_is_the_highest_rate_below_the_first_miss_and_bisection_closes_in():
    from bana_sglang.sim.grid import SLO_GOAL, max_rate, next_probe

    ok, miss = SLO_GOAL + 0.05, SLO_GOAL - 0.3
    assert max_rate({0.75: ok, 1.0: ok, 1.25: miss, 1.5: ok}) == 1.0  # not past the first miss
    assert max_rate({0.75: miss, 1.0: ok}) is None
    assert next_probe({1.0: ok, 1.25: miss, 1.5: miss}) == 1.125
    assert next_probe({1.0: ok, 2.0: ok}) is None and next_probe({1.0: miss}) is None
    # bisection on a system whose attainment falls below the goal at 1.3: four halvings of
    # the 0.25 step land within 1/64 of it
    pts = {m: (ok if m < 1.3 else miss) for m in (0.75, 1.0, 1.25, 1.5, 2.0)}
    for _ in range(4):
        m = next_probe(pts)
        pts[m] = ok if m < 1.3 else miss
    assert 1.3 - 0.25 / 16 <= max_rate(pts) < 1.3


def test_decode_loads_count_requests_waiting_for_memory_as_in_flight(tmp_path):
    """A request waiting on a decode worker for KV memory is in-flight load there (the
    live router counts every routed, unfinished request's tokens), so the decode pick
    and the balancer see it in the worker's KV usage."""
    from bana_sglang.sim.workloads import SimRequest

    doc = json.loads((PROFILE_DIR / "h100_llama3_8b.json").read_text())
    doc["hardware"]["mem_bytes"]["value"] = 20e9  # ~ 15K-token KV pool per worker
    p = tmp_path / "tiny_kv.json"
    p.write_text(json.dumps(doc))
    cap = load_profile(p).kv_capacity_tokens
    big = cap // 2 + 100  # two never fit one decode worker together
    reqs = [SimRequest(i, 0.01 * i, big, 400, (1000 + i,)) for i in range(6)]
    cfg = SimConfig(profile=str(p), num_workers=4, store="global", page_tokens=512)
    sim = Simulation(cfg, reqs, check=True)
    seen = []
    orig = sim._admit

    def admit(d):
        orig(d)
        load = d.load(sim.now)
        assert load.inflight_tokens == sum(j.kv_need for j in d.pending)
        seen.append(load.inflight_tokens)

    sim._admit = admit
    res = sim.run()
    assert res.finished == len(reqs) and max(seen) > 0
    assert collections.Counter(r.decode_worker for r in sim.records) == {"d0": 3, "d1": 3}


def test_a_kv_block_lease_costs_its_host_the_page_reads_and_its_lender_a_hop_per_layer():
    """KV pages lent to a host: the host reads them on every lender step (its steps
    slow by 1 / (1 - share)); each of the lender's layers waits one round trip; both
    factors are undone when the pages come back."""
    from bana_sglang.balancer.actions import KVBlockMigration
    from bana_sglang.sim.cluster import Job
    from bana_sglang.sim.workloads import SimRequest

    cfg = SimConfig(profile="h100_llama3_8b", num_workers=4, store="global", page_tokens=512)
    reqs = [SimRequest(i, 0.0, 20_000, 4000, (i + 1,)) for i in range(4)]
    sim = Simulation(cfg, reqs)
    p = sim.p
    sim.run()  # the workers exist and are idle again; now give d0 a batch and lend its pages
    src, dst = sim.by_id["d0"], sim.by_id["d1"]
    for r in reqs[:2]:
        src.join(Job(r), 4000)
    sim._reschedule(src)  # its step time, as after any join
    pages = 40
    sim._on_mig_done(
        KVBlockMigration(src.wid, dst.wid, pages, pages * 512 * p.kv_bytes_per_token, 0.1), None
    )
    step = p.decode_step_seconds(2, src.kv_tokens())
    share = p.kv_read_seconds(pages * 512) / step
    assert 0 < share < 0.5
    assert dst.decode_factor == pytest.approx(1 / (1 - share)) and dst.lent_share == pytest.approx(
        share
    )
    assert src.decode_factor == pytest.approx(1 + p.num_layers * p.remote_attention_hop_s / step)
    assert src.kv_capacity == p.kv_capacity_tokens + pages * 512
    assert not sim._returns  # held until its LEASE_END
    sim._on_lease_end(next(e[3] for e in sim.events if e[2] == sim_engine.LEASE_END), None)
    assert src.decode_factor == pytest.approx(1.0) and dst.decode_factor == pytest.approx(1.0)
    assert dst.lent_share == pytest.approx(0.0) and src.kv_capacity == p.kv_capacity_tokens


def test_the_simulated_balancer_guards_the_runs_tpot_slo_unless_told_otherwise():
    from bana_sglang.balancer.actions import BalancerConfig

    cfg = system_config("bana", SimConfig(profile="h100_llama3_8b", num_workers=4, slo_tpot_s=0.07))
    assert Simulation(cfg, []).balancer.config.tpot_slo_s == 0.07
    off = cfg.with_(balancer_config=BalancerConfig(tpot_slo_s=0.0))
    assert Simulation(off, []).balancer.config.tpot_slo_s == 0.0


@pytest.mark.parametrize("limit", [1.0, 0.0])
def test_a_layer_lease_ends_early_when_its_decode_host_needs_the_memory(limit):
    """A decode peer hosting a donor's layers lends them KV capacity (the weights); once
    a request waits there for memory it has not got, the next balancer tick recalls the
    lease (Balancer.memory_recalls): capacity and speed factors come back exactly once
    and the waiting request is admitted. With recall_kv_usage=0 the lease holds."""
    from bana_sglang.balancer.actions import BalancerConfig, LayerMigration
    from bana_sglang.sim.cluster import Job
    from bana_sglang.sim.workloads import SimRequest

    cfg = system_config(
        "bana",
        SimConfig(
            profile="h100_llama3_8b",
            num_workers=4,
            page_tokens=512,
            balancer_config=BalancerConfig(recall_kv_usage=limit),
        ),
    )
    sim = Simulation(cfg, [], check=True)
    p, src, dst = sim.p, sim.by_id["p0"], sim.by_id["d0"]
    k = 8
    act = LayerMigration(
        src.wid, dst.wid, (p.num_layers - k, p.num_layers), k * p.layer_weight_bytes, 0.1
    )
    sim._start_action(act)  # as a plan's action starts: both workers engaged, then the transfer
    sim._on_mig_done(act, None)
    weights = k * p.layer_weight_bytes // p.kv_bytes_per_token
    assert dst.kv_capacity == p.kv_capacity_tokens - weights and src.prefill_factor < 1
    # d0 fills up: a request of twice the weights' tokens waits for memory
    dst.kv_reserved = dst.kv_capacity - weights
    job = Job(SimRequest(0, 0.0, 2 * weights - 10, 10, (1,)))
    dst.pending.append(job)
    dst.pending_tokens += job.kv_need
    dst.dirty()
    sim._on_tick(None, None)
    if not limit:
        assert sim.early_recalls == 0 and dst.kv_capacity == p.kv_capacity_tokens - weights
        assert list(dst.pending) == [job]
        return
    assert sim.early_recalls == 1 and not sim._layer_leases
    assert dst.kv_capacity == p.kv_capacity_tokens and src.leases == dst.leases == 0
    assert src.prefill_factor == pytest.approx(1.0) and dst.prefill_factor == pytest.approx(1.0)
    assert not dst.pending and dst.incoming == 1  # admitted: its KV is on its way
    # the lease's own LEASE_END comes later and changes nothing
    lease = next(e[3] for e in sim.events if e[2] == sim_engine.LEASE_END)
    sim._on_lease_end(lease, None)
    assert dst.kv_capacity == p.kv_capacity_tokens and src.leases == dst.leases == 0
    assert src.prefill_factor == pytest.approx(1.0)


def test_a_layer_lease_that_ends_leaves_fresh_snapshots_of_both_workers():
    """A prefill donor has no decode batch, so nothing else re-snapshots it: once its
    lease ends, its load must say it runs at its own speed again (and the peer's its
    whole KV), or the router and the balancer plan on the split."""
    from bana_sglang.balancer.actions import LayerMigration

    sim = Simulation(system_config("bana", SimConfig(profile="h100_llama3_8b", num_workers=4)), [])
    p, src, dst = sim.p, sim.by_id["p0"], sim.by_id["d0"]
    act = LayerMigration(
        src.wid, dst.wid, (p.num_layers - 8, p.num_layers), 8 * p.layer_weight_bytes, 0.1
    )
    sim._start_action(act)
    sim._on_mig_done(act, None)
    assert (
        src.load(sim.now).prefill_speed > 1
        and dst.load(sim.now).kv_total_tokens < p.kv_capacity_tokens
    )
    sim._on_lease_end(next(e[3] for e in sim.events if e[2] == sim_engine.LEASE_END), None)
    assert src.load(sim.now).prefill_speed == pytest.approx(1.0)
    assert dst.load(sim.now).kv_total_tokens == p.kv_capacity_tokens


def test_a_recalled_leases_late_end_event_leaves_a_newer_equal_lease_alone():
    """The same layers move to the same peer again after an early recall: the first
    lease's own LEASE_END, still queued, must not end the second (leases are told
    apart by identity, not by equal fields)."""
    from bana_sglang.balancer.actions import LayerMigration

    sim = Simulation(system_config("bana", SimConfig(profile="h100_llama3_8b", num_workers=4)), [])
    p, src, dst = sim.p, sim.by_id["p0"], sim.by_id["d0"]
    act = LayerMigration(
        src.wid, dst.wid, (p.num_layers - 8, p.num_layers), 8 * p.layer_weight_bytes, 0.1
    )
    sim._start_action(act)
    sim._on_mig_done(act, None)
    first = sim._layer_leases[0]
    sim._on_lease_end(first, None)  # recalled early
    sim._start_action(act)
    sim._on_mig_done(act, None)
    (second,) = sim._layer_leases
    assert second is not first
    held = dst.kv_capacity
    sim._on_lease_end(first, None)  # the first lease's LEASE_END arrives
    assert (
        sim._layer_leases == [second] and dst.kv_capacity == held and src.leases == dst.leases == 1
    )
