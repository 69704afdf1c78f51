"""The global store's three processes on 127.0.0.1, for benchmarks and tests of its data path.

:func:`local_store` starts ``mooncake_master``, the storage process (with its
storage channel, as the launcher starts it) and (unless told not to) the index
service with the launcher's own command lines (:mod:`bana_sglang.launch.parts`),
waits until each is ready, and stops all of them when the block ends, also on an
error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

from bana_sglang import mooncake_env
from bana_sglang.launch.parts import master_part, storage_endpoint, store_parts
from bana_sglang.launch.procs import ManagedProcess, PortAllocator, stop_all, tcp_open, wait_until


@dataclasses.dataclass(frozen=True)
class LocalStore:
    master: str  # host:port of the master's RPC
    metrics: str  # host:port of the master's metrics (HTTP /metrics)
    index: str | None  # tcp://host:port of the index service
    procs: tuple[ManagedProcess, ...]
    storage: str | None = None  # the storage channel (shared-memory puts and loads)


@contextlib.contextmanager
def local_store(
    segment_bytes: int = 512 << 20,
    *,
    index: bool = True,
    log_dir: Path | None = None,
    first_port: int = 33000,
) -> Iterator[LocalStore]:
    host = "127.0.0.1"
    ports = PortAllocator(host, first_port)
    rpc, metrics, index_port, put_port = ports.take(), ports.take(), ports.take(), ports.take()
    env = dict(os.environ)
    mooncake_env.apply_defaults(env)
    env.setdefault("MC_TCP_BIND_ADDRESS", host)
    master = master_part(host, rpc, metrics, for_store=True)
    storage, idx = store_parts(
        host, host, f"{host}:{rpc}", index_port, segment_bytes, put_port=put_port
    )
    procs: list[ManagedProcess] = []
    try:
        m = ManagedProcess("mooncake-master", master.argv, env, log_dir=log_dir)
        m.start()
        procs.append(m)
        wait_until(
            lambda: tcp_open(host, rpc, 0.2), proc=m, what="the master's RPC port", timeout=60
        )
        for part in (storage, idx) if index else (storage,):
            p = ManagedProcess(part.name, part.argv, env, log_dir=log_dir)
            p.start()
            procs.append(p)
            line = part.ready_line
            assert line is not None
            wait_until(
                lambda p=p, line=line: any(line in x for x in p.tail()),
                proc=p,
                what="its ready line",
                timeout=120,
                interval=0.05,
            )
        yield LocalStore(
            f"{host}:{rpc}",
            f"{host}:{metrics}",
            f"tcp://{host}:{index_port}" if index else None,
            tuple(procs),
            storage_endpoint(put_port),
        )
    finally:
        stop_all(procs[::-1], timeout=10)
