"""The storage channel against a real ``mooncake_master`` and storage process on
127.0.0.1: pages a worker publishes through its shared-memory arena are read back
exactly, a load through the storage process lands them (repeated pages included)
in other pool pages, and the arena of a killed worker is unmapped."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from support.cluster import free_port
from support.mooncake_procs import ENV, Mooncake, master_and_storage
from support.radix_index import index_service

from bana_sglang.launch.procs import wait_until
from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.radix_global.mooncake_kv import StoreConfig
from bana_sglang.radix_global.store import PageStore

pytestmark = pytest.mark.slow

LAYOUT = KVLayout("store-test", "float32", page_size=4, num_kv_heads=2, head_dim=8, num_layers=2)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[Mooncake]:
    with master_and_storage() as mc:
        yield mc


def test_pages_published_through_the_storage_process_are_read_back_exactly(mooncake):
    """A worker on the storage process's host frames its pages in a shared-memory arena
    and the real storage process puts them into its segment (a local copy): another
    client reads every page back, verified, equal to the pool's rows; the worker's own
    Mooncake client put nothing. A load through the storage process (one whole-page get
    into a shared arena) lands the same rows in other pool pages."""
    from bana_sglang.radix_global.loader import Loader
    from bana_sglang.radix_global.pool import Arena, KVPool
    from bana_sglang.radix_global.publisher import Offload, Publisher
    from bana_sglang.radix_global.shm_arena import LocalLoads

    n = 6
    g = torch.Generator().manual_seed(5)
    shape = ((n + 1) * LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    pool = KVPool(
        [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)],
        [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)],
        LAYOUT.page_size,
    )
    port = free_port()
    rounds = []
    cfg = StoreConfig(master_addr=mooncake.addr, probe_interval_s=0.2)
    with index_service(port, "--capacity-bytes", str(8 << 20), "--master", mooncake.addr):
        ep = f"tcp://127.0.0.1:{port}"
        pub = Publisher(
            pool,
            lambda: PageStore.connect(LAYOUT, cfg),
            IndexClient(ep, timeout_s=5, name="w/publish"),
            "w-local",
            arena_bytes=1 << 20,
            storage=mooncake.puts,
            on_round=rounds.append,
        )
        chain = page_chain(range(5000, 5000 + n * LAYOUT.page_size), LAYOUT)
        pub.submit(Offload(list(chain), None, torch.arange(1, n + 1)))
        pub.join()
        assert pub.results.get_nowait() is True
        assert rounds[-1].written == rounds[-1].local_pages == n
        reader = PageStore.connect(LAYOUT, cfg)
        for i, page in enumerate(chain):
            rows = slice(LAYOUT.page_size * (i + 1), LAYOUT.page_size * (i + 2))
            want = torch.stack(
                [torch.stack([pool.k[j][rows], pool.v[j][rows]]) for j in range(LAYOUT.num_layers)]
            )
            assert torch.equal(reader.get_page(page), want)
        # ... and loaded back through it: whole pages copied into the load arena by the
        # real storage process, then layer by layer into other pool pages
        pool2 = KVPool(
            [torch.zeros(shape) for _ in range(LAYOUT.num_layers)],
            [torch.zeros(shape) for _ in range(LAYOUT.num_layers)],
            LAYOUT.page_size,
        )
        local = LocalLoads(mooncake.puts, "w-local/load", 1 << 20)
        gets = []
        real_get = local.get
        local.get = lambda *a: gets.append(a) or real_get(*a)
        loader = Loader(pool2, "staged", Arena(pool2.device, 1 << 20, reader.kv), local=local)
        read = reader.layerwise(chain, headers_inline=True)
        assert read.start() is None
        released = []
        dst = torch.arange(n, 0, -1)
        miss, _ = loader.load(read, dst, lambda layer, ev: released.append(layer))
        assert miss is None and len(gets) == 1
        assert released == list(range(LAYOUT.num_layers - 1))

        def assert_loaded(pages, dst):
            for page, d in zip(pages, dst.tolist()):
                i = chain.index(page)
                src = slice(LAYOUT.page_size * (i + 1), LAYOUT.page_size * (i + 2))
                got = slice(LAYOUT.page_size * d, LAYOUT.page_size * (d + 1))
                for j in range(LAYOUT.num_layers):
                    assert torch.equal(pool2.k[j][got], pool.k[j][src])
                    assert torch.equal(pool2.v[j][got], pool.v[j][src])

        assert_loaded(chain, dst)
        # pages asked for twice in one load (two requests with one prefix): each place
        # gets its page, though Mooncake's batch get fills only a key's last place
        twice = chain[:3] + chain[:3]
        for b in pool2.buffers():
            b.zero_()
        read = reader.layerwise(twice, headers_inline=True)
        assert read.start(session=False) is None
        miss, _ = loader.load(read, torch.arange(1, n + 1), lambda layer, ev: None)
        assert miss is None and len(gets) == 2
        assert_loaded(twice, torch.arange(1, n + 1))
        local.close()
        reader.kv.close()
        pub.close()


WORKER_THAT_MAPS = """
import sys, time
from bana_sglang.radix_global.shm_arena import LocalStorage, SharedArena
arena = SharedArena(1 << 20)
LocalStorage(sys.argv[1], "w-killed").map(arena)
arena.unlink()
print(arena.path, flush=True)
time.sleep(120)
"""


def _mapped_by(pid: int, path: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any(path in line for line in f)


def test_the_arena_of_a_killed_worker_is_unmapped_by_the_storage_process(mooncake):
    """A worker process maps its arena into the real storage process and is killed:
    within a few seconds the storage process no longer maps the file."""
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER_THAT_MAPS, mooncake.puts],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        path = worker.stdout.readline().strip()
        assert path.startswith("/dev/shm/bana-arena-"), path
        storage = mooncake.storage.pid
        assert storage and _mapped_by(storage, path)
        worker.kill()
        worker.wait()
        wait_until(
            lambda: not _mapped_by(storage, path),
            proc=mooncake.storage,
            what="the storage process to unmap the killed worker's arena",
            timeout=10,
            interval=0.1,
        )
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.stdout.close()
