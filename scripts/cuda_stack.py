"""Checks of the CUDA stack that ``scripts/setup.sh`` runs (standard library only).

    python3 scripts/cuda_stack.py driver   # before installing: is the NVIDIA driver new enough?
    .venv/bin/python scripts/cuda_stack.py torch   # after: does the installed torch see a GPU?

SGLang 0.5.23 pins torch 2.14.1, whose default wheel is built for CUDA 13.0
(``+cu130``), and the CUDA 13 builds of flashinfer and sglang-kernel. A CUDA 13.0
runtime needs an NVIDIA driver of the R580 branch or newer; on an older driver the
install succeeds but torch sees no GPU. Each check exits 0, or 2 with a message
that names what it found and what it needs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

STACK = "SGLang 0.5.23's CUDA 13 stack (torch 2.14.1+cu130)"
MIN_DRIVER = (580, 0)  # CUDA 13.0 on Linux: driver branch R580 and newer


def parse_version(text: str) -> tuple[int, ...]:
    """``"580.65.06"`` -> ``(580, 65, 6)``; raises ValueError on anything else."""
    parts = text.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a driver version: {text!r}")
    return tuple(int(p) for p in parts)


def driver_version() -> str | None:
    """The driver version ``nvidia-smi`` reports, or None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [r.strip() for r in out.stdout.splitlines() if r.strip()]
    return rows[0] if out.returncode == 0 and rows else None


def check_driver(version: str | None) -> str | None:
    """Why ``version`` cannot run the stack, or None when it can."""
    need = ".".join(map(str, MIN_DRIVER))
    if version is None:
        return (
            f"no NVIDIA driver answered (nvidia-smi is missing or fails); {STACK} needs driver "
            f"{need} or newer. Install one, or set up for the CPU with BANA_DEVICE=cpu"
        )
    try:
        have = parse_version(version)
    except ValueError as e:
        return f"{e}; {STACK} needs driver {need} or newer"
    if have[: len(MIN_DRIVER)] < MIN_DRIVER:
        return (
            f"the NVIDIA driver is {version}, but {STACK} needs {need} or newer; update the "
            "driver (or set up for the CPU with BANA_DEVICE=cpu)"
        )
    return None


def check_torch() -> str | None:
    """Why the installed torch cannot use a GPU, or None when it can (then it prints which)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001  (a broken install is the answer)
        return f"torch does not import: {e}"
    cuda = torch.version.cuda
    if cuda is None:
        return f"torch {torch.__version__} is a CPU build; the CUDA wheels were not installed"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return (
            f"torch {torch.__version__} (built for CUDA {cuda}) sees no GPU; the NVIDIA driver "
            f"is {driver_version() or 'not answering'}"
        )
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(
        f"torch {torch.__version__} (CUDA {cuda}) sees {torch.cuda.device_count()} GPU(s): {names}"
    )
    return None


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    if what == "driver":
        why = check_driver(driver_version())
    elif what == "torch":
        why = check_torch()
    else:
        print("usage: cuda_stack.py driver|torch", file=sys.stderr)
        return 2
    if why:
        print(f"[setup] {why}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
