"""Publishing through the storage process (``shm_arena``): a worker's shared-memory
arena, the storage channel over real ZMQ on 127.0.0.1, the storage process's checks
on what it maps, and the direct put a worker falls back to. The storage process's
Mooncake client is a fake here (the live test in ``tests/live/test_page_store.py``
runs the real one)."""

from __future__ import annotations

import ctypes
import glob
import os
import stat
import subprocess
import sys

import pytest
import torch
from support.fake_mooncake import FakeIndex, FakeKV

from bana_sglang.radix_global import publisher as publisher_mod
from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.radix_global.mooncake_kv import page_key
from bana_sglang.radix_global.pool import KVPool
from bana_sglang.radix_global.publisher import Offload, Publisher
from bana_sglang.radix_global.shm_arena import (
    SHM_DIR,
    ArenaHost,
    LocalPut,
    LocalPutError,
    SharedArena,
    process_start,
)
from bana_sglang.radix_global.store import PageStore
from bana_sglang.wire import storage as m
from bana_sglang.wire.transport import Client, Server

LAYOUT = KVLayout("shm-arena", "float32", page_size=4, num_kv_heads=2, head_dim=8, num_layers=3)
KEY = b"s" * 32
N = 5


class FakeNative:
    """The storage process's ``MooncakeDistributedStore``, as far as ArenaHost uses it."""

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}
        self.objects: dict[str, bytes] = {}
        self.unregistered: list[int] = []

    def register_buffer(self, ptr: int, n: int) -> int:
        self.regions[ptr] = n
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        del self.regions[ptr]
        self.unregistered.append(ptr)
        return 0

    def batch_put_from(self, keys, ptrs, sizes) -> list[int]:
        for k, p, s in zip(keys, ptrs, sizes):
            assert any(r <= p and p + s <= r + n for r, n in self.regions.items())
            self.objects[k] = ctypes.string_at(p, s)
        return [0] * len(keys)


class Storage:
    """An ArenaHost answering the storage channel on a thread (restartable on one port)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.native = FakeNative()
        self.host = ArenaHost(self.native)
        self.server = Server(m.CHANNEL, self.host.handlers(), endpoint).start("test-storage")
        self.endpoint = self.server.endpoint

    def stop(self) -> None:
        self.server.close()
        self.host.close()


@pytest.fixture
def storage():
    s = Storage()
    yield s
    s.stop()


def make_pool() -> KVPool:
    g = torch.Generator().manual_seed(3)
    shape = ((2 * N + 1) * LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k = [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]
    v = [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]
    return KVPool(k, v, LAYOUT.page_size)


def arenas_in_shm() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, "bana-arena-*")))


def publisher(pool: KVPool, kv: FakeKV, index: FakeIndex, storage: str, **kw) -> Publisher:
    """A worker's publish thread over the fake client, publishing through ``storage``."""
    return Publisher(
        pool,
        lambda: PageStore(LAYOUT, kv, mac_key=KEY),
        index,
        "w",
        arena_bytes=1 << 20,
        storage=storage,
        **kw,
    )


def publish(pub: Publisher, chain, ids) -> bool:
    pub.submit(Offload(list(chain), None, ids))
    pub.join()
    return pub.results.get_nowait()


def assert_pages(objects: dict[str, bytes], chain, pool: KVPool, ids) -> None:
    """Every object is the framed page of the pool's rows (verified as the store reads it)."""
    kv = FakeKV()
    kv.objects.update(objects)
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    for page, pid in zip(chain, ids.tolist()):
        rows = slice(LAYOUT.page_size * pid, LAYOUT.page_size * (pid + 1))
        want = torch.stack(
            [torch.stack([pool.k[i][rows], pool.v[i][rows]]) for i in range(LAYOUT.num_layers)]
        )
        assert torch.equal(store.get_page(page), want)


def test_pages_go_through_the_storage_process_and_nothing_is_left_in_dev_shm(storage):
    before = arenas_in_shm()
    pool, index, kv = make_pool(), FakeIndex(), FakeKV()
    pub = publisher(pool, kv, index, storage.endpoint)
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    ids = torch.arange(1, N + 1)
    assert publish(pub, chain, ids) is True
    assert "put" not in kv.calls, "the worker's own client put nothing"
    assert set(storage.native.objects) == {page_key(p) for p in chain}
    assert index.present == set(chain)
    assert_pages(storage.native.objects, chain, pool, ids)
    assert storage.host.arenas == 1
    assert arenas_in_shm() == before, "the arena's file is unlinked once both mapped it"
    pub.close()


def _file(path: str, nbytes: int, mode: int = 0o600) -> str:
    with open(path, "wb") as f:
        f.truncate(nbytes)
    os.chmod(path, mode)
    return path


def test_the_storage_process_maps_only_a_workers_own_arena_file(storage, tmp_path):
    client = LocalPut(storage.endpoint, "w", timeout_s=5)
    bad = []
    outside = _file(str(tmp_path / "bana-arena-x"), 4096)
    bad.append((outside, 4096, "not a bana-arena-\\* file directly in"))
    shared = _file(os.path.join(SHM_DIR, f"bana-arena-test-{os.getpid()}-open"), 4096, 0o644)
    bad.append((shared, 4096, "has mode 644"))
    own = _file(os.path.join(SHM_DIR, f"bana-arena-test-{os.getpid()}-own"), 4096)
    link = os.path.join(SHM_DIR, f"bana-arena-test-{os.getpid()}-link")
    os.symlink(own, link)
    bad.append((link, 4096, "cannot open"))
    bad.append((own, 8192, "holds 4096 bytes, not 8192"))
    bad.append((os.path.join(SHM_DIR, "bana-arena-none"), 4096, "cannot open"))
    bad.append((SHM_DIR + "/../bana-arena-x", 4096, "not a bana-arena-"))
    unnamed = _file(os.path.join(SHM_DIR, f"other-{os.getpid()}"), 4096)
    bad.append((unnamed, 4096, "not a bana-arena-"))
    twin = _file(os.path.join(SHM_DIR, f"bana-arena-test-{os.getpid()}-twin"), 4096)
    linked = os.path.join(SHM_DIR, f"bana-arena-test-{os.getpid()}-hard")
    os.link(twin, linked)  # a second name for the same file
    bad.append((linked, 4096, "one link"))
    try:
        for path, nbytes, why in bad:
            arena = SharedArena.__new__(SharedArena)
            arena.path, arena.nbytes = path, nbytes
            with pytest.raises(LocalPutError, match=why) as e:
                client.map(arena)
            assert e.value.reason == "invalid"
        assert storage.host.arenas == 0 and not storage.native.regions
    finally:
        for p in (shared, own, link, unnamed, twin, linked):
            os.unlink(p)
    client.close()


def test_puts_are_checked_against_the_arena_and_the_channel(storage):
    client = LocalPut(storage.endpoint, "w", timeout_s=5)
    key = page_key(page_chain(range(LAYOUT.page_size), LAYOUT)[0])
    with pytest.raises(LocalPutError, match="no arena is mapped"):
        client.put([key], [0], 16)
    arena = SharedArena(1 << 16)
    try:
        assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600
        client.map(arena)
        arena.unlink()
        arena.rows(1, 64)[0] = torch.arange(64, dtype=torch.uint8)
        assert client.put([key], [0], 64) == [0]
        assert storage.native.objects[key] == bytes(range(64))
        with pytest.raises(LocalPutError, match="past the arena's 65536") as e:
            client.put([key], [1 << 16], 1)
        assert e.value.reason == "invalid"
        with pytest.raises(LocalPutError, match="2 keys but 1 offsets"):
            client.put([key, key], [0], 1)
        with pytest.raises(LocalPutError) as e:
            client.put(["not/a/page"], [0], 1)  # the channel stores KV pages only
        assert e.value.reason == "malformed"
        with pytest.raises(LocalPutError) as e:
            client.put([key] * (m.MAX_PAGES + 1), [0] * (m.MAX_PAGES + 1), 1)
        assert e.value.reason == "malformed"
        # the same owner mapping again drops its first arena; the old id is gone
        first = client.arena
        again = SharedArena(1 << 16)
        client.map(again)
        again.unlink()
        assert client.arena != first and storage.host.arenas == 1
        assert len(storage.native.unregistered) == 1
        client.arena = first
        with pytest.raises(LocalPutError) as e:
            client.put([key], [0], 1)
        assert e.value.reason == "unknown_arena"
        # another owner cannot put from this owner's arena, even knowing its id
        other = LocalPut(storage.endpoint, "other", timeout_s=5)
        third = SharedArena(1 << 16)
        client.map(third)
        third.unlink()
        other.arena = client.arena
        with pytest.raises(LocalPutError) as e:
            other.put([key], [0], 1)
        assert e.value.reason == "unknown_arena"
        assert client.put([key], [0], 1) == [0]
        other.close()
        third.close()
        again.close()
    finally:
        arena.close()
        client.close()


def test_a_put_the_storage_process_cannot_take_goes_direct_then_a_fresh_arena_maps(monkeypatch):
    """The storage process restarts between two rounds (its arenas are gone): the round
    puts directly from the same bytes, and the next maps a fresh arena and goes through
    the new process again; a storage process that does not answer makes the worker put
    directly (from a private arena: the shared one may still be read late)."""
    first = Storage()
    endpoint = first.endpoint
    pool, index, kv = make_pool(), FakeIndex(), FakeKV()
    # long enough for the restarted process to answer on a loaded machine (0.5 s was
    # not, once, in a full suite run); the round with no process waits it out
    pub = publisher(pool, kv, index, endpoint, storage_timeout_s=2.0)
    tokens = iter(range(10_000))

    def chain():
        return page_chain([next(tokens) for _ in range(2 * LAYOUT.page_size)], LAYOUT)

    ids = torch.tensor([1, 2])
    c1 = chain()
    assert publish(pub, c1, ids) is True and "put" not in kv.calls
    first.stop()
    second = Storage(endpoint)
    try:
        c2 = chain()
        assert publish(pub, c2, ids) is True  # unknown_arena: direct
        assert kv.calls["put"] == 1 and set(kv.objects) == {page_key(p) for p in c2}
        c3 = chain()
        assert publish(pub, c3, ids) is True  # a fresh arena, mapped by the new process
        assert kv.calls["put"] == 1 and set(second.native.objects) == {page_key(p) for p in c3}
        assert_pages(second.native.objects, c3, pool, ids)
        arenas = [r for r in kv.registered if r[1] == 1 << 20]
        assert len(arenas) == 1, "the first arena was unregistered"
    finally:
        second.stop()
    monkeypatch.setattr(publisher_mod, "REMAP_AFTER_S", 3600.0)
    c4 = chain()
    assert publish(pub, c4, ids) is True  # no answer within 2 s: direct
    assert kv.calls["put"] == 2 and {page_key(p) for p in c4} <= set(kv.objects)
    c5 = chain()
    assert publish(pub, c5, ids) is True  # direct again, from a private arena
    assert kv.calls["put"] == 3
    assert_pages(kv.objects, c5, pool, ids)
    assert len([r for r in kv.registered if r[1] == 1 << 20]) == 1  # the private one
    pub.close()


def test_the_arena_of_a_worker_process_that_is_gone_is_unmapped(storage):
    """Each arena is tied to the process that mapped it: when that process exits (or
    is killed), the storage process's next reap unregisters and unmaps it; an arena
    of a live process, or of a pid the storage process cannot see, stays."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    unseen = subprocess.Popen([sys.executable, "-c", "pass"])  # a pid no process has now
    unseen.wait()
    client = Client(storage.endpoint, m.CHANNEL, timeout_s=5)
    arenas = [SharedArena(1 << 16) for _ in range(3)]
    try:
        owners = {"killed": worker.pid, "alive": os.getpid(), "unseen": unseen.pid}
        for arena, (owner, pid) in zip(arenas, owners.items()):
            reply = client.request(
                m.MapArena, path=arena.path, nbytes=arena.nbytes, owner=owner, pid=pid
            )
            assert isinstance(reply, m.Mapped), reply
            arena.unlink()
        assert storage.host.arenas == 3 and storage.host.reap() == []
        worker.kill()
        worker.wait()
        assert storage.host.reap() == ["killed"]
        assert storage.host.arenas == 2 and len(storage.native.unregistered) == 1
        assert storage.host.reap() == []
    finally:
        if worker.poll() is None:
            worker.kill()
        for arena in arenas:
            arena.close()
        client.close()


def test_a_process_is_named_by_its_pid_and_its_start_time():
    me = process_start(os.getpid())
    assert me is not None and me == process_start(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start(child.pid) is None
