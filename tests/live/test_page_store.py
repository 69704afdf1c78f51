"""PageStore against a real mooncake_master and a real storage process on 127.0.0.1.

Covers: a torch page round trip (staging and registered zero-copy paths), header
verification (another layout, another page, another size, a corrupted payload:
all misses), a missing key (a miss), and a master killed and restarted while
requests flow through index + store: misses and no exceptions during the
outage, hits again afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from support.cluster import free_port
from support.mooncake_procs import Mooncake, master_and_storage
from support.radix_index import index_service

from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import KVLayout, PageHash, page_chain
from bana_sglang.radix_global.mooncake_kv import StoreConfig, page_key
from bana_sglang.radix_global.store import Miss, PageStore
from bana_sglang.radix_global.worker_cache import GlobalKVCache

pytestmark = pytest.mark.slow

LAYOUT = KVLayout("store-test", "float32", page_size=4, num_kv_heads=2, head_dim=8, num_layers=2)


@pytest.fixture(scope="module")
def mooncake() -> Iterator[Mooncake]:
    with master_and_storage() as mc:
        yield mc


@pytest.fixture()
def store(mooncake) -> Iterator[PageStore]:
    s = PageStore.connect(
        LAYOUT, StoreConfig(master_addr=mooncake.addr, staging_bytes=1 << 20, probe_interval_s=0.2)
    )
    yield s
    s.kv.close()


def _page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.page_shape, generator=g)


def test_put_get_round_trip(store):
    chain = page_chain(range(1000, 1012), LAYOUT)
    pages = [_page(i) for i in range(3)]
    assert store.put_pages(chain, pages) == (3, None)
    got = store.get_page(chain[1])
    assert isinstance(got, torch.Tensor) and torch.equal(got, pages[1])
    out = torch.empty(LAYOUT.page_shape)
    res = store.get_pages(chain, None)
    assert res.miss is None and all(torch.equal(a, b) for a, b in zip(res.tensors, pages))
    assert store.get_page(chain[2], out) is out and torch.equal(out, pages[2])
    assert store.exists_many(chain + [PageHash("0" * 32)]) == [True, True, True, False]
    # a registered pool moves pages without staging
    pool = torch.zeros((4, *LAYOUT.page_shape))
    store.register(pool)
    pool[0].copy_(_page(10))
    pool[1].copy_(_page(11))
    chain2 = page_chain(range(2000, 2008), LAYOUT)
    assert store.put_pages(chain2, [pool[0], pool[1]]).written == 2
    res = store.get_pages(chain2, [pool[2], pool[3]])
    assert res.miss is None and res.tensors[0].data_ptr() == pool[2].data_ptr()
    assert torch.equal(pool[2], _page(10)) and torch.equal(pool[3], _page(11))
    assert store.object_size == 192 + LAYOUT.page_nbytes


def test_missing_key_is_a_miss(store):
    page = page_chain(range(3000, 3004), LAYOUT)[0]
    assert store.get_page(page) == Miss(page, "missing")
    res = store.get_pages(page_chain(range(3000, 3012), LAYOUT))
    assert res.tensors == () and res.miss.reason == "missing"


def test_header_rejects_other_layout_page_and_corruption(store, mooncake):
    chain = page_chain(range(4000, 4008), LAYOUT)
    assert store.put_pages(chain, [_page(1), _page(2)]).written == 2
    # same shape, other model: the layout digest differs
    other_model = PageStore(KVLayout("another-model", "float32", 4, 2, 8, 2), store.kv)
    assert other_model.get_page(chain[0]).reason == "layout_mismatch"
    # other TP rank of the same model
    rank1 = PageStore(KVLayout("store-test", "float32", 4, 2, 8, 2, tp_rank=1, tp_size=2), store.kv)
    assert rank1.get_page(chain[0]).reason == "layout_mismatch"
    # other page size: the object has another size
    bigger = PageStore(KVLayout("store-test", "float32", 8, 2, 8, 2), store.kv)
    assert bigger.get_page(chain[0]).reason == "size_mismatch"
    # the bytes of page 0 stored under another page's key
    raw = store.kv.get_bytes(page_key(chain[0]))
    alien = PageHash("ab" * 16)
    store.kv.put_bytes(page_key(alien), raw)
    assert store.get_page(alien).reason == "page_mismatch"
    # a flipped payload byte
    raw1 = bytearray(store.kv.get_bytes(page_key(chain[1])))
    raw1[-1] ^= 0xFF
    store.kv.remove_many([page_key(chain[1])], force=True)
    store.kv.put_bytes(page_key(chain[1]), bytes(raw1))
    res = store.get_pages(chain)
    assert len(res.tensors) == 1 and res.miss.reason == "checksum"
    # a page written by someone without the cluster's key: a valid header and CRC, no valid MAC
    assert store.format.keyed  # the suite runs with a cluster secret
    forger = PageStore(LAYOUT, store.kv, mac_key=b"not the cluster's key")
    forged = page_chain(range(4100, 4104), LAYOUT)
    assert forger.put_pages(forged, [_page(3)]).written == 1
    assert torch.equal(forger.get_page(forged[0]), _page(3))  # it verifies under its own key
    assert store.get_page(forged[0]).reason == "checksum"
    # a mangled header
    raw0 = bytearray(raw)
    raw0[10] ^= 0x01
    store.kv.remove_many([page_key(chain[0])], force=True)
    store.kv.put_bytes(page_key(chain[0]), bytes(raw0))
    assert store.get_page(chain[0]).reason == "bad_header"


def test_layerwise_read_lands_layers_in_scattered_slots_and_verifies(store):
    """The linker's data path: pages written from scattered KV-pool-like parts (zero
    copy), read back layer by layer into other scattered slots, checksummed."""
    L, P, H, D = LAYOUT.num_layers, LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim
    slots = 4 * P
    src_k = [torch.randn(slots, H, D) for _ in range(L)]
    src_v = [torch.randn(slots, H, D) for _ in range(L)]
    dst_k = [torch.zeros(slots, H, D) for _ in range(L)]
    dst_v = [torch.zeros(slots, H, D) for _ in range(L)]
    for t in src_k + src_v + dst_k + dst_v:
        store.register(t)

    def parts(k, v, start, layers=range(L)):
        return [
            x
            for layer in layers
            for x in (k[layer][start : start + P], v[layer][start : start + P])
        ]

    chain = page_chain(range(7000, 7000 + 3 * P), LAYOUT)
    src_starts, dst_starts = [0, 2 * P, P], [3 * P, 0, 2 * P]  # scattered, not in order
    assert store.put_pages(chain, [parts(src_k, src_v, s) for s in src_starts]).written == 3
    # the whole-page path sees the same bytes, in the layer-major page layout
    whole = store.get_page(chain[1])
    assert torch.equal(whole[1, 0], src_k[1][2 * P : 3 * P]) and torch.equal(
        whole[0, 1], src_v[0][2 * P : 3 * P]
    )

    read = store.layerwise(chain)
    assert read.start() is None and len(read.pages) == 3
    for layer in range(L):
        assert read.read_layer(layer, [parts(dst_k, dst_v, d, [layer]) for d in dst_starts]) is None
    assert read.finish() is None
    for s, d in zip(src_starts, dst_starts):
        for layer in range(L):
            assert torch.equal(dst_k[layer][d : d + P], src_k[layer][s : s + P])
            assert torch.equal(dst_v[layer][d : d + P], src_v[layer][s : s + P])

    # a missing page in the middle: the read keeps the prefix before it
    gap = page_chain(range(7000, 7000 + 3 * P), LAYOUT, salt="gap")
    assert (
        store.put_pages([gap[0], gap[2]], [parts(src_k, src_v, 0), parts(src_k, src_v, P)]).written
        == 2
    )
    read = store.layerwise(gap)
    miss = read.start()
    assert miss.reason == "missing" and miss.page == gap[1] and read.pages == [gap[0]]
    read.finish()

    # a flipped payload byte in layer 1 of page 0: headers verify, layers land,
    # and finish() (before the caller releases the last layer) reports it
    raw = bytearray(store.kv.get_bytes(page_key(chain[0])))
    raw[-5] ^= 0xFF
    store.kv.remove_many([page_key(chain[0])], force=True)
    store.kv.put_bytes(page_key(chain[0]), bytes(raw))
    read = store.layerwise(chain[:1])
    assert read.start() is None
    for layer in range(L):
        assert read.read_layer(layer, [parts(dst_k, dst_v, 0, [layer])]) is None
    bad = read.finish()
    assert bad is not None and bad.reason == "checksum" and bad.page == chain[0]


def _outage_while_requests_flow(mooncake: Mooncake, kill, restart, what: str, settle=None):
    """Requests keep flowing through index + store while part of the store dies
    and comes back: misses and no exceptions meanwhile, hits again afterwards."""
    port = free_port()
    with index_service(
        port,
        "--capacity-bytes",
        str(8 << 20),
        "--master",
        mooncake.addr,
        "--epoch-check",
        "0.3",
        name="radix-index-store",
    ):
        ep = f"tcp://127.0.0.1:{port}"
        store = PageStore.connect(
            LAYOUT, StoreConfig(master_addr=mooncake.addr, probe_interval_s=0.2)
        )
        cache = GlobalKVCache(
            LAYOUT, IndexClient(ep, timeout_s=2.0, name="worker"), store, "worker"
        )
        prompts = [list(range(k * 100, k * 100 + 24)) for k in range(4)]  # 6 pages each
        log: list[tuple[float, int, float]] = []  # (start, hit pages, latency)
        errors: list[BaseException] = []
        stop = threading.Event()

        def requests() -> None:
            i = 0
            while not stop.is_set():
                tokens = prompts[i % len(prompts)]
                i += 1
                t0 = time.monotonic()
                try:
                    chain = cache.chain(tokens)
                    hit = cache.load_prefix(chain)
                    # "recompute" the rest and publish it
                    cache.publish(chain, [_page(j) for j in range(len(chain))])
                    log.append((t0, len(hit.tensors), time.monotonic() - t0))
                except BaseException as e:  # the point of the test: nothing escapes
                    errors.append(e)
                    return
                time.sleep(0.02)

        worker = threading.Thread(target=requests, name="requests")
        worker.start()
        try:
            deadline = time.monotonic() + 30
            while not any(h for _, h, _ in log):
                assert time.monotonic() < deadline and not errors, (
                    f"no hits before the kill: {errors}"
                )
                time.sleep(0.1)
            killed_at = time.monotonic()
            kill()
            # A request into a just-dead segment can block ~1-2 s until Mooncake
            # drops it; what must hold is that requests keep completing.
            deadline = time.monotonic() + 20
            while len(during := [e for e in log if e[0] > killed_at + 1.0]) < 3:
                assert time.monotonic() < deadline and not errors, (
                    f"requests stopped flowing while the {what} was down: {errors}"
                )
                time.sleep(0.1)
            assert all(h == 0 for _, h, _ in during)
            restart()
            restarted_at = time.monotonic()
            deadline = restarted_at + 40
            while not any(h for t, h, _ in log if t > restarted_at):
                assert time.monotonic() < deadline, f"hits never resumed after the {what} restart"
                assert not errors, errors
                time.sleep(0.2)
        finally:
            stop.set()
            worker.join(timeout=30)
        assert not errors, errors
        resumed = min(t for t, h, _ in log if t > restarted_at and h) - restarted_at
        outage = [lat for t, _, lat in log if killed_at < t < restarted_at]
        print(
            f"\n{what}: hits resumed {resumed:.1f}s after the restart; {len(log)} requests; "
            f"during the outage {len(outage)} requests, slowest {max(outage, default=0):.2f}s"
        )
        if settle is not None:
            # what the index learns from the store (its janitor's epoch check) it
            # learns asynchronously: hits can resume from fresh publishes first
            deadline = time.monotonic() + 15
            while (stats := cache.index.stats()) is None or not settle(stats):
                assert time.monotonic() < deadline, (
                    f"the index never settled after the {what} restart: {stats}"
                )
                time.sleep(0.2)
        else:
            stats = cache.index.stats()
        store.kv.close()
        return stats, log, killed_at


def test_master_killed_and_restarted_while_requests_flow(mooncake):
    stats, log, killed_at = _outage_while_requests_flow(
        mooncake,
        mooncake.kill_master,
        mooncake.start_master,
        "master",
        settle=lambda s: s.store_resets >= 1,
    )
    # the outage gate: no request waited for Mooncake's ~4.5 s RPC timeout more than once
    slow = [lat for t, _, lat in log if t > killed_at and lat > 1.0]
    assert len(slow) <= 2, slow
    # the index learnt that the store lost everything
    assert stats.store_resets >= 1


def test_storage_process_killed_and_restarted_while_requests_flow(mooncake):
    def kill() -> None:
        mooncake.storage.kill()
        mooncake.storage.reap()

    stats, _, _ = _outage_while_requests_flow(
        mooncake, kill, mooncake.start_storage, "storage process", settle=lambda s: s.forgotten > 0
    )
    assert stats.forgotten > 0  # readers reported the lost pages; the index forgot them


def _drained(index: IndexClient, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (s := index.stats()) is None or s.store_removals_queued:
        assert time.monotonic() < deadline, f"store removals still queued: {s}"
        time.sleep(0.1)


def test_index_service_removes_evicted_and_lost_pages_from_the_store(mooncake):
    """Eviction is the index's: pages it evicts (LRU leaves) or forgets disappear
    from the store too, so the store holds exactly the indexed, prefix-closed set."""
    port = free_port()
    store = PageStore.connect(LAYOUT, StoreConfig(master_addr=mooncake.addr))
    capacity = 6 * store.footprint  # room for 6 pages
    with index_service(
        port, "--capacity-bytes", str(capacity), "--master", mooncake.addr, name="radix-index-evict"
    ):
        cache = GlobalKVCache(
            LAYOUT, IndexClient(f"tcp://127.0.0.1:{port}", timeout_s=5), store, "w"
        )
        chains = [
            cache.chain(list(range(k * 1000, k * 1000 + 12))) for k in range(4)
        ]  # 3 pages each
        for ch in chains:
            assert cache.publish(ch, [_page(i) for i in range(3)]).committed == 3
        held = [p for ch in chains for p in ch]
        in_index = [cache.index.lookup(ch, touch=False).length for ch in chains]
        assert in_index == [0, 0, 3, 3]
        _drained(cache.index)  # (polling the store would renew read leases)
        assert store.exists_many(held) == [False] * 6 + [True] * 6
        # a corrupt page is reported by the reader; it and its descendants leave index and store
        raw = bytearray(store.kv.get_bytes(page_key(chains[3][1])))
        raw[-1] ^= 1
        store.kv.remove_many([page_key(chains[3][1])], force=True)
        store.kv.put_bytes(page_key(chains[3][1]), bytes(raw))
        res = cache.load_prefix(chains[3])
        assert len(res.tensors) == 1 and res.miss.reason == "checksum"
        assert cache.index.lookup(chains[3], touch=False).length == 1
        _drained(cache.index)  # lost pages are removed with force: no lease wait
        assert store.exists_many(chains[3]) == [True, False, False]
        # and the chain can be published again, fully
        assert cache.publish(chains[3], [_page(i) for i in range(3)]).committed == 2
        assert len(cache.load_prefix(chains[3]).tensors) == 3
    store.kv.close()


def test_a_segment_holds_as_many_pages_as_their_footprint_says():
    """The index accounts a page at :attr:`PageStore.footprint` (the object rounded up
    to Mooncake's size class), not its own size: against a real master whose own
    eviction is off, a segment takes exactly ``segment // footprint`` pages of the
    tiny model's shape (16576 bytes, 18432 in the segment) and then refuses more."""
    layout = KVLayout(
        "cap-test", "float32", page_size=16, num_kv_heads=2, head_dim=16, num_layers=4
    )
    mc = Mooncake(segment="16M", master_args=("-eviction_high_watermark_ratio=1.0",))
    try:
        mc.start_master()
        mc.start_storage()
        store = PageStore.connect(layout, StoreConfig(master_addr=mc.addr, staging_bytes=2 << 20))
        assert (store.object_size, store.footprint) == (16576, 18432)
        page = torch.zeros(layout.page_shape)
        written, batch = 0, 64
        for b in range(1000):
            chain = page_chain(range(b * batch * 16, (b + 1) * batch * 16), layout)
            res = store.put_pages(chain, [page] * batch)
            written += res.written
            if res.written < batch:
                break
        assert written == (16 << 20) // store.footprint  # 910, where 16576-byte pages would be 1012
        store.kv.close()
    finally:
        mc.stop()


def test_filled_past_capacity_the_index_keeps_a_tenth_of_the_segment_free():
    """The store's processes as the launcher wires them (``bench.local_store``), filled
    twice over through the index with the tiny model's pages: the index ends at 0.9 of
    what the segment holds, every page it lists is in the store, and neither the
    segment's allocator nor the master's own eviction was ever reached."""
    import argparse

    from bench.bench_store_fill import run

    out = run(
        argparse.Namespace(
            model="tiny",
            page_size=16,
            segment=16 << 20,
            chains=450,
            pages_per_chain=4,
            reads=False,
            gap_ms=0.0,
            settle_s=1.0,
            port=free_port(),
        )
    )
    assert out["segment_pages"] == 910 and out["committed"] == 1800
    capacity = (16 << 20) * 9 // 10 // out["page_footprint"]  # 819 pages
    assert capacity - 4 <= out["indexed"] <= capacity
    assert out["indexed_missing"] == 0 and out["publishes_with_failed_put"] == 0
    assert out["master_alloc_failures"] == 0 and out["master_evicted_keys"] == 0
