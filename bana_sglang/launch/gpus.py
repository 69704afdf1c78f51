"""GPU workers on one machine: what the machine has, and where each worker goes.

- :func:`detect`: the GPU inventory (``nvidia-smi``: GPUs and the driver), and
  whether an RDMA device is present (``/sys/class/infiniband``), which decides
  Mooncake's transport (``tcp`` without one: SGLang's default ``rdma`` fails);
- :func:`place`: a GPU for each worker, round robin (``--base-gpu-id``), and,
  where workers outnumber GPUs, a share of the GPU's memory for each worker
  sharing one (``--mem-fraction-static``): SGLang sizes a worker's KV pool from
  the GPU memory it sees, so a second worker started with the default runs out
  of memory;
- :func:`worker_flags`: the SGLang flags of one worker, the user's own flags
  winning.

:func:`place` and :func:`worker_flags` are pure (the plan's tests state an
inventory, they do not need a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Sequence

#: Of a GPU's memory, what the workers sharing it take for weights and KV together
#: (SGLang's own default for one worker on an 80-141 GB GPU is about 0.85-0.9).
SHARED_FRACTION = 0.85


@dataclasses.dataclass(frozen=True)
class GpuInventory:
    count: int  # GPUs this process may use
    rdma: bool = False  # an RDMA device is present
    driver: str | None = None  # the NVIDIA driver's version, when nvidia-smi answered

    @property
    def transport(self) -> str:
        """Mooncake's transport on this machine."""
        return "rdma" if self.rdma else "tcp"


def rdma_present(root: str = "/sys/class/infiniband") -> bool:
    try:
        return bool(os.listdir(root))
    except OSError:
        return False


def detect(timeout_s: float = 10.0) -> GpuInventory:
    """The GPUs ``nvidia-smi`` lists (honouring ``CUDA_VISIBLE_DEVICES``) and the driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return GpuInventory(0, rdma_present())
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired):
        return GpuInventory(0, rdma_present())
    rows = [r.split(",") for r in out.stdout.strip().splitlines() if r.strip()]
    if out.returncode != 0 or not rows:
        return GpuInventory(0, rdma_present())
    count = len(rows)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return GpuInventory(count, rdma_present(), rows[0][1].strip() if len(rows[0]) > 1 else None)


def place(workers: int, gpus: int) -> list[tuple[int, float | None]]:
    """(GPU, memory fraction or None for SGLang's default) of each of ``workers`` workers on
    ``gpus`` GPUs: round robin; the workers sharing a GPU split :data:`SHARED_FRACTION`."""
    if gpus < 1:
        raise ValueError("placing GPU workers needs at least one GPU")
    per_gpu = [len(range(g, workers, gpus)) for g in range(gpus)]
    out = []
    for i in range(workers):
        g = i % gpus
        share = per_gpu[g]
        out.append((g, None if share == 1 else int(SHARED_FRACTION / share * 1000) / 1000))
    return out


def given(user_args: Sequence[str], flag: str) -> bool:
    """Whether the user's SGLang arguments carry ``flag`` (``--flag v`` or ``--flag=v``)."""
    return any(a == flag or a.startswith(flag + "=") for a in user_args)


def worker_flags(gpu: int, fraction: float | None, user_args: Sequence[str]) -> list[str]:
    """``--base-gpu-id`` and ``--mem-fraction-static`` for one worker, unless the user gave them."""
    out: list[str] = []
    if not given(user_args, "--base-gpu-id"):
        out += ["--base-gpu-id", str(gpu)]
    if fraction is not None and not given(user_args, "--mem-fraction-static"):
        out += ["--mem-fraction-static", f"{fraction:g}"]
    return out
