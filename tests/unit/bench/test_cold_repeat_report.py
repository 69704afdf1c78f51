"""The cold/repeat benchmark's round order, per-round ratios and load figures (no cluster)."""

from __future__ import annotations

from bench import bench_cold_repeat as cr
from bench import breakdown


def test_rounds_alternate_the_arm_order() -> None:
    assert cr.order(["store", "nostore"], 1) == ["store", "nostore"]
    assert cr.order(["store", "nostore"], 3) == [
        "store",
        "nostore",
        "nostore",
        "store",
        "store",
        "nostore",
    ]


def _run(arm: str, cold_ms: float, rep_ms: float, loaded=0.0, load_s=0.0, wait_s=0.0, raw=None):
    m = {"prefill-0": {"loaded_bytes": loaded, "load_seconds": load_s, "load_wait_seconds": wait_s}}
    return cr.ArmRun(
        "tiny",
        arm,
        cr.Phase(ttft_s=[cold_ms / 1e3] * 3),
        cr.Phase(ttft_s=[rep_ms / 1e3] * 3, metrics=m),
        raw_get_mbps=raw,
        page_nbytes=65536 if raw else None,
    )


def test_report_has_per_round_ratios_and_loads_against_the_wire() -> None:
    runs = [
        _run("store", 100, 50, loaded=40e6, load_s=0.2, wait_s=0.05, raw=400.0),
        _run("nostore", 100, 100),
        _run("nostore", 100, 100),
        _run("store", 120, 60, loaded=40e6, load_s=0.2, wait_s=0.05, raw=400.0),
    ]
    assert cr._round_ratios(runs) == {"tiny": [(1.0, 0.5), (1.2, 0.6)]}
    text = cr.report(runs, "cmd", 3, 1400)
    assert "| tiny | 2 | 1.20 | 0.60 |" in text
    # 80 MB over 0.4 s of loads: 200 MB/s, half the raw get; 75% hidden
    assert "200 MB/s; 75% of load time hidden" in text
    assert "ratio 0.50" in text


def test_the_ratio_gets_an_interval_over_rounds_from_three_rounds_on() -> None:
    two = [_run("store", 110, 50), _run("nostore", 100, 100)] * 2
    assert cr.round_interval(two[::2], two[1::2], "cold") is None
    assert "(" not in cr.report(two, "cmd", 3, 1400).split("repeat: store hit")[1].split("\n\n")[0]
    # rounds at 1.0, 1.1, 1.2 and 1.3: the interval lies within them and is not a point
    runs = [
        r for c in (100, 110, 120, 130) for r in (_run("store", c, 50), _run("nostore", 100, 100))
    ]
    on, off = runs[::2], runs[1::2]
    lo, hi = cr.round_interval(on, off, "cold")
    assert 1.0 <= lo < hi <= 1.3
    assert cr.round_interval(on, off, "repeat") == (0.5, 0.5)  # every round agrees
    text = cr.report(runs, "cmd", 3, 1400)
    assert (
        f"| tiny | {cr._pooled_ratio(on, off, 'cold'):.2f} ({lo:.2f}-{hi:.2f}) | 0.50 (0.50-0.50) |"
        in text
    )
    assert "bootstrap" in text


def test_load_figures_none_without_loads() -> None:
    assert breakdown.load_figures({"w": {"loaded_bytes": 0.0}}) is None
    assert breakdown.load_figures({"w": {"loaded_bytes": 2e6, "load_seconds": 1.0}}) == (
        2.0,
        1.0,
        1.0,
    )


def test_page_bytes_and_master_come_from_the_plan(tiny_model) -> None:
    from bana_sglang.launch import LaunchConfig, plan_cluster

    def plan(*args: str):
        return plan_cluster(LaunchConfig(model_path=str(tiny_model), port=24000, sglang_args=args))

    p16, p64 = plan(), plan("--page-size", "64")
    assert breakdown.page_nbytes(p64) == 4 * breakdown.page_nbytes(p16)
    assert breakdown.master_addr(p16).startswith("127.0.0.1:")


def test_cpu_per_request_pools_rounds_by_part() -> None:
    cold = {"prefill-0": 0.3, "prefill-1": 0.3, "decode-0": 0.6, "kv-storage": 0.15, "router": 0.0}
    a = _run("store", 100, 50)
    a.cold.cpu_s = cold
    b = _run("store", 100, 50)
    b.cold.cpu_s = {k: 2 * v for k, v in cold.items()}
    ms = cr.cpu_per_request([a, b], "cold")  # 3 requests each: CPU x3 over 6 requests
    assert ms is not None
    assert ms["prefill"] == 300.0 and ms["decode"] == 300.0 and ms["storage"] == 75.0
    assert ms["total"] == 675.0 and ms["index"] == 0.0
    assert cr.cpu_per_request([a, b], "repeat") is None  # not measured
    text = cr.report([a, _run("nostore", 100, 100)], "cmd", 3, 1400)
    assert "| tiny | store | cold | 200.0 | 200.0 | 0.0 | 0.0 | 50.0 | 0.0 | 450.0 |" in text


def test_cpu_of_parts_counts_a_part_with_its_children() -> None:
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import psutil

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 5: pass\n"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])",
        ]
    )
    try:
        time.sleep(0.5)  # the child is up and spinning
        procs = [
            SimpleNamespace(name="worker", pid=parent.pid),
            SimpleNamespace(name="gone", pid=None),
        ]
        before = breakdown.cpu_of_parts(procs)
        time.sleep(0.25)
        after = breakdown.cpu_of_parts(procs)
        assert set(after) == {"worker"}
        assert after["worker"] - before["worker"] > 0.05  # the child's time counts
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.wait(10)
