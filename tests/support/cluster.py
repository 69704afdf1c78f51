"""Real SGLang processes for the tests: ports, a single server, a launched cluster.

One port allocator per test session (this module is imported once): above the
launcher's default ports (30000+) and below the kernel's ephemeral range
(32768+), where an outgoing connection could take a planned port before its
server binds it.
"""

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

from bana_sglang.launch import READY_MARK, Cluster, plan_single_server
from bana_sglang.launch.procs import PortAllocator

_PORTS = PortAllocator("127.0.0.1", 30400 + (os.getpid() % 4) * 500, spacing=3)


def free_port() -> int:
    return _PORTS.take()


def free_port_block(n: int = 40) -> int:
    """First of ``n`` consecutive ports reserved for a launcher's own allocator."""
    return _PORTS.take_block(n)


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
