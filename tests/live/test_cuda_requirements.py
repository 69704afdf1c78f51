"""The CUDA requirement set resolves to one consistent CUDA 13 stack (needs the package
registry: pip resolves requirements/cuda.txt with --dry-run, installing nothing).

What is asserted: one torch, the version SGLang 0.5.23 pins; exactly one Mooncake wheel,
its CUDA 13 build; and every CUDA runtime package of the set built for CUDA 13. The
CuTe DSL's library bundles (``nvidia-cutlass-dsl-libs-*``) are the one exception:
``nvidia-cutlass-dsl`` 4.8.0, pinned by SGLang, requires its ``-cu12`` bundle next to
the ``-cu13`` one whatever the extra, and they carry no CUDA runtime."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_cuda_requirements_resolve_to_one_cuda_13_stack(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--disable-pip-version-check",
            "--report",
            str(report),
            "-r",
            str(ROOT / "requirements" / "cuda.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    versions: dict[str, list[str]] = {}
    for item in installs:
        md = item["metadata"]
        versions.setdefault(md["name"].lower().replace("_", "-"), []).append(md["version"])
    assert versions["torch"] == ["2.14.1"], versions.get("torch")
    assert versions["sglang"] == ["0.5.23"]
    mooncake = {n: v for n, v in versions.items() if n.startswith("mooncake-transfer-engine")}
    assert mooncake == {"mooncake-transfer-engine-cuda13": ["0.3.13.post1"]}, mooncake
    for name, vs in versions.items():
        assert len(vs) == 1, f"{name} resolved twice: {vs}"
        if name.startswith("nvidia-cutlass-dsl-libs-"):
            continue  # the DSL's library bundles (see the module docstring)
        suffix = re.search(r"-cu(\d+)$", name)
        if suffix:
            assert suffix.group(1) == "13", f"{name} {vs[0]} is built for CUDA {suffix.group(1)}"
    for name in ("cuda-toolkit", "nvidia-cuda-runtime", "cuda-bindings"):
        if name in versions:
            assert versions[name][0].split(".")[0] == "13", f"{name} {versions[name][0]}"
    assert "cuda-toolkit" in versions and "nvidia-cuda-runtime" in versions
