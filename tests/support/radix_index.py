"""The global index service as a real process, for the unit and live tests of the store."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from bana_sglang.launch.procs import ManagedProcess, wait_until
from bana_sglang.radix_global.service import READY_LINE


@contextlib.contextmanager
def index_service(port: int, *extra: str, name: str = "radix-index") -> Iterator[ManagedProcess]:
    """``python -m bana_sglang.radix_global.service --port PORT *extra`` until the block ends."""
    proc = ManagedProcess(
        name,
        [sys.executable, "-m", "bana_sglang.radix_global.service", "--port", str(port), *extra],
    )
    proc.start()
    try:
        wait_until(
            lambda: any(READY_LINE in line for line in proc.tail()),
            proc=proc,
            what="the ready line",
            timeout=60,
            interval=0.05,
        )
        yield proc
    finally:
        proc.stop(timeout=10)
