"""scripts/device_check.sh dry-runs on a CPU machine: every GPU step skips and says so,
the CPU-capable ones run, and its results land in at most 8 files under $OUT (what the
device tool brings back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_check_dry_runs_on_a_cpu_machine(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    for step in (
        "step env",
        "step install: skipped",
        "step pytest: rc=0",
        "step probes: rc=0",
        "step store: skipped (no CUDA device)",
        "step router-dry: rc=0",
        "done",
    ):
        assert step in summary, (step, summary)
    records = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    assert sorted(r["probe"] for r in records) == ["a", "c", "d", "s"]
    assert all(r["skipped"] == "no CUDA device" for r in records)
    assert "skipped" in (out / "pytest.log").read_text()
    assert "bana router" in (out / "router.log").read_text()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
