"""Publishing and loading through the storage process (``shm_arena``): a worker's
shared-memory arenas, the storage channel over real ZMQ on 127.0.0.1, the storage
process's checks on what it maps, and the direct put and the engine's reads a worker
falls back to. The storage process's
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
from bana_sglang.radix_global.layer_counter import LoadCancelled, LoadGate
from bana_sglang.radix_global.loader import Loader
from bana_sglang.radix_global.mooncake_kv import NOT_FOUND, page_key
from bana_sglang.radix_global.pool import Arena, KVPool
from bana_sglang.radix_global.publisher import Offload, Publisher
from bana_sglang.radix_global.shm_arena import (
    SHM_DIR,
    ArenaHost,
    LocalLoads,
    LocalStorage,
    LocalStorageError,
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

    def batch_get_into(self, keys, ptrs, sizes) -> list[int]:
        codes = []
        last = {k: i for i, k in enumerate(keys)}
        for i, (k, p, s) in enumerate(zip(keys, ptrs, sizes)):
            assert any(r <= p and p + s <= r + n for r, n in self.regions.items())
            obj = self.objects.get(k)
            if obj is None:
                codes.append(NOT_FOUND)
            elif len(obj) > s:
                codes.append(-600)  # Mooncake's "buffer too small"
            else:
                if last[k] == i:  # as Mooncake does: a key asked twice fills its last place only
                    ctypes.memmove(p, obj, len(obj))
                codes.append(len(obj))
        return codes


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
    client = LocalStorage(storage.endpoint, "w", timeout_s=5)
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
            with pytest.raises(LocalStorageError, match=why) as e:
                client.map(arena)
            assert e.value.reason == "invalid"
        assert storage.host.arenas == 0 and not storage.native.regions
    finally:
        for p in (shared, own, link, unnamed, twin, linked):
            os.unlink(p)
    client.close()


def test_puts_are_checked_against_the_arena_and_the_channel(storage):
    client = LocalStorage(storage.endpoint, "w", timeout_s=5)
    key = page_key(page_chain(range(LAYOUT.page_size), LAYOUT)[0])
    with pytest.raises(LocalStorageError, match="no arena is mapped"):
        client.put([key], [0], 16)
    arena = SharedArena(1 << 16)
    try:
        assert stat.S_IMODE(os.stat(arena.path).st_mode) == 0o600
        client.map(arena)
        arena.unlink()
        arena.rows(1, 64)[0] = torch.arange(64, dtype=torch.uint8)
        assert client.put([key], [0], 64) == [0]
        assert storage.native.objects[key] == bytes(range(64))
        with pytest.raises(LocalStorageError, match="past the arena's 65536") as e:
            client.put([key], [1 << 16], 1)
        assert e.value.reason == "invalid"
        with pytest.raises(LocalStorageError, match="2 keys but 1 offsets"):
            client.put([key, key], [0], 1)
        with pytest.raises(LocalStorageError) as e:
            client.put(["not/a/page"], [0], 1)  # the channel stores KV pages only
        assert e.value.reason == "malformed"
        with pytest.raises(LocalStorageError) as e:
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
        with pytest.raises(LocalStorageError) as e:
            client.put([key], [0], 1)
        assert e.value.reason == "unknown_arena"
        # another owner cannot put from this owner's arena, even knowing its id
        other = LocalStorage(storage.endpoint, "other", timeout_s=5)
        third = SharedArena(1 << 16)
        client.map(third)
        third.unlink()
        other.arena = client.arena
        with pytest.raises(LocalStorageError) as e:
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
    # not, once, in a full suite run, nor 2 s, once, beside a live cluster's tests);
    # the round with no process waits it out
    pub = publisher(pool, kv, index, endpoint, storage_timeout_s=5.0)
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
    assert publish(pub, c4, ids) is True  # no answer within 5 s: direct
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


def pool_pages(pool: KVPool, ids) -> list[torch.Tensor]:
    p = LAYOUT.page_size
    return [
        torch.stack(
            [
                torch.stack([pool.k[i][p * j : p * (j + 1)], pool.v[i][p * j : p * (j + 1)]])
                for i in range(LAYOUT.num_layers)
            ]
        )
        for j in ids.tolist()
    ]


def local_load(store: PageStore, loader: Loader, chain, dst) -> tuple:
    released: list[int] = []
    read = store.layerwise(chain, headers_inline=True)
    miss = read.start(session=not loader.goes_local(len(chain), store.object_size))  # as the linker
    if miss is not None:
        return miss, None, released
    miss, stats = loader.load(read, dst, lambda layer, ev: released.append(layer))
    return miss, stats, released


def test_a_load_copies_whole_pages_through_the_storage_process_then_layer_by_layer(storage):
    """Published through the storage process, loaded back through it: one local get of
    every whole page, no ranged read over the engine, every layer but the last released
    in order (the last waits for the MACs), the pool pages exactly the published ones."""
    pool, index, kv = make_pool(), FakeIndex(), FakeKV()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src, dst = torch.arange(1, N + 1), torch.arange(2 * N, N, -1)
    pub = publisher(pool, kv, index, storage.endpoint)
    assert publish(pub, chain, src) is True
    pub.close()
    kv.objects = storage.native.objects  # the worker's client sees the same store
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    local = LocalLoads(storage.endpoint, "w/load", 1 << 20)
    loader = Loader(pool, "staged", Arena(pool.device, 1 << 20, store.kv), local=local)
    miss, stats, released = local_load(store, loader, chain, dst)
    assert miss is None and stats.pages == N
    assert released == list(range(LAYOUT.num_layers - 1))
    assert kv.slices.get("ranges", 0) == 0, "nothing was read over the engine"
    assert kv.calls.get("session", 0) == 0, "a whole-page read needs no read session"
    for a, b in zip(pool_pages(pool, dst), pool_pages(pool, src)):
        assert torch.equal(a, b)
    assert storage.host.arenas == 2, "the publisher's arena and the loads'"
    assert kv.sessions == 0
    # two requests with the same prefix in one load batch: their pages are asked for twice,
    # and every place gets its page (Mooncake's batch get alone would fill only the last)
    twice = chain[:2] + chain[:3]
    dst2 = torch.arange(N + 1, 2 * N + 1)
    miss, _, _ = local_load(store, loader, twice, dst2)
    assert miss is None
    for a, b in zip(pool_pages(pool, dst2), pool_pages(pool, torch.tensor([1, 2, 1, 2, 3]))):
        assert torch.equal(a, b)
    # a byte of the last layer flipped in the store: the MAC, not the header, says so
    key = page_key(chain[3])
    good = storage.native.objects[key]
    storage.native.objects[key] = good[:-2] + bytes([good[-2] ^ 1]) + good[-1:]
    miss, _, released = local_load(store, loader, chain, dst)
    assert miss is not None and miss.reason == "checksum" and miss.page == chain[3]
    assert LAYOUT.num_layers - 1 not in released, "the last layer is never released"
    # written without the cluster's key: a valid header, no valid MAC
    forger = PageStore(LAYOUT, FakeKV(), mac_key=b"not the cluster's")
    forger.put_pages([chain[3]], [torch.randn(LAYOUT.page_shape)])
    storage.native.objects[key] = forger.kv.objects[key]
    assert local_load(store, loader, chain, dst)[0].reason == "checksum"
    storage.native.objects[key] = good
    assert local_load(store, loader, chain, dst)[0] is None
    local.close()


def test_a_load_larger_than_the_arena_or_unserved_reads_over_the_engine(monkeypatch):
    """A load that does not fit the shared arena reads layer groups over the engine; so
    does one the storage process does not answer, and its arena is dropped (the storage
    process may still write it) until a fresh one maps."""
    first = Storage()
    pool, index, kv = make_pool(), FakeIndex(), FakeKV()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src, dst = torch.arange(1, N + 1), torch.arange(N + 1, 2 * N + 1)
    pub = publisher(pool, kv, index, first.endpoint)
    assert publish(pub, chain, src) is True
    pub.close()
    kv.objects = first.native.objects
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    obj = store.object_size
    small = LocalLoads(first.endpoint, "w/small", 2 * obj)  # holds two pages, not five
    loader = Loader(pool, "staged", Arena(pool.device, 1 << 20, store.kv), local=small)
    assert local_load(store, loader, chain, dst)[0] is None
    assert kv.slices["ranges"] > 0
    for a, b in zip(pool_pages(pool, dst), pool_pages(pool, src)):
        assert torch.equal(a, b)
    small.close()
    local = LocalLoads(first.endpoint, "w/load", 1 << 20, timeout_s=1.0)
    loader = Loader(pool, "staged", Arena(pool.device, 1 << 20, store.kv), local=local)
    assert local.arena() is not None
    first.stop()  # no answer now
    before = kv.slices["ranges"]
    for b in pool.buffers():  # compared with the stored pages below
        b.zero_()
    miss, stats, released = local_load(store, loader, chain, dst)
    assert miss is None and kv.slices["ranges"] > before, "read over the engine instead"
    assert released == list(range(LAYOUT.num_layers - 1))
    assert_pages(kv.objects, chain, pool, dst)
    assert local.arena() is None, "the unanswered arena is never used again, for now"
    assert kv.sessions == 0, "the session the fallback opened is closed"
    local.close()


def test_a_load_given_up_while_the_storage_process_was_silent_reads_nothing_more(storage):
    """The forward gives the load up while the storage process does not answer its get:
    the load stops there (LoadCancelled) instead of reading over the engine."""
    pool, index, kv = make_pool(), FakeIndex(), FakeKV()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    pub = publisher(pool, kv, index, storage.endpoint)
    assert publish(pub, chain, torch.arange(1, N + 1)) is True
    pub.close()
    kv.objects = storage.native.objects
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    local = LocalLoads(storage.endpoint, "w/load", 1 << 20)
    loader = Loader(pool, "staged", Arena(pool.device, 1 << 20, store.kv), local=local)
    gate = LoadGate(pool.device)

    def silent(*_):
        gate.cancel()  # the forward's deadline passed meanwhile
        raise LocalStorageError("unavailable", "no answer within the timeout")

    local.get = silent
    read = store.layerwise(chain, headers_inline=True)
    assert read.start(session=False) is None
    with pytest.raises(LoadCancelled):
        loader.load(read, torch.arange(N + 1, 2 * N + 1), lambda layer, ev: None, gate=gate)
    assert "ranges" not in kv.calls and "session" not in kv.calls
    local.close()


def _rss_kb(path: str) -> int:
    """Resident KiB of this process's mapping of ``path`` (from /proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and first == "Rss:":
                rss += int(line.split()[1])
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_both_sides_map_an_arena_with_its_pages_present():
    """The worker's and the storage process's mappings of an arena are populated when
    made: a 22.8 MB load's first get into a fresh arena otherwise spent 80 ms in page
    faults (later gets: 4 ms)."""
    from bana_sglang.radix_global.shm_arena import open_arena

    nbytes = 4 << 20
    arena = SharedArena(nbytes)
    try:
        assert _rss_kb(arena.path) >= nbytes // 1024, "the worker's mapping"
        mm = open_arena(arena.path, nbytes)
        try:
            assert _rss_kb(arena.path) >= 2 * nbytes // 1024, "and the storage process's"
        finally:
            mm.close()
    finally:
        arena.close()
