"""The CPU compatibility layer for SGLang 0.5.23: everything in one place.

Real SGLang 0.5.23 runs on a CPU-only machine after the fixes below (each was
seen to be needed, and the reason is given with it). The layer is active only when no CUDA
device is present (or ``BANA_DEVICE=cpu``); on a GPU machine every function
here returns "nothing to do", so the CUDA path stays stock.

Process-level (environment of every SGLang process, set by the launcher via
:func:`child_env`, inherited by SGLang's children):

1. ``SGLANG_USE_CPU_ENGINE=1`` (with ``--device cpu``): else ``is_cpu()`` is
   false and rotary embedding tries to import vllm.
2. ``pypath/`` first on ``PYTHONPATH``: the ``sgl_kernel`` stand-in (one real
   kernel, loud errors for the rest) and a ``sitecustomize`` that defines the
   ``torchvision::nms``/``qnms`` schemas torchvision's import needs.
3. PD over Mooncake TCP on loopback: ``SGLANG_HOST_IP``, ``MOONCAKE_PROTOCOL=tcp``,
   ``MC_TCP_BIND_ADDRESS``; ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``
   (a prefix hit otherwise takes a CUDA-stream-only path).

Server arguments (:func:`server_args`): ``--device cpu``, ``--attention-backend
bana_cpu`` (the extension's CPU attention, whose extend cost follows the new
tokens; see :mod:`bana_sglang.attention`; ``BANA_CPU_ATTENTION=stock`` selects
SGLang's ``torch_native`` instead, to measure the stock path; read by
:func:`cpu_attention_backend`), ``--sampling-backend pytorch``, a bounded
``--max-total-tokens`` (else the KV pool takes ~15 GB), and on decode
``--disaggregation-decode-retraction-backup cpu_tensor`` (else a pinned host
pool needs an NVIDIA driver).

In-process (:func:`apply_in_process_fixes`, run by the SGLang plugin in every
SGLang process): ``MooncakeKVSender.supports_host_tensor_indices = False``,
else prefill uses pinned memory and ``torch.cuda.Event``; and
``mem_cache.allocation.get_last_loc`` always takes its torch path (SGLang picks
it only for the ``torch_native``/``ascend`` backends, so ``bana_cpu`` with
``--page-size > 1`` would launch a Triton kernel).

Idle CPU (measured: an idle tiny-model server takes a whole core, ~100% CPU,
because the scheduler loop spins; four of them on a two-core machine slow
everything else several times): the CPU layer passes ``--sleep-on-idle`` and
shortens SGLang's idle wait (``IdleSleeper``, a ZMQ poll of 1000 ms) to
``BANA_IDLE_POLL_MS`` (default 5 ms). SGLang sleeps only when fully idle; a
scheduler whose requests wait for a bootstrap handshake or a KV transfer has no
batch to run and still spins (``on_idle`` returns after a ``time.sleep(0)``):
a decode worker spins a whole core through every request's prefill. The CPU
layer makes it wait the same short time on its sockets
(:func:`wait_while_waiting_hook`). Those PD events do not arrive on the polled
sockets, so a 1 s wait would add up to 1 s per step; 5 ms bounds the added
latency per step while the spinning stops.
``BANA_IDLE_POLL_MS=0`` restores the stock spin.
Those 200 wake-ups a second still cost an idle scheduler about 15% of a core
(measured: three idle tiny-model schedulers of a 2P1D cluster, 150-160 ms of
CPU per second each), so a scheduler that holds no request at all and no
migration waits ``BANA_IDLE_SLEEP_MS`` (default 100 ms) instead
(:func:`sleep_on_idle_hook`): what can arrive then comes on a polled socket
(SGLang's own, and the migration agent's, which the agent registers).

Start-up (measured: a single tiny-model server up in 39.5 s with ``spawn``,
19.7 s with ``fork``, same tokens): SGLang sets the ``spawn`` start method,
which CUDA needs, so its scheduler and detokenizer each import torch and SGLang
again. On CPU the plugin switches the start method to ``fork`` right after
SGLang set it (:func:`start_method`, ``BANA_CPU_START_METHOD``): the children
inherit the modules the server process imported, the CPU fixes included. At
that point the server process runs no Python thread but its main one and has
opened no ZMQ context (checked), and each child makes its own sockets, so
nothing half-held is copied. Serving speed is unchanged: a forked and a spawned
server side by side, 12 greedy answers of 200 tokens after a 1500-token prompt
each, sent alternately, took 2.62 and 2.56 s (medians; the runs overlap).
``BANA_CPU_START_METHOD=spawn`` keeps SGLang's.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from bana_sglang import envs
from bana_sglang.attention.registry import BACKEND_NAME

logger = logging.getLogger(__name__)

PYPATH_DIR = Path(__file__).resolve().parent / "pypath"
DEFAULT_MAX_TOTAL_TOKENS = 32768
DEFAULT_IDLE_POLL_MS = envs.BANA_IDLE_POLL_MS.default


def idle_poll_ms() -> int:
    """Idle wait of an SGLang scheduler on CPU (``BANA_IDLE_POLL_MS``; 0: stock spin)."""
    return envs.BANA_IDLE_POLL_MS.get()


def _idle_poller(scheduler):
    """The ZMQ poller over the scheduler's sockets (``--sleep-on-idle``), or None."""
    return getattr(getattr(scheduler, "idle_sleeper", None), "poller", None)


def sleep_on_idle_hook(original, scheduler, *args, short_ms: int, long_ms: int, **kwargs):
    """AROUND hook on ``Scheduler.maybe_sleep_on_idle`` (CPU layer): a scheduler that
    holds no request (SGLang's ``is_fully_idle``) and whose extension parts have
    nothing under way (``scheduler._bana_keep_awake``: the migration agent's
    ``busy``) waits ``long_ms`` on its sockets; otherwise ``short_ms``, for PD events
    that do not arrive on them. New requests arrive on SGLang's polled sockets and
    agent commands on the agent's socket, registered with the same poller."""
    poller = _idle_poller(scheduler)
    if poller is None:
        return original(scheduler, *args, **kwargs)
    rest = scheduler.is_fully_idle() and not any(
        busy() for busy in getattr(scheduler, "_bana_keep_awake", ())
    )
    poller.poll(long_ms if rest else short_ms)
    return None


def wait_while_waiting_hook(original, scheduler, *args, short_ms: int, **kwargs):
    """AROUND hook on ``Scheduler.on_idle`` (CPU layer). With no batch to run but
    requests in its PD queues (bootstrap, pre-allocation, KV transfer), SGLang
    0.5.23's scheduler is not "fully idle": ``on_idle`` returns after a
    ``time.sleep(0)`` and the loop comes straight back, spinning a core for as long
    as a request waits for its KV (on a decode worker: every request's whole
    prefill; measured, the decode scheduler's main thread took ~1 s of CPU per
    1400-token prompt on ``small``). Such a scheduler waits ``short_ms`` on its
    sockets: a new request wakes it at once, a transfer's end (which SGLang polls)
    is seen at most ``short_ms`` late."""
    poller = _idle_poller(scheduler)
    if poller is None:
        return original(scheduler, *args, **kwargs)
    waiting = not scheduler.is_fully_idle()
    out = original(scheduler, *args, **kwargs)
    if waiting:
        poller.poll(short_ms)
    return out


def start_method() -> str:
    """How SGLang starts its children on CPU (``BANA_CPU_START_METHOD``)."""
    return envs.BANA_CPU_START_METHOD.get()


STOCK_CPU_ATTENTION = "torch_native"


def cpu_attention_backend() -> str:
    """The default ``--attention-backend`` on CPU, from ``BANA_CPU_ATTENTION``.

    ``bana`` (default, also when unset or empty): the extension's ``bana_cpu``
    backend; ``stock``: SGLang's ``torch_native``. Read when the flags are built.
    """
    if envs.BANA_CPU_ATTENTION.get() == "stock":
        return STOCK_CPU_ATTENTION
    return BACKEND_NAME


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """True when torch sees a CUDA device. Cached: it never changes in a process."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install is not a GPU
        logger.debug("torch.cuda probe failed", exc_info=True)
        return False


class GpuUnusable(RuntimeError):
    """A GPU is present but torch cannot use it: the CPU layer is not taken silently."""


@functools.lru_cache(maxsize=1)
def visible_gpus() -> tuple[int, str | None]:
    """(GPUs ``nvidia-smi`` lists, the driver's version), or (0, None) without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0, None
    rows = [r.strip() for r in out.stdout.splitlines() if r.strip()]
    return (len(rows), rows[0]) if out.returncode == 0 and rows else (0, None)


def cpu_mode() -> bool:
    """Whether the CPU layer applies: ``BANA_DEVICE`` (cpu|cuda) wins, else no CUDA.

    A machine whose GPUs ``nvidia-smi`` lists but torch cannot use (a driver too old for
    torch's CUDA build, say) raises :class:`GpuUnusable` naming both instead of falling
    back to the CPU layer: ``BANA_DEVICE=cpu`` asks for that on purpose."""
    forced = envs.BANA_DEVICE.get()
    if forced:
        return forced == "cpu"
    if cuda_available():
        return False
    n, driver = visible_gpus()
    if n:
        try:
            import torch

            build = f"torch {torch.__version__} (built for CUDA {torch.version.cuda})"
        except Exception:  # noqa: BLE001  (a broken torch: say so, do not crash on it)
            build = "torch"
        raise GpuUnusable(
            f"nvidia-smi lists {n} GPU(s) with driver {driver}, but {build} cannot use them: "
            "the driver is too old for that CUDA build (CUDA 13 needs driver 580 or newer), or "
            "the install is broken. Update the driver, or run on the CPU on purpose with "
            "BANA_DEVICE=cpu"
        )
    return True


def child_env(base: Mapping[str, str] | None = None, *, host: str = "127.0.0.1") -> dict[str, str]:
    """The environment for an SGLang process: ``base`` plus the CPU fixes when on CPU.

    Values the caller already set win (an operator can override any of them),
    except ``PYTHONPATH``, which gets ``pypath/`` prepended.
    """
    env = dict(os.environ if base is None else base)
    # Mooncake's glog is very chatty and binds the first non-loopback NIC unless told;
    # its TCP admission limits are raised (see bana_sglang.mooncake_env).
    from bana_sglang.mooncake_env import apply_defaults

    apply_defaults(env)
    env.setdefault("MC_TCP_BIND_ADDRESS", host)
    env.setdefault("SGLANG_HOST_IP", host)
    if not cpu_mode():
        return env
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    env.setdefault("MOONCAKE_PROTOCOL", "tcp")
    env.setdefault("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "0")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(PYPATH_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(PYPATH_DIR), *parts])
    return env


def cpu_threads(workers_here: int, threads: int = 0) -> int:
    """OpenMP threads of each SGLang worker on a CPU machine: ``threads``, or this
    process's CPUs divided among the ``workers_here`` workers (at least 1).

    The default of torch (every core in every worker) oversubscribes a machine
    that runs several workers: measured on 2 cores with a 1P1D cluster, decode
    steps during a 2048-token prefill took 0.24 s with 2 threads per worker
    against 0.095 s with 1 (docs/RESULTS.md, "CPU threads per worker")."""
    if threads < 0:
        raise ValueError(f"--cpu-threads {threads}: give a positive count, or 0 for automatic")
    if threads:
        return threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, workers_here))


def with_cpu_threads(env: dict[str, str], workers_here: int, threads: int = 0) -> dict[str, str]:
    """``env`` with ``OMP_NUM_THREADS`` set for CPU workers (an operator's own value wins;
    nothing changes on GPU machines)."""
    if cpu_mode() and "OMP_NUM_THREADS" not in env:
        env = {**env, "OMP_NUM_THREADS": str(cpu_threads(workers_here, threads))}
    return env


def server_args(role: str, *, user_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """SGLang flags the CPU needs for a worker of ``role`` (prefill|decode|null).

    A flag already present in ``user_args`` is not added again, so users can
    override any default (e.g. ``--max-total-tokens``).
    """
    if role not in ("prefill", "decode", "null"):
        raise ValueError(f"role must be prefill, decode or null, got {role!r}")
    if not cpu_mode():
        return []
    present = {a.split("=", 1)[0] for a in user_args if a.startswith("--")}
    wanted: list[tuple[str, str | None]] = [
        ("--device", "cpu"),
        ("--attention-backend", cpu_attention_backend()),
        ("--sampling-backend", "pytorch"),
        ("--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)),
    ]
    if role == "decode":
        wanted.append(("--disaggregation-decode-retraction-backup", "cpu_tensor"))
    if idle_poll_ms() > 0:
        wanted.append(("--sleep-on-idle", None))
    out: list[str] = []
    for flag, value in wanted:
        if flag not in present:
            out += [flag] if value is None else [flag, value]
    return out


def in_cpu_sglang_process() -> bool:
    """True inside an SGLang process that the CPU layer configured."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return False
    try:
        return cpu_mode()
    except GpuUnusable:  # the launcher refused this machine already; SGLang says the rest
        return False


def apply_in_process_fixes() -> list[str]:
    """Patch SGLang in this process for CPU PD; returns the names of the fixes applied."""
    if not in_cpu_sglang_process():
        return []
    applied: list[str] = []
    try:
        from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
    except ImportError:  # no Mooncake wheel: PD over Mooncake is unavailable anyway
        logger.info("mooncake PD backend not importable; skipping its CPU fix", exc_info=True)
    else:
        mooncake_conn.MooncakeKVSender.supports_host_tensor_indices = False
        applied.append("MooncakeKVSender.supports_host_tensor_indices=False")
    try:
        from sglang.srt.mem_cache import allocation
    except ImportError:
        logger.info(
            "SGLang's allocation module moved; paged KV on CPU may reach Triton", exc_info=True
        )
    else:
        # get_last_loc takes its torch path only for the "torch_native" and "ascend"
        # backends; with bana_cpu (and --page-size > 1) it would launch a Triton kernel.
        allocation.get_last_loc = lambda req_to_token, req_pool_indices, prefix_lens: (
            allocation.get_last_loc_torch(req_to_token, req_pool_indices, prefix_lens)
        )
        applied.append("allocation.get_last_loc uses torch")
    ms = idle_poll_ms()
    if ms > 0:
        try:
            from sglang.srt.managers.scheduler_components.idle_sleeper import (
                IdleSleeper,
            )
        except ImportError:
            logger.info(
                "SGLang has no IdleSleeper here; idle schedulers keep spinning", exc_info=True
            )
        else:

            def maybe_sleep(self, _ms=ms):  # no device cache to empty on CPU
                self.poller.poll(_ms)

            IdleSleeper.maybe_sleep = maybe_sleep
            applied.append(f"IdleSleeper.maybe_sleep polls {ms} ms")
    return applied
