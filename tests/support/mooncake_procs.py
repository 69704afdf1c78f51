"""A real ``mooncake_master`` and storage process on 127.0.0.1 for the live store tests."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from support.cluster import free_port

from bana_sglang.launch.procs import ManagedProcess, tcp_open, wait_until
from bana_sglang.mooncake_env import master_binary
from bana_sglang.radix_global.storage_server import READY_LINE as STORAGE_READY

ENV = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_LOG_LEVEL="ERROR")


class Mooncake:
    """One master and one storage process; the master can be killed and restarted."""

    def __init__(self, segment: str = "64M", master_args: tuple[str, ...] = ()) -> None:
        self.segment, self.master_args = segment, master_args
        self.rpc, self.metrics = free_port(), free_port()
        self.addr = f"127.0.0.1:{self.rpc}"
        self.puts = f"tcp://127.0.0.1:{free_port()}"  # the storage process's put endpoint
        self.master: ManagedProcess | None = None
        self.storage: ManagedProcess | None = None
        self.generation = 0

    def start_master(self) -> None:
        self.generation += 1
        self.master = ManagedProcess(
            f"mooncake-master-{self.generation}",
            [
                master_binary(),
                f"-rpc_port={self.rpc}",
                "-rpc_address=127.0.0.1",
                f"-metrics_port={self.metrics}",
                "-metrics_host=127.0.0.1",
                "-enable_http_metadata_server=false",
                "-minloglevel=2",
                "-default_kv_lease_ttl=1000",
                *self.master_args,
            ],
            env=ENV,
        )
        self.master.start()
        wait_until(
            lambda: tcp_open("127.0.0.1", self.rpc, 0.2),
            proc=self.master,
            what="the master's RPC port",
            timeout=30,
            interval=0.05,
        )

    def kill_master(self) -> None:
        assert self.master
        self.master.kill()
        self.master.reap()

    def start_storage(self) -> None:
        self.storage = ManagedProcess(
            "bana-storage",
            [
                sys.executable,
                "-m",
                "bana_sglang.radix_global.storage_server",
                "--master",
                self.addr,
                "--segment-bytes",
                self.segment,
                "--put-listen",
                self.puts,
                "--log-level",
                "WARNING",
            ],
            env=ENV,
        )
        self.storage.start()
        wait_until(
            lambda: any(STORAGE_READY in x for x in self.storage.tail()),
            proc=self.storage,
            what="the ready line",
            timeout=60,
            interval=0.05,
        )

    def stop(self) -> None:
        for p in (self.storage, self.master):
            if p is not None:
                p.stop(timeout=10)


@contextlib.contextmanager
def master_and_storage() -> Iterator[Mooncake]:
    """A started master and storage process on 127.0.0.1, stopped on exit."""
    mc = Mooncake()
    try:
        mc.start_master()
        mc.start_storage()
        yield mc
    finally:
        mc.stop()
