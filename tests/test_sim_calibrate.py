"""The calibration fit and the fidelity comparison, on constructed numbers
(the live measurement itself is ``python -m bana_sglang.sim calibrate``)."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from bana_sglang.sim.calibrate import calibrate, fidelity_compare, fit_line
from bana_sglang.sim.config import SimConfig, SimConfigError
from bana_sglang.sim.engine import simulate
from bana_sglang.sim.profiles import load_profile, save_profile
from bana_sglang.sim.workloads import SimRequest


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
    live = [SimpleNamespace(ttft=1.0, tpot=0.1, output_tokens=10), SimpleNamespace(ttft=3.0, tpot=0.3,
                                                                                    output_tokens=30)]
    sim = SimpleNamespace(ttft_mean=2.2, ttft_p99=2.97, tpot_mean=0.2, out_tok_per_s=4.0)
    rows = {r["metric"]: r for r in fidelity_compare(live, sim, duration_live=10.0)}
    assert math.isclose(rows["mean TTFT s"]["error"], 0.1)
    assert math.isclose(rows["throughput out tok/s"]["live"], 4.0) and rows["throughput out tok/s"]["error"] == 0


def test_the_simulator_takes_the_workload_block_size():
    with pytest.raises(SimConfigError):
        SimConfig(page_tokens=0)
    reqs = [SimRequest(rid=i, arrival=0.5 * i, input_len=64, output_len=4, hashes=(1, 2)) for i in range(4)]
    res = simulate(SimConfig(profile="cpu_small", num_workers=2, page_tokens=32, store="global"), reqs)
    assert res.finished == 4 and res.hit_rate > 0  # the shared 2 x 32-token prefix is reused


def test_contention_factors_come_from_the_shared_over_alone_ratios_and_go_into_the_profile(tmp_path):
    from bana_sglang.sim.calibrate import contention_factors, decode_gaps_during

    c = {"prefill_alone_s": 4.0, "prefill_shared_s": 5.5, "decode_alone_s": 0.08, "decode_shared_s": 0.1}
    f = contention_factors(c)
    assert math.isclose(f["host_contention_prefill"], 1.375) and math.isclose(f["host_contention_decode"], 1.25)
    # faster under load is noise: the factor stays 1
    assert contention_factors({**c, "decode_shared_s": 0.07})["host_contention_decode"] == 1.0
    with pytest.raises(ValueError, match="prefill_alone_s"):
        contention_factors({**c, "prefill_alone_s": 0})
    base = load_profile("cpu_small")
    prefill = [(n, base.prefill_seconds(n, 0)) for n in (128, 1024, 2048)]
    decode = [(b, b * 144, base.decode_step_seconds(b, b * 144)) for b in (1, 4)]
    got, fit = calibrate(base, prefill, decode, c)
    assert math.isclose(got.host_contention_prefill, 1.375) and fit["contention"]["decode_shared_s"] == 0.1
    again = load_profile(save_profile(got, tmp_path / "p.json"))
    assert math.isclose(again.host_contention_decode, 1.25)
    # only the gaps inside the window count
    recs = [SimpleNamespace(chunks=((0.0, 1), (1.0, 1), (1.2, 1), (1.5, 1), (3.0, 1)))]
    assert [round(g, 3) for g in decode_gaps_during(recs, 1.0, 2.0)] == [0.2, 0.3]


def test_a_contention_factor_below_one_is_refused():
    from bana_sglang.sim.profiles import ProfileError

    with pytest.raises(ProfileError, match="contention"):
        replace(load_profile("cpu_small"), host_contention_decode=0.5)
