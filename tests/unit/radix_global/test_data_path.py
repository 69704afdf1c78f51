"""The store's data path on a CPU pool against an in-process store (fast; the live tests
run the same code on a real master and storage process): publishing framed pages,
staged and direct loads group of layers by group, the checks on every loaded page,
the layer counter a forward waits on, the layer groups and the load-or-recompute model."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from support.fake_mooncake import FakeIndex, FakeKV

from bana_sglang.radix_global.cost import CostModel, LinearFit
from bana_sglang.radix_global.device import Device
from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.radix_global.layer_counter import LayerCounter, LoadCancelled
from bana_sglang.radix_global.loader import Loader, layer_groups
from bana_sglang.radix_global.mooncake_kv import page_key
from bana_sglang.radix_global.page_format import HEADER_SIZE
from bana_sglang.radix_global.pool import Arena, KVPool
from bana_sglang.radix_global.publisher import Offload, Publisher
from bana_sglang.radix_global.store import PageStore

LAYOUT = KVLayout("data-path", "float32", page_size=4, num_kv_heads=2, head_dim=8, num_layers=4)
KEY = b"k" * 32
N = 6  # pages published and loaded


def make_pool(pages: int = 2 * N + 1) -> KVPool:
    g = torch.Generator().manual_seed(1)
    shape = (pages * LAYOUT.page_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k = [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]
    v = [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]
    return KVPool(k, v, LAYOUT.page_size)


def pages_of(pool: KVPool, ids: torch.Tensor) -> list[torch.Tensor]:
    return [Device.pages_view(b, pool.page_size)[ids] for b in pool.buffers()]


@pytest.fixture
def kv() -> FakeKV:
    return FakeKV()


def publish(pool: KVPool, kv: FakeKV, index: FakeIndex, chain, ids, **kw) -> Publisher:
    pub = Publisher(
        pool, lambda: PageStore(LAYOUT, kv, mac_key=KEY), index, "w", arena_bytes=1 << 20, **kw
    )
    pub.submit(Offload(list(chain), None, ids))
    pub.join()
    return pub


def test_a_publish_is_one_framed_slice_per_page_then_a_commit(kv):
    pool, index = make_pool(), FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src = torch.arange(1, N + 1)
    pub = publish(pool, kv, index, chain, src)
    assert pub.results.get_nowait() is True
    assert kv.calls["put"] == 1 and kv.slices["put"] == N  # one slice per page, one call
    assert index.calls == ["intent", "commit"] and index.present == set(chain)
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    for i, page in enumerate(chain):  # each object is a page that verifies, with the pool's rows
        got = store.get_page(page)
        want = torch.stack(
            [
                torch.stack(
                    [
                        pool.k[layer][4 * (i + 1) : 4 * (i + 2)],
                        pool.v[layer][4 * (i + 1) : 4 * (i + 2)],
                    ]
                )
                for layer in range(LAYOUT.num_layers)
            ]
        )
        assert torch.equal(got, want)
    # published again: nothing to write, still complete
    pub.submit(Offload(list(chain), None, src))
    pub.join()
    assert pub.results.get_nowait() is True and kv.calls["put"] == 1
    pub.close()


def test_queued_offloads_go_out_in_one_round_after_a_quiet_moment_results_in_order(kv):
    pool, index = make_pool(), FakeIndex()
    loud = threading.Event()
    loud.set()
    pub = Publisher(
        pool,
        lambda: PageStore(LAYOUT, kv, mac_key=KEY),
        index,
        "w",
        arena_bytes=1 << 20,
        quiet=lambda: 0.01 if loud.is_set() else 0.0,
        max_delay_s=30,
    )
    chains = [page_chain(range(100 * j, 100 * j + 2 * 4), LAYOUT) for j in range(3)]
    for j, c in enumerate(chains):
        pub.submit(Offload(list(c), None, torch.tensor([1 + 2 * j, 2 + 2 * j])))
    time.sleep(0.2)
    assert "put" not in kv.calls  # held back while the worker is busy
    loud.clear()
    pub.join()
    assert [pub.results.get_nowait() for _ in chains] == [True, True, True]
    assert kv.calls["put"] == 1 and kv.slices["put"] == 6
    # and never longer than max_delay_s
    pub2 = Publisher(
        pool,
        lambda: PageStore(LAYOUT, kv, mac_key=KEY),
        index,
        "w",
        arena_bytes=1 << 20,
        quiet=lambda: 10.0,
        max_delay_s=0.1,
    )
    t0 = time.monotonic()
    pub2.submit(Offload(list(page_chain(range(900, 908), LAYOUT)), None, torch.tensor([7, 8])))
    pub2.join()
    assert 0.1 <= time.monotonic() - t0 < 5 and pub2.results.get_nowait() is True
    pub.close()
    pub2.close()


def test_an_offload_is_not_written_before_it_is_due_and_holds_back_no_other(kv):
    """A decode worker's copy of a prompt that has just arrived waits for its
    ``not_before``; an offload due before it goes out in a round of its own at once,
    and results keep the offloads' order."""
    pool, index = make_pool(), FakeIndex()
    pub = Publisher(
        pool, lambda: PageStore(LAYOUT, kv, mac_key=KEY), index, "w", arena_bytes=1 << 20
    )
    due, held = (page_chain(range(100 * j, 100 * j + 2 * 4), LAYOUT) for j in (1, 2))
    t0 = time.monotonic()
    pub.submit(Offload(list(due), None, torch.tensor([1, 2])))
    pub.submit(Offload(list(held), None, torch.tensor([3, 4]), not_before=t0 + 0.5))
    deadline = time.monotonic() + 5
    while kv.calls.get("put", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert time.monotonic() - t0 < 0.5, "the due offload waited for the held one"
    assert kv.slices["put"] == 2 and index.present == set(due)
    pub.join()
    assert time.monotonic() - t0 >= 0.5
    assert kv.calls["put"] == 2 and index.present == set(due) | set(held)
    assert [pub.results.get_nowait() for _ in range(2)] == [True, True]
    pub.close()


def test_an_unavailable_index_publishes_nothing_and_says_so(kv):
    pool, index = make_pool(), FakeIndex()
    index.available = False
    pub = publish(pool, kv, index, page_chain(range(8), LAYOUT), torch.tensor([1, 2]))
    assert pub.results.get_nowait() is False and "put" not in kv.calls
    pub.close()


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("min_slice", [0, 1 << 20])
def test_loads_land_exactly_the_published_pages_layer_by_layer(kv, mode, min_slice):
    pool, index = make_pool(), FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    # pool pages in no order: the gathers and scatters index, they do not slice
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(N, generator=gen) + 1
    dst = torch.randperm(N, generator=gen) + N + 1
    publish(pool, kv, index, chain, src).close()
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    arena = Arena(pool.device, 1 << 20, store.kv)
    if mode == "direct":
        for b in pool.buffers():
            store.kv.register(b.data_ptr(), b.numel() * b.element_size())
    loader = Loader(pool, mode, arena, min_slice_bytes=min_slice)
    loader.register_headers(store.kv)
    for b in pool.buffers():
        Device.pages_view(b, pool.page_size)[dst] = 0
    released: list[int] = []
    read = store.layerwise(chain, headers_inline=True)
    assert read.start() is None
    before = dict(kv.slices)
    miss, stats = loader.load(read, dst, lambda layer, ev: released.append(layer))
    assert miss is None and stats.pages == N
    assert released == list(range(LAYOUT.num_layers - 1))  # the last waits for the MACs
    for a, b in zip(pages_of(pool, dst), pages_of(pool, src)):
        assert torch.equal(a, b)
    groups = layer_groups(LAYOUT.num_layers, 2.0, pool.layer_bytes, min_slice)
    assert stats.groups == len(groups)
    slices = kv.slices["ranges"] - before.get("ranges", 0)
    per_page = len(groups) if mode == "staged" else 1 + 2 * LAYOUT.num_layers  # + the header
    assert slices == N * per_page
    assert kv.sessions == 0  # the read session is closed


def test_a_bad_page_is_a_miss_after_its_layers_landed_never_silent(kv):
    pool, index = make_pool(), FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src, dst = torch.arange(1, N + 1), torch.arange(N + 1, 2 * N + 1)
    publish(pool, kv, index, chain, src).close()
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    arena = Arena(pool.device, 1 << 20, store.kv)
    loader = Loader(pool, "staged", arena)

    def load():
        read = store.layerwise(chain, headers_inline=True)
        start = read.start()
        if start is not None:
            return start
        return loader.load(read, dst, lambda layer, ev: None)[0]

    # a byte of the last layer flipped: the header and the first layers verify, the MAC not
    key = page_key(chain[2])
    good = kv.objects[key]
    bad = bytearray(good)
    bad[-3] ^= 0x10
    kv.objects[key] = bytes(bad)
    miss = load()
    assert miss is not None and miss.reason == "checksum" and miss.page == chain[2]
    # written by someone without the key: a valid header, no valid MAC
    forger = PageStore(LAYOUT, FakeKV(), mac_key=b"not the cluster's")
    forger.put_pages([chain[2]], [torch.randn(LAYOUT.page_shape)])
    kv.objects[key] = forger.kv.objects[key]
    assert load().reason == "checksum"
    # a page of another layout under this key: refused at its header, before any MAC
    other = KVLayout("another", "float32", 4, 2, 8, 4)
    alien = PageStore(other, FakeKV(), mac_key=KEY)
    alien.put_pages([chain[2]], [torch.randn(other.page_shape)])
    kv.objects[key] = alien.kv.objects[key]
    assert load().reason == "layout_mismatch"
    # gone from the store: the session says so before anything is read
    del kv.objects[key]
    assert load().reason == "missing"
    kv.objects[key] = good
    assert load() is None
    assert kv.sessions == 0


def test_a_read_started_without_a_session_opens_one_when_it_first_reads(kv):
    """A load through the storage process needs no read session, so the linker starts
    its read without one; when such a read is done over the engine after all, its first
    ranged read opens the session, and a page the store lost is that read's miss."""
    pool, index = make_pool(), FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src, dst = torch.arange(1, N + 1), torch.arange(N + 1, 2 * N + 1)
    publish(pool, kv, index, chain, src).close()
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    loader = Loader(pool, "staged", Arena(pool.device, 1 << 20, store.kv))
    read = store.layerwise(chain, headers_inline=True)
    assert read.start(session=False) is None and "session" not in kv.calls
    miss, _ = loader.load(read, dst, lambda layer, ev: None)
    assert miss is None and kv.calls["session"] == 1 and kv.sessions == 0
    for a, b in zip(pages_of(pool, dst), pages_of(pool, src)):
        assert torch.equal(a, b)
    del kv.objects[page_key(chain[1])]
    read = store.layerwise(chain, headers_inline=True)
    assert read.start(session=False) is None
    miss, _ = loader.load(read, dst, lambda layer, ev: None)
    assert miss is not None and miss.reason == "missing" and miss.page == chain[1]
    assert kv.sessions == 0
    with pytest.raises(ValueError, match="without a session"):
        store.layerwise(chain).start(session=False)  # its headers need the store


def test_the_lookup_sees_what_the_store_holds(kv):
    pool, index = make_pool(), FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    publish(pool, kv, index, chain, torch.arange(1, N + 1)).close()
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    assert store.present(chain) == (N, None)
    del kv.objects[page_key(chain[3])]
    n, miss = store.present(chain)
    assert n == 3 and miss.reason == "missing" and miss.page == chain[3]


def test_pool_page_ids_need_whole_aligned_pages():
    pool = make_pool()
    assert pool.page_ids(torch.arange(8, 16)).tolist() == [2, 3]
    with pytest.raises(ValueError, match="whole number"):
        pool.page_ids(torch.arange(8, 14))
    with pytest.raises(ValueError, match="page-aligned"):
        pool.page_ids(torch.arange(9, 13))
    pool.check_layout(LAYOUT)
    with pytest.raises(ValueError, match="holds"):
        pool.check_layout(KVLayout("x", "float32", 4, 2, 8, 3))


def test_layer_groups_cover_every_layer_with_slices_of_the_floor():
    assert layer_groups(8) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert layer_groups(8, 1.0) == [(k, k + 1) for k in range(8)]
    assert layer_groups(8, 2.0, 32 << 10, 64 << 10) == [(0, 2), (2, 4), (4, 8)]
    assert layer_groups(4, 2.0, 4 << 10, 64 << 10) == [(0, 4)]  # small pages: one read
    assert layer_groups(32, 2.0, 64 << 10, 64 << 10)[:3] == [(0, 1), (1, 2), (2, 4)]
    for n in range(1, 40):
        for growth in (1.0, 1.5, 2.0, 3.0):
            for lb in (1 << 10, 48 << 10, 1 << 20):
                g = layer_groups(n, growth, lb, 64 << 10)
                assert g[0][0] == 0 and g[-1][1] == n
                assert all(a[1] == b[0] for a, b in zip(g, g[1:]))
    with pytest.raises(ValueError):
        layer_groups(0)


def test_layer_counter_waits_per_layer_and_reports_a_failure_after_the_forward():
    waited: list[float] = []
    c = LayerCounter(3, Device("cpu"), waited.append)
    i = c.update_producer()
    c.set_consumer(i)
    threading.Timer(0.05, lambda: c.complete(i, 0)).start()
    c.wait_until(0)  # blocks until layer 0 completes
    assert len(waited) == 1 and waited[0] > 0.02
    c.complete(i, 1)
    c.wait_until(1)
    assert len(waited) == 1  # already done: no wait
    c.fail(i, RuntimeError("MAC mismatch"))
    c.wait_until(2)  # does not raise into the forward
    assert c.finish(i) is False
    j = c.update_producer()
    for layer in range(3):
        c.complete(j, layer)
    assert c.finish(j) is True
    c.set_consumer(-1)
    c.wait_until(0)  # a batch without a load


def test_a_layer_that_never_lands_is_given_up_after_the_deadline():
    timeouts: list[tuple[int, int]] = []
    c = LayerCounter(
        3, Device("cpu"), timeout_s=0.05, on_timeout=lambda i, lr: timeouts.append((i, lr))
    )
    i = c.update_producer()
    c.set_consumer(i)
    c.complete(i, 0)
    c.wait_until(0)
    t0 = time.monotonic()
    c.wait_until(1)  # never completes: the forward goes on after the deadline
    assert 0.04 < time.monotonic() - t0 < 2.0
    assert timeouts == [(i, 1)]
    gate = c.gate(i)
    assert gate.cancelled and gate.timed_out
    with pytest.raises(LoadCancelled):
        gate.check()
    c.wait_until(2)  # failed with the rest: no second wait
    assert timeouts == [(i, 1)]
    c.complete(i, 1)  # the stuck load's late layer is ignored, not an error
    assert c.finish(i) is False
    assert c.gate(i).cancelled  # a finished load's gate stays shut
    j = c.update_producer()  # the next load has its own deadline and gate
    for layer in range(3):
        c.complete(j, layer)
    assert c.finish(j) is True and timeouts == [(i, 1)]


class _StuckKV(FakeKV):
    """Ranged reads block until ``go`` is set (a storage process stopped mid-transfer)."""

    def __init__(self):
        super().__init__()
        self.go = threading.Event()
        self.reading = threading.Event()

    def get_ranges(self, *a):
        self.reading.set()
        assert self.go.wait(10)
        return super().get_ranges(*a)


def test_a_stuck_staged_load_given_up_never_writes_into_the_pool():
    kv = _StuckKV()
    pool, index = make_pool(), FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src, dst = torch.arange(1, N + 1), torch.arange(N + 1, 2 * N + 1)
    kv.go.set()
    publish(pool, kv, index, chain, src).close()
    kv.go.clear()
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    loader = Loader(pool, "staged", Arena(pool.device, 1 << 20, store.kv))
    for b in pool.buffers():
        Device.pages_view(b, pool.page_size)[dst] = 0
    counter = LayerCounter(LAYOUT.num_layers, pool.device, timeout_s=0.05)
    i = counter.update_producer()
    counter.set_consumer(i)
    read = store.layerwise(chain, headers_inline=True)
    assert read.start() is None
    outcome: list[object] = []

    def load():
        try:
            outcome.append(
                loader.load(
                    read, dst, lambda lr, ev: counter.complete(i, lr, ev), None, counter.gate(i)
                )
            )
        except LoadCancelled as e:
            outcome.append(e)

    t = threading.Thread(target=load)
    t.start()
    assert kv.reading.wait(5)
    counter.wait_until(0)  # the forward gives the load up
    assert counter.finish(i) is False
    kv.go.set()  # the transfer returns after all
    t.join(5)
    assert len(outcome) == 1 and isinstance(outcome[0], LoadCancelled)
    for page in pages_of(pool, dst):
        assert not page.any()  # none of its bytes reached the pool
    assert kv.sessions == 0  # and its read session is closed
    # with the store back, the same pages load in full
    counter2 = LayerCounter(LAYOUT.num_layers, pool.device, timeout_s=5.0)
    j = counter2.update_producer()
    read = store.layerwise(chain, headers_inline=True)
    assert read.start() is None
    miss, _ = loader.load(
        read, dst, lambda lr, ev: counter2.complete(j, lr, ev), None, counter2.gate(j)
    )
    assert miss is None
    for a, b in zip(pages_of(pool, dst), pages_of(pool, src)):
        assert torch.equal(a, b)


def test_linear_fit_separates_fixed_and_per_unit_cost():
    f = LinearFit(decay=1.0)
    for x in (10, 20, 40, 80):
        f.add(x, 0.005 + 0.001 * x)
    a, b = f.coefficients()
    assert a == pytest.approx(0.005) and b == pytest.approx(0.001)
    g = LinearFit()
    g.add(5, 1.0)
    assert g.coefficients() == (0.0, pytest.approx(0.2))  # one point: through the origin


def test_the_cost_model_loads_only_what_is_faster_than_computing():
    m = CostModel(page_size=16, min_samples=2, explore_every=5)
    assert m.decide(10).reason == "no data"
    for tokens in (100, 400, 1600):
        m.observe_prefill(tokens, 0.002 + 50e-6 * tokens)  # 50 us per token: 0.8 ms per page
    for pages in (10, 50):
        m.observe_load(pages, 0.004 + 0.0002 * pages)  # 0.2 ms per page + 4 ms
    d = m.decide(100)
    assert d.load and d.reason == "faster" and d.load_s < d.compute_s
    assert not m.decide(2).load  # 4.4 ms to load 2 pages, 1.6 ms to compute them
    # a slow store: recompute, but every 5th such hit is loaded to measure again
    for pages in (10, 50, 10, 50):
        m.observe_load(pages, 1.0 + 0.01 * pages)
    decisions = [m.decide(100) for _ in range(10)]
    assert [d.reason for d in decisions].count("explore") == 2
    assert sum(d.load for d in decisions) == 2
    always = CostModel(16, policy="always")
    assert always.decide(1).reason == "always"
    with pytest.raises(ValueError, match="load policy"):
        CostModel(16, policy="never")


def test_scatter_and_gather_move_pages_between_host_rows_and_the_pool():
    pool, dev = make_pool(), Device("cpu")
    ids = torch.tensor([3, 1])
    rows = dev.gather_pages(pool.k[0], ids, pool.page_size)
    assert rows.shape == (2, 4, 2, 8) and rows.is_contiguous()
    dev.scatter_pages(pool.k[1], torch.tensor([5, 6]), rows, pool.page_size)
    assert torch.equal(Device.pages_view(pool.k[1], 4)[5], Device.pages_view(pool.k[0], 4)[3])
    assert dev.record() is None and dev.ready_event() is None
    t = dev.timer()
    t.start()
    t.stop()
    assert t.seconds() >= 0
    assert HEADER_SIZE % 8 == 0  # payloads in an arena slot stay aligned for every dtype


def test_host_page_views_are_the_pool_pages_in_payload_order_and_ids_are_checked():
    pool = make_pool()
    views = pool.host_pages()
    assert len(views) == 2 * pool.num_layers
    for layer in range(pool.num_layers):
        for j, buf in enumerate((pool.k[layer], pool.v[layer])):
            want = Device.pages_view(buf, pool.page_size)[3].reshape(-1).view(torch.uint8)
            assert torch.equal(torch.from_numpy(views[2 * layer + j][3].copy()), want)
    views[1][2] = 7  # a view, not a copy: writes land in the pool
    assert bool((Device.pages_view(pool.v[0], pool.page_size)[2].view(torch.uint8) == 7).all())
    pool.check_page_ids(np.array([0, views[0].shape[0] - 1]))
    for bad in ([-1], [views[0].shape[0]]):
        with pytest.raises(ValueError, match="outside the pool"):
            pool.check_page_ids(np.array(bad))


@pytest.mark.gpu
def test_on_cuda_a_staged_publish_and_load_round_trip_through_pinned_memory(kv):
    """The same publish and staged load on a CUDA pool: the publish waits for the
    forward's event, gathers on a side stream and copies to the pinned arena; the load
    copies each chunk to the GPU on a side stream and the forward's stream waits on the
    layer's event, never the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    host = make_pool()
    pool = KVPool([t.cuda() for t in host.k], [t.cuda() for t in host.v], LAYOUT.page_size)
    index = FakeIndex()
    chain = page_chain(range(N * LAYOUT.page_size), LAYOUT)
    src, dst = torch.arange(1, N + 1), torch.arange(N + 1, 2 * N + 1)
    written = pool.device.ready_event()  # "the forward wrote the rows"
    pub = Publisher(
        pool, lambda: PageStore(LAYOUT, kv, mac_key=KEY), index, "w", arena_bytes=1 << 20
    )
    pub.submit(Offload(list(chain), None, src, [written]))
    pub.join()
    assert pub.results.get_nowait() is True
    pub.close()
    store = PageStore(LAYOUT, kv, mac_key=KEY)
    arena = Arena(pool.device, 1 << 20, store.kv)
    assert arena.buffer.is_pinned()
    loader = Loader(pool, "staged", arena)
    counter = LayerCounter(LAYOUT.num_layers, pool.device)
    index_ = counter.update_producer()
    read = store.layerwise(chain, headers_inline=True)
    assert read.start() is None
    miss, stats = loader.load(
        read, dst, lambda layer, ev: counter.complete(index_, layer, ev), pool.device.ready_event()
    )
    assert miss is None and stats.event is not None
    counter.complete(index_, LAYOUT.num_layers - 1, stats.event)
    counter.set_consumer(index_)
    for layer in range(LAYOUT.num_layers):
        counter.wait_until(layer)  # GPU-side: the current stream waits for the copies
    assert counter.finish(index_)
    for a, b in zip(pages_of(pool, dst.cuda()), pages_of(pool, src.cuda())):
        assert torch.equal(a, b)
