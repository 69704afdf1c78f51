"""scripts/cuda_stack.py, the CUDA checks of scripts/setup.sh: a driver too old for SGLang
0.5.23's CUDA 13 stack is refused before anything is installed, with both versions named;
after the install, a torch that sees no GPU is reported, not taken for success."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_stack.py"
spec = importlib.util.spec_from_file_location("cuda_stack", SCRIPT)
cuda_stack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_stack)


def test_driver_versions_are_compared_as_numbers():
    assert cuda_stack.parse_version("580.65.06") == (580, 65, 6)
    with pytest.raises(ValueError):
        cuda_stack.parse_version("580.x")
    assert cuda_stack.check_driver("580.65.06") is None
    assert cuda_stack.check_driver("590.1") is None
    old = cuda_stack.check_driver("535.104.05")
    assert "535.104.05" in old and "580.0 or newer" in old and "torch 2.14.1+cu130" in old
    assert "nvidia-smi is missing" in cuda_stack.check_driver(None)


def test_a_torch_without_a_gpu_is_reported():
    why = cuda_stack.check_torch()  # this machine: the CPU build of torch
    assert why is not None and ("CPU build" in why or "sees no GPU" in why)


def test_the_script_exits_2_with_the_reason():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "torch"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stderr.startswith("[setup] torch")
    bad = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
