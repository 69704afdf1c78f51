"""The idle-CPU benchmark's report: per-scheduler and whole-cluster rates, ratios (no cluster)."""

from __future__ import annotations

from bench import bench_idle_cpu as ic


def _run(arm: str, sched_s: float, other_s: float, ttft_ms: float) -> ic.ArmRun:
    # 3 schedulers over a 10 s window
    cpu = {"scheduler": sched_s, "router": other_s, "_schedulers": 3}
    return ic.ArmRun(arm, 10.0, cpu, [ttft_ms / 1e3] * 3)


def test_rates_are_per_second_of_idleness_and_per_scheduler() -> None:
    runs = [_run("sleep", 0.9, 0.1, 50), _run("poll", 4.5, 0.1, 45)]
    assert ic._rate(runs[:1], "scheduler") == 30.0  # 0.9 s / 3 schedulers / 10 s
    assert ic._rate(runs[:1], None) == 100.0  # 1.0 s over 10 s, the count left out
    text = ic.report(runs, "python -m bench.bench_idle_cpu", "tiny", 10, 3)
    assert "| sleep | " in text and "| 30 | 100 | 50 |" in text
    assert "| poll | " in text and "| 150 | 460 | 45 |" in text
    assert "one scheduler's idle CPU 0.20, the cluster's 0.22." in text
    assert "| scheduler | 90 | 450 |" in text and "_schedulers" not in text


def test_one_arm_reports_without_ratios() -> None:
    text = ic.report([_run("poll", 4.5, 0.1, 45)], "cmd", "tiny", 10, 3)
    assert "| poll | " in text and "sleep / poll" not in text
