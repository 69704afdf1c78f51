"""Shared fixtures. Tests run on CPU by default; GPU tests are marked ``gpu``
and skipped without CUDA; tests that start real SGLang processes are marked
``slow`` (they still run in CI: real parts, really run)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bana_sglang import models
from bana_sglang.launch import READY_MARK, Cluster, plan_single_server
from bana_sglang.launch.procs import PortAllocator

# Every SGLang process of the suite (the plain reference server and the
# clusters' workers) computes with one OpenMP thread: the same floats whatever
# the machine's core count, and no oversubscription of a small CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "bench" / "data" / "traces"

# One allocator per test session: above the launcher's default ports (30000+)
# and below the kernel's ephemeral range (32768+), where an outgoing
# connection could take a planned port before its server binds it.
_PORTS = PortAllocator("127.0.0.1", 30400 + (os.getpid() % 4) * 500, spacing=3)


def free_port() -> int:
    return _PORTS.take()


def free_port_block(n: int = 40) -> int:
    """First of ``n`` consecutive ports reserved for a launcher's own allocator."""
    return _PORTS.take_block(n)


LIVE = Path(__file__).resolve().parent / "live"


def pytest_collection_modifyitems(config, items):
    for item in items:  # everything under tests/live/ starts real servers
        if Path(str(item.fspath)).is_relative_to(LIVE):
            item.add_marker(pytest.mark.slow)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The embedded tiny Llama (built once, cached)."""
    return models.build("tiny")


@contextlib.contextmanager
def sglang_server(
    model_path: str | Path | None = None,
    *,
    sglang_args: tuple[str, ...] = (),
    log_dir: Path | None = None,
    name: str = "server",
) -> Iterator[str]:
    """A real single SGLang server with the extension loaded; yields its base URL."""
    plan = plan_single_server(
        str(model_path) if model_path else None,
        port=free_port(),
        sglang_args=sglang_args,
        name=name,
    )
    with Cluster(plan, log_dir=log_dir, startup_timeout=900):
        yield plan.endpoint


@pytest.fixture(scope="session")
def single_server(tiny_model: Path, tmp_path_factory) -> Iterator[str]:
    """One plain SGLang server on the tiny model, shared by the whole session:
    the reference for every "same tokens as a plain run" check."""
    with sglang_server(
        tiny_model, log_dir=tmp_path_factory.getbasetemp() / "single-logs", name="single"
    ) as url:
        yield url


@dataclasses.dataclass
class LaunchedCluster:
    """``python -m bana_sglang.launch`` running as a subprocess."""

    url: str
    proc: subprocess.Popen
    lines: list[str]
    log_dir: Path


@contextlib.contextmanager
def launched_cluster(
    args: list[str], log_dir: Path, timeout: float = 900, env: dict[str, str] | None = None
) -> Iterator[LaunchedCluster]:
    """Start the launcher with ``args`` (ports chosen here) and ``env`` added to
    this process's environment, wait for its ready line, yield, then SIGTERM it
    unless a test already stopped it."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bana_sglang.launch",
            "--port",
            str(port),
            "--worker-base-port",
            str(free_port_block()),
            "--log-dir",
            str(log_dir),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip())
            if READY_MARK in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.is_set() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if not ready.is_set():
        proc.kill()
        proc.wait(timeout=60)
        pytest.fail("cluster did not start:\n" + "\n".join(lines[-40:]))
    try:
        yield LaunchedCluster(
            url=f"http://127.0.0.1:{port}", proc=proc, lines=lines, log_dir=log_dir
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
