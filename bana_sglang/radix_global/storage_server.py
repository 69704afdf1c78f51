"""The dedicated storage process: the only contributor of memory to the store.

``python -m bana_sglang.radix_global.storage_server --master HOST:PORT
--segment-bytes N`` mounts one global segment of ``N`` bytes into the Mooncake
store and then only keeps it alive. Workers and the index service set up their
clients with ``global_segment_size=0``, so pages live here and survive any
worker's exit.

Why a Python process rather than the shipped ``mooncake_client`` console
script: ``mooncake_client`` (the C++ "real client" daemon) can also contribute
a segment (``-global_segment_size``, ``-master_server_address``), but it gives
no readiness signal, defaults to binding 0.0.0.0 and an HTTP metadata server,
and its log volume is hard to tame; this entry prints :data:`READY_LINE` once the
segment is mounted, binds 127.0.0.1 by default, and exits cleanly on SIGTERM.

With ``--put-listen tcp://HOST:PORT`` it also answers the storage channel
(:mod:`bana_sglang.wire.storage`, authenticated like every channel): workers on
this host frame their pages in shared-memory arenas and it puts them into its
own segment with a local copy, and it copies the pages of their loads into their
load arenas (:mod:`.shm_arena`). Every 0.5 s it unmaps the
arenas of workers whose process is gone.

Lifecycle: setup retries until the master answers (a storage process may start
before the master); after a master restart Mooncake's client re-mounts the
segment by itself (seen after ~1-2 s). Exit: SIGTERM/SIGINT -> close -> 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from bana_sglang import _cli
from bana_sglang.mooncake_env import apply_defaults
from bana_sglang.radix_global.mooncake_kv import tcp_open

logger = logging.getLogger(__name__)

READY_LINE = "bana-storage ready"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.radix_global.storage_server",
        description="Contribute one global memory segment to the Mooncake store and keep it alive.",
    )
    p.add_argument("--master", required=True, help="Mooncake master RPC address host:port")
    p.add_argument(
        "--segment-bytes",
        type=_cli.segment_size,
        default=1 << 30,
        help="segment size, e.g. 512M or 4G",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="local hostname/address Mooncake binds (default 127.0.0.1)",
    )
    p.add_argument("--metadata-server", default="P2PHANDSHAKE")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"], help="Mooncake transport")
    p.add_argument(
        "--rdma-devices",
        default="",
        help="with --protocol rdma, e.g. mlx5_0 (default: Mooncake picks)",
    )
    p.add_argument(
        "--put-listen",
        default=None,
        metavar="tcp://HOST:PORT",
        help="also serve puts from and loads into the shared-memory arenas of workers on "
        "this host (the storage channel); default: off",
    )
    p.add_argument(
        "--setup-timeout", type=float, default=60.0, help="give up if the master never answers"
    )
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", a.host)
    apply_defaults()

    from mooncake.store import MooncakeDistributedStore

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    store = MooncakeDistributedStore()
    start = time.monotonic()
    deadline, next_note = start + a.setup_timeout, start + 5.0
    while True:
        if time.monotonic() > next_note:
            logger.warning(
                "waiting for the Mooncake master at %s (%.0fs so far)",
                a.master,
                time.monotonic() - start,
            )
            next_note += 10.0
        if tcp_open(a.master):
            rc = store.setup(
                a.host, a.metadata_server, a.segment_bytes, 0, a.protocol, a.rdma_devices, a.master
            )
            if rc == 0:
                break
            logger.warning("setup against %s returned %s; retrying", a.master, rc)
            store = MooncakeDistributedStore()
        if stop.is_set() or time.monotonic() > deadline:
            logger.error("no Mooncake master at %s within %.0fs", a.master, a.setup_timeout)
            return 1
        time.sleep(0.2)
    server = host = None
    if a.put_listen:
        from bana_sglang.radix_global.shm_arena import ArenaHost
        from bana_sglang.wire import storage as channel
        from bana_sglang.wire.transport import Server

        host = ArenaHost(store)
        server = Server(channel.CHANNEL, host.handlers(), a.put_listen)
        server.start("bana-storage-put")
    puts = f" puts={server.endpoint}" if server is not None else ""
    print(f"{READY_LINE} segment={a.segment_bytes} master={a.master}{puts}", flush=True)
    while not stop.wait(0.5):  # a timed wait: signals are handled promptly
        if host is not None:
            host.reap()  # the arenas of workers that exited or were killed
    if server is not None:
        server.close()
    if host is not None:
        host.close()
    store.close()
    logger.info("storage process stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
