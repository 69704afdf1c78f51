"""The calibration fit and the fidelity comparison, on constructed numbers
(the live measurement itself is ``python -m bench calibrate``)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from bana_sglang.sim.config import SimConfig, SimConfigError
from bana_sglang.sim.engine import simulate
from bana_sglang.sim.profiles import load_profile, save_profile
from bana_sglang.sim.workloads import SimRequest
from bench.fidelity import fidelity_compare, fidelity_rows
from bench.fit import calibrate, fit_line
from bench.live import cpu_steal_ticks, store_faults


def test_fit_line_recovers_a_line_and_refuses_a_single_x():
    a, b = fit_line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0])
    assert math.isclose(a, 1.0) and math.isclose(b, 2.0)
    with pytest.raises(ValueError):
        fit_line([2, 2], [1.0, 3.0])


def test_calibration_recovers_the_profile_that_produced_the_measurements(tmp_path):
    base = load_profile("cpu_small")
    truth = replace(base, mfu=0.23, prefill_fixed_s=0.31, decode_fixed_s=0.012)
    prefill = [(n, truth.prefill_seconds(n, 0)) for n in (128, 512, 1024, 2048)]
    decode = [(b, b * 144, truth.decode_step_seconds(b, b * 144)) for b in (1, 4, 8)]
    got, fit = calibrate(base, prefill, decode)
    assert math.isclose(got.mfu, 0.23, rel_tol=1e-6)
    assert math.isclose(got.prefill_fixed_s, 0.31, rel_tol=1e-6)
    assert math.isclose(got.decode_fixed_s, 0.012, rel_tol=1e-6)
    assert all(math.isclose(r["measured_s"], r["fitted_s"], rel_tol=1e-6) for r in fit["prefill"])
    # the written profile is one the simulator loads
    path = save_profile(replace(got, name="cal"), tmp_path / "cal.json", {"mfu": "test"})
    assert math.isclose(load_profile(str(path)).mfu, 0.23, rel_tol=1e-9)


def test_a_flat_prefill_curve_is_refused():
    base = load_profile("cpu_small")
    with pytest.raises(ValueError, match="does not grow"):
        calibrate(base, [(128, 1.0), (2048, 0.5)], [(1, 144, 0.05)])


def test_fidelity_rows_are_relative_errors():
    live = [
        SimpleNamespace(ttft=1.0, tpot=0.1, output_tokens=10),
        SimpleNamespace(ttft=3.0, tpot=0.3, output_tokens=30),
    ]
    sim = SimpleNamespace(ttft_mean=2.2, ttft_p99=2.97, tpot_mean=0.2, out_tok_per_s=4.0)
    rows = {r["metric"]: r for r in fidelity_compare(live, sim, duration_live=10.0)}
    assert math.isclose(rows["mean TTFT s"]["error"], 0.1)
    assert (
        math.isclose(rows["throughput out tok/s"]["live"], 4.0)
        and rows["throughput out tok/s"]["error"] == 0
    )


def test_fidelity_over_repeated_runs_compares_with_their_mean_and_reports_their_spread():
    sim = SimpleNamespace(ttft_mean=2.2, ttft_p99=3.0, tpot_mean=0.2, out_tok_per_s=4.0)
    runs = [
        {"mean TTFT s": 1.5, "p99 TTFT s": 3.0, "mean TPOT s": 0.2, "throughput out tok/s": 4.0},
        {"mean TTFT s": 2.5, "p99 TTFT s": 3.0, "mean TPOT s": 0.2, "throughput out tok/s": 4.0},
    ]
    rows = {r["metric"]: r for r in fidelity_rows(runs, sim)}
    assert math.isclose(rows["mean TTFT s"]["live"], 2.0)
    assert math.isclose(rows["mean TTFT s"]["error"], 0.1)
    assert math.isclose(rows["mean TTFT s"]["live_spread"], 0.5)
    assert rows["p99 TTFT s"]["live_spread"] == 0 and rows["p99 TTFT s"]["live_runs"] == [3.0, 3.0]
    with pytest.raises(ValueError, match="no live run"):
        fidelity_rows([], sim)


def test_speed_pairing_scales_by_the_points_around_a_run_over_the_calibrations_reference(tmp_path):
    """A run whose reference points ran 1.5x (prefill) and 2x (decode) the
    calibration's simulates on a profile that slow; each run is compared with its
    own simulation."""
    from bench.fidelity import calibration_reference, paired_rows, speed_scales

    ref = {"prefill_alone_s": 2.0, "decode_alone_s": 0.1}
    pts = [
        {"prefill_alone_s": 2.8, "decode_alone_s": 0.18},
        {"prefill_alone_s": 3.2, "decode_alone_s": 0.22},
    ]
    sp, sd = speed_scales(ref, pts)
    assert math.isclose(sp, 1.5) and math.isclose(sd, 2.0)
    with pytest.raises(ValueError, match="decode_alone_s"):
        speed_scales(ref, [{"prefill_alone_s": 2.0, "decode_alone_s": 0.0}])
    with pytest.raises(ValueError, match="no speed point"):
        speed_scales(ref, [])
    # the reference is what calibrate wrote next to the profile; none for a hand-written one
    prof = tmp_path / "cal.json"
    assert calibration_reference(prof) is None
    prof.with_suffix(".fit.json").write_text(
        '{"contention": {"prefill_alone_s": 2.0, "decode_alone_s": 0.1, "prefill_shared_s": 2.2}}'
    )
    assert calibration_reference(prof) == ref
    prof.with_suffix(".fit.json").write_text('{"prefill": []}')
    assert calibration_reference(prof) is None
    runs = [{"mean TTFT s": 2.0, "mean TPOT s": 0.1}, {"mean TTFT s": 4.0, "mean TPOT s": 0.2}]
    sims = [{"mean TTFT s": 2.2, "mean TPOT s": 0.1}, {"mean TTFT s": 3.8, "mean TPOT s": 0.22}]
    rows = {r["metric"]: r for r in paired_rows(runs, sims)}
    assert math.isclose(rows["mean TTFT s"]["error"], 0.0) and math.isclose(
        rows["mean TTFT s"]["sim"], 3.0
    )
    assert [round(e, 3) for e in rows["mean TTFT s"]["run_errors"]] == [0.1, -0.05]
    assert math.isclose(rows["mean TPOT s"]["error"], 0.02 / 0.3)
    with pytest.raises(ValueError, match="one each"):
        paired_rows(runs, sims[:1])


def test_a_scaled_profile_is_that_many_times_slower_on_prefill_and_decode():
    from bana_sglang.sim.profiles import ProfileError

    p = load_profile("cpu_small_calibrated")
    q = p.scaled(prefill=1.5, decode=2.0)
    for n, c in ((512, 0), (2048, 1024)):
        assert math.isclose(q.prefill_seconds(n, c), 1.5 * p.prefill_seconds(n, c), rel_tol=1e-9)
    for b, kv in ((1, 128), (8, 4096)):
        assert math.isclose(
            q.decode_step_seconds(b, kv), 2.0 * p.decode_step_seconds(b, kv), rel_tol=1e-9
        )
    assert math.isclose(q.join_stall_seconds(1024), 2.0 * p.join_stall_seconds(1024), rel_tol=1e-9)
    assert math.isclose(q.pd_handoff_s, 2.0 * p.pd_handoff_s)
    assert (
        q.net_seconds(1e6) == p.net_seconds(1e6)
        and q.host_contention_join == p.host_contention_join
    )
    assert p.scaled() == p
    with pytest.raises(ProfileError, match="positive"):
        p.scaled(decode=0)


def test_store_faults_counts_mooncake_stalls_and_failures_in_the_cluster_logs(tmp_path):
    (tmp_path / "prefill-0.log").write_text(
        "E1201 06:17:52.089040 31367 transfer_task.cpp:891] Failed to complete transfers after 60000 milliseconds "
        "for batch 1\n"
        "E1201 06:19:20.170111 31367 client_service.cpp:3085] Operation for key bana/kv/1d failed: TRANSFER_FAIL "
        "(Transfer 0 failed)\n[2026-12-01 06:17:44] Prefill batch, #new-seq: 1\n"
    )
    (tmp_path / "decode-0.log").write_text("... TRANSFER_FAIL ...\n")
    (tmp_path / "notes.txt").write_text("Failed to complete transfers after\n")  # not a cluster log
    assert store_faults(tmp_path) == {"stalls": 1, "failed": 2}


def test_cpu_steal_ticks_reads_proc_stat():
    steal, total = cpu_steal_ticks()
    assert 0 <= steal <= total
    assert total > 0 or not Path("/proc/stat").exists()


def test_the_simulator_takes_the_workload_block_size():
    with pytest.raises(SimConfigError):
        SimConfig(page_tokens=0)
    reqs = [
        SimRequest(rid=i, arrival=0.5 * i, input_len=64, output_len=4, hashes=(1, 2))
        for i in range(4)
    ]
    res = simulate(
        SimConfig(profile="cpu_small", num_workers=2, page_tokens=32, store="global"), reqs
    )
    assert res.finished == 4 and res.hit_rate > 0  # the shared 2 x 32-token prefix is reused


def test_contention_factors_come_from_the_shared_over_alone_ratios_and_go_into_the_profile(
    tmp_path,
):
    from bench.calibrate import decode_gaps_during
    from bench.fit import contention_factors

    c = {
        "prefill_alone_s": 4.0,
        "prefill_shared_s": 5.5,
        "decode_alone_s": 0.08,
        "decode_shared_s": 0.1,
    }
    f = contention_factors(c)
    assert math.isclose(f["host_contention_prefill"], 1.375) and math.isclose(
        f["host_contention_decode"], 1.25
    )
    # faster under load is noise: the factor stays 1
    assert contention_factors({**c, "decode_shared_s": 0.07})["host_contention_decode"] == 1.0
    with pytest.raises(ValueError, match="prefill_alone_s"):
        contention_factors({**c, "prefill_alone_s": 0})
    base = load_profile("cpu_small")
    prefill = [(n, base.prefill_seconds(n, 0)) for n in (128, 1024, 2048)]
    decode = [(b, b * 144, base.decode_step_seconds(b, b * 144)) for b in (1, 4)]
    got, fit = calibrate(base, prefill, decode, c)
    assert (
        math.isclose(got.host_contention_prefill, 1.375)
        and fit["contention"]["decode_shared_s"] == 0.1
    )
    again = load_profile(save_profile(got, tmp_path / "p.json"))
    assert math.isclose(again.host_contention_decode, 1.25)
    # the busy join: its hold over the idle one's, never below 1, into the profile
    busy = {**c, "join_idle_hold_s": 0.04, "join_busy_hold_s": 0.12}
    assert math.isclose(contention_factors(busy)["host_contention_join"], 3.0)
    assert contention_factors({**busy, "join_busy_hold_s": 0.03})["host_contention_join"] == 1.0
    assert "host_contention_join" not in contention_factors(c)  # a fit from before the busy join
    with pytest.raises(ValueError, match="busy-join"):
        contention_factors({**c, "join_busy_hold_s": 0.12})
    with pytest.raises(ValueError, match="busy-join"):
        contention_factors({**busy, "join_idle_hold_s": 0.0})
    got, fit = calibrate(base, prefill, decode, busy)
    assert math.isclose(
        load_profile(save_profile(got, tmp_path / "j.json")).host_contention_join, 3.0
    )
    assert math.isclose(fit["contention"]["host_contention_join"], 3.0)
    # only the gaps inside the window count
    recs = [SimpleNamespace(chunks=((0.0, 1), (1.0, 1), (1.2, 1), (1.5, 1), (3.0, 1)))]
    assert [round(g, 3) for g in decode_gaps_during(recs, 1.0, 2.0)] == [0.2, 0.3]


def test_a_contention_factor_below_one_is_refused():
    from bana_sglang.sim.profiles import ProfileError

    with pytest.raises(ProfileError, match="contention"):
        replace(load_profile("cpu_small"), host_contention_decode=0.5)


def test_a_streamed_record_splits_into_its_step_time_and_the_pd_hand_off():
    from bench.calibrate import steady_and_handoff

    # first token at 1.0 (the prefill's), second 0.5 s later, then 0.1 s per token
    r = SimpleNamespace(
        rid=1,
        first_token_s=1.0,
        end_s=1.5 + 0.1 * 8,
        output_tokens=10,
        chunks=((1.0, 1), *((1.5 + 0.1 * i, 1) for i in range(9))),
    )
    steady, handoff = steady_and_handoff(r)
    assert math.isclose(steady, 0.1) and math.isclose(handoff, 0.4)
    merged = SimpleNamespace(
        rid=2, first_token_s=1.0, end_s=2.0, output_tokens=4, chunks=((1.0, 2), (2.0, 2))
    )
    assert steady_and_handoff(merged) == (0.5, 0.0)  # tokens 1 and 2 in one chunk: no hand-off seen
    with pytest.raises(ValueError, match="at least 3"):
        steady_and_handoff(
            SimpleNamespace(
                rid=3, first_token_s=1.0, end_s=1.1, output_tokens=2, chunks=((1.0, 1), (1.1, 1))
            )
        )


def test_the_pd_hand_off_and_the_overlap_loop_lag_show_in_simulated_latencies(tmp_path):
    """A hand-off delays every request's first decode step (its TPOT over few
    tokens), not its first token; the result lag holds a prefill batch's first
    tokens until the next batch has computed."""
    base = load_profile("cpu_small")
    reqs = [
        SimRequest(rid=i, arrival=0.0, input_len=600 * (i + 1), output_len=5, hashes=(10 + i,))
        for i in range(3)
    ]

    def run(**changes):
        path = save_profile(replace(base, max_prefill_tokens=2048, **changes), tmp_path / "p.json")
        from bana_sglang.sim.engine import Simulation

        sim = Simulation(
            SimConfig(profile=str(path), num_workers=2, store="global", page_tokens=600), reqs
        )
        sim.run()
        return {r.rid: r for r in sim.records}

    plain, handoff, lag = run(), run(pd_handoff_s=2.0), run(prefill_result_lag=True)
    assert all(math.isclose(handoff[i].first_token, plain[i].first_token) for i in range(3))
    assert all(
        math.isclose(handoff[i].finish - plain[i].finish, 2.0, rel_tol=0.05) for i in range(3)
    )
    # request 0 is alone in the first batch, 1 and 2 (1200 + 1800 tokens) follow in two chunks
    assert lag[0].first_token > plain[0].first_token
    assert math.isclose(lag[0].first_token, plain[1].first_token, rel_tol=1e-6)
    assert math.isclose(
        lag[2].first_token, plain[2].first_token, rel_tol=1e-6
    )  # the last batch waits for none


def _stream(rid, times):
    return SimpleNamespace(rid=rid, chunks=tuple((t, 1) for t in times))


def test_a_join_is_timed_by_the_running_requests_gaps_across_it():
    from bench.calibrate import join_effect

    # two requests decode at 0.1 s a step; a third's first token comes at 1.05, its
    # second at 1.45, and the running ones' gap across that window takes 0.4 s (0.3 over a step)
    a = _stream(1, [0.1 * i for i in range(11)] + [1.4 + 0.1 * i for i in range(5)])
    b = _stream(2, [0.05 + 0.1 * i for i in range(11)] + [1.45 + 0.1 * i for i in range(5)])
    new = _stream(3, [1.05, 1.45, 1.55, 1.65])
    hold, gap = join_effect([a, b], new)
    assert math.isclose(hold, 0.3, rel_tol=1e-6) and math.isclose(gap, 0.3, rel_tol=1e-6)
    with pytest.raises(ValueError, match="joined no running batch"):
        join_effect([_stream(4, [0.0, 0.1, 0.2, 0.3, 0.4])], new)  # it ended before the join
    with pytest.raises(ValueError, match="at least 3"):
        join_effect([a], _stream(5, [1.0, 1.1]))


def test_the_join_fit_gives_hold_and_hand_off_and_refuses_a_negative_slope():
    from bench.fit import fit_join

    base = load_profile("cpu_small")
    transfer = lambda n: (
        base.net_seconds(n * base.kv_bytes_per_token) * (1 - base.pd_transfer_overlap)
    )
    pts = [
        {"tokens": n, "hold_s": 0.02 + 4e-5 * n, "gap_s": 0.01 + 0.02 + 4e-5 * n + transfer(n)}
        for n in (256, 1024, 2048)
    ]
    p = fit_join(base, pts)
    assert math.isclose(p.decode_join_s, 0.02, rel_tol=1e-6)
    assert math.isclose(p.decode_join_s_per_token, 4e-5, rel_tol=1e-6)
    assert math.isclose(p.pd_handoff_s, 0.01, abs_tol=1e-9)
    flat = fit_join(
        base,
        [
            {"tokens": 256, "hold_s": 0.2, "gap_s": 0.0},
            {"tokens": 2048, "hold_s": 0.1, "gap_s": 0.0},
        ],
    )
    assert flat.decode_join_s_per_token == 0 and math.isclose(flat.decode_join_s, 0.15)
    assert flat.pd_handoff_s == 0  # never negative


def test_a_request_joining_a_decode_batch_holds_the_requests_already_in_it(tmp_path):
    """With the profile's join hold, request 1 joining request 0's batch delays
    request 0's finish by the hold of a 1000-token prompt; request 1 waits for its
    own hold too. Without it (every GPU profile), nothing moves."""
    from bana_sglang.sim.engine import Simulation

    base = load_profile("cpu_small")
    reqs = [
        SimRequest(rid=0, arrival=0.0, input_len=100, output_len=400, hashes=(1,)),
        SimRequest(rid=1, arrival=0.5, input_len=1000, output_len=5, hashes=(2,)),
    ]

    def run(**changes):
        path = save_profile(replace(base, **changes), tmp_path / "p.json")
        sim = Simulation(
            SimConfig(profile=str(path), num_workers=2, store="global", page_tokens=100), reqs
        )
        sim.run()
        return {r.rid: r for r in sim.records}

    plain, held = run(), run(decode_join_s=0.05, decode_join_s_per_token=1e-4)
    hold = lambda n: 0.05 + 1e-4 * n
    assert plain[0].finish > plain[1].first_token  # request 1 joins while 0 decodes
    assert all(math.isclose(held[i].first_token, plain[i].first_token) for i in range(2))
    # (to a few ms: request 1's steps overlap request 0's at a slightly different KV length)
    assert abs(held[0].finish - plain[0].finish - (hold(100) + hold(1000))) < 0.005
    assert (
        held[1].finish - plain[1].finish > hold(1000) - 0.005
    )  # its own hold (request 0's came before it)
    assert held[1].finish - plain[1].finish <= hold(100) + hold(1000) + 1e-6


def test_requests_whose_kv_lands_during_a_joins_hold_are_admitted_with_it_for_one_fixed_cost(
    tmp_path,
):
    """Two prompts prefilled in one batch land at request 0's decode batch
    together: like SGLang's decode scheduler (one prebuilt batch of every request
    whose KV has arrived), they pay ``decode_join_s`` once and each its per-token
    part. A prompt landing alone pays its own fixed part."""
    from bana_sglang.sim.engine import Simulation

    base = replace(load_profile("cpu_small"), decode_join_s=0.05, decode_join_s_per_token=1e-4)
    # requests 1 and 2 queue during request 0's prefill: the next batch prefills both
    together = [
        SimRequest(rid=0, arrival=0.0, input_len=2000, output_len=2000, hashes=(1,)),
        SimRequest(rid=1, arrival=0.5, input_len=1000, output_len=5, hashes=(2,)),
        SimRequest(rid=2, arrival=0.5, input_len=1000, output_len=5, hashes=(3,)),
    ]

    def finish_of_0(reqs, **changes):
        path = save_profile(replace(base, **changes), tmp_path / "p.json")
        sim = Simulation(
            SimConfig(profile=str(path), num_workers=2, store="global", page_tokens=100), reqs
        )
        sim.run()
        return {r.rid: r for r in sim.records}[0].finish

    # what the fixed part adds to request 0: its own join's, then one for requests 1
    # and 2 together (0.15 s if each paid one)
    per_token_only = finish_of_0(together, decode_join_s=0.0)
    assert abs(finish_of_0(together) - per_token_only - 2 * 0.05) < 0.01
    apart = [together[0], together[1], replace(together[2], arrival=30.0)]  # lands on its own
    per_token_only = finish_of_0(apart, decode_join_s=0.0)
    assert abs(finish_of_0(apart) - per_token_only - 3 * 0.05) < 0.01
    assert base.join_stall_seconds(1000, admission=False) == pytest.approx(0.1)


def test_a_join_while_the_shared_host_prefills_holds_the_batch_host_contention_join_times_longer(
    tmp_path,
):
    """Request 1 joins request 0's batch while request 2 (queued behind it)
    prefills on the same host: its hold runs ``host_contention_join`` times longer.
    Request 0's own join, with the prefill worker idle, keeps its hold, and on
    separate hosts the factor changes nothing."""
    from bana_sglang.sim.engine import Simulation

    base = replace(
        load_profile("cpu_small"),
        host_contention_prefill=1.0,
        host_contention_decode=1.0,
        prefill_result_lag=False,
        decode_join_s=0.05,
        decode_join_s_per_token=1e-4,
    )
    reqs = [
        SimRequest(rid=0, arrival=0.0, input_len=100, output_len=300, hashes=(1,)),
        SimRequest(rid=1, arrival=1.5, input_len=1000, output_len=5, hashes=(2,)),
        SimRequest(rid=2, arrival=1.501, input_len=4000, output_len=5, hashes=(3,)),
    ]

    def run(factor, shared=True):
        path = save_profile(replace(base, host_contention_join=factor), tmp_path / "p.json")
        sim = Simulation(
            SimConfig(
                profile=str(path),
                num_workers=2,
                store="global",
                page_tokens=100,
                shared_host=shared,
            ),
            reqs,
        )
        sim.run()
        return {r.rid: r for r in sim.records}

    one, three = run(1.0), run(3.0)
    assert (
        one[0].first_token + 0.1 < reqs[1].arrival
    )  # request 0 joined with the prefill worker idle
    assert (
        one[1].first_token < one[2].first_token
    )  # request 2 was still prefilling at request 1's join
    assert (
        one[1].finish < one[0].finish < one[2].first_token
    )  # request 0 decoded through request 1's join
    hold_1000 = base.join_stall_seconds(1000)
    assert math.isclose(three[0].finish - one[0].finish, 2 * hold_1000, rel_tol=1e-3)
    assert math.isclose(three[1].finish - one[1].finish, 2 * hold_1000, rel_tol=1e-3)
    assert all(math.isclose(three[i].first_token, one[i].first_token) for i in range(3))
    apart_one, apart_three = run(1.0, shared=False), run(3.0, shared=False)
    assert math.isclose(apart_three[0].finish, apart_one[0].finish)


def test_the_decode_fit_separates_per_request_work_from_kv_reads():
    from bench.fit import fit_decode, fit_plane

    a, b, c = fit_plane(
        [1, 2, 3, 4],
        [1, 4, 9, 16],
        [1 + 2 * x + 0.5 * y for x, y in zip([1, 2, 3, 4], [1, 4, 9, 16])],
    )
    assert math.isclose(a, 1) and math.isclose(b, 2) and math.isclose(c, 0.5)
    with pytest.raises(ValueError, match="collinear"):
        fit_plane([1, 2, 3], [2, 4, 6], [1, 2, 3])
    base = load_profile("cpu_small")
    truth = replace(base, decode_fixed_s=0.02, decode_per_request_s=0.005, kv_read_bytes_per_s=4e8)
    points = [(1, 144), (4, 576), (8, 1152), (4, 4160), (8, 4224)]
    got = fit_decode(base, [(b, kv, truth.decode_step_seconds(b, kv)) for b, kv in points])
    assert math.isclose(got.decode_per_request_s, 0.005, rel_tol=1e-6)
    assert math.isclose(got.kv_read_bytes_per_s, 4e8, rel_tol=1e-6)
    assert (
        math.isclose(got.decode_fixed_s, 0.02, rel_tol=1e-6)
        and got.hbm_efficiency == base.hbm_efficiency
    )
    assert math.isclose(
        got.decode_step_seconds(16, 20000), truth.decode_step_seconds(16, 20000), rel_tol=1e-6
    )


def test_a_decode_intercept_shorter_than_the_weights_read_keeps_the_measured_steps():
    """On a machine that reads the small model's weights faster than the profile's
    bandwidth (its caches hold much of them), the fit's intercept is below the
    weights' read: the fitted steps must still be the measured ones, not the
    weights' read plus a clipped overhead (a fit that clips it predicts every
    step ~10 ms too slow)."""
    from bench.fit import MIN_DECODE_FIXED_S, fit_decode

    # the peak as calibrate() leaves it (the fitted prefill rate), so that the law's compute
    # term stays below its memory term at these batches, as in the live fit
    base = replace(load_profile("cpu_small"), peak_flops=6e10, mfu=1.0)
    weights = base.weight_bytes / (base.hbm_bytes_per_s * base.hbm_efficiency)
    points = [(1, 144), (4, 576), (8, 1152), (4, 4160), (8, 4224)]
    # a step of 1e-3 + per-request + KV, with no room for the profile's weights' read
    measured = [
        (b, kv, 0.001 + 0.0015 * b + kv * base.kv_bytes_per_token / 2e9) for b, kv in points
    ]
    assert min(t for _, _, t in measured) < weights
    got = fit_decode(base, measured)
    assert got.decode_fixed_s == MIN_DECODE_FIXED_S and got.hbm_bytes_per_s > base.hbm_bytes_per_s
    for b, kv, t in measured:
        assert math.isclose(got.decode_step_seconds(b, kv), t, rel_tol=1e-6), (b, kv)
    # a slow machine keeps the profile's bandwidth and puts the rest in the overhead
    slow = fit_decode(base, [(b, kv, t + weights) for b, kv, t in measured])
    assert slow.hbm_bytes_per_s == base.hbm_bytes_per_s and math.isclose(
        slow.decode_fixed_s, 0.001, rel_tol=1e-6
    )


def test_chunked_prompts_fit_the_cost_of_attending_over_a_cached_prefix():
    from bench.fit import chunked_prefill_seconds

    base = load_profile("cpu_small")
    truth = replace(base, mfu=0.4, prefill_fixed_s=0.2, prefix_attention_cost=3.5)
    lengths = (128, 512, 1024, 2048, 3072, 4096)
    prefill = [(n, truth.prefill_seconds(n, 0)) for n in lengths]
    prefill += [(n, chunked_prefill_seconds(truth, n)) for n in (6144, 8192)]
    decode = [(b, b * 144, truth.decode_step_seconds(b, b * 144)) for b in (1, 4, 8)]
    got, fit = calibrate(base, prefill, decode)
    assert math.isclose(got.prefix_attention_cost, 3.5, rel_tol=1e-6) and math.isclose(
        got.mfu, 0.4, rel_tol=1e-6
    )
    assert all(math.isclose(r["measured_s"], r["fitted_s"], rel_tol=1e-6) for r in fit["prefill"])
    assert math.isclose(
        got.prefill_seconds(1000, 0), truth.prefill_seconds(1000, 0)
    )  # a fresh chunk: unaffected
