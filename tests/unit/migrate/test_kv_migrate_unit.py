"""KV-block migration's parts, fast, with real Mooncake transfer engines (TCP on
127.0.0.1) and a real KV host thread, against a small paged pool: the pages
picked, moved and freed; partial attention on the host merged with the local
part equals attention over the whole KV; recall restores the exact bytes; a
release without free pages carves the range out of SGLang's free; a dead host
loses its segments (the requests are marked to end) without hanging; the KV
channel refuses bad requests. The same on real SGLang workers is in
``test_kv_migrate_live.py``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from bana_sglang.kernels import cpu_attention, merge
from bana_sglang.migrate.kv.host import KVHost
from bana_sglang.migrate.kv.lender import KVLender, KVLost, carve_ranges
from bana_sglang.migrate.transfer import TransferEngine
from bana_sglang.wire import kv_blocks as w

LAYERS, HQ, HKV, D, PAGE, SLOTS = 2, 4, 2, 8, 4, 128


class Pool:
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.k = [torch.randn(SLOTS, HKV, D, generator=g) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, HKV, D, generator=g) for _ in range(LAYERS)]

    def get_key_buffer(self, i):
        return self.k[i]

    def get_value_buffer(self, i):
        return self.v[i]


class Allocator:
    """SGLang's paged allocator, reduced: whole pages, a double free is an error."""

    page_size = PAGE

    def __init__(self, used_pages: int):
        self.free_pages = list(range(used_pages, SLOTS // PAGE))

    def available_size(self) -> int:
        return len(self.free_pages) * PAGE

    def alloc(self, n: int):
        if n // PAGE > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[: n // PAGE], self.free_pages[n // PAGE :]
        return (torch.tensor(pages).unsqueeze(1) * PAGE + torch.arange(PAGE)).reshape(-1)

    def free(self, idx: torch.Tensor) -> None:
        for p in torch.unique(idx // PAGE).tolist():
            assert p not in self.free_pages, f"page {p} freed twice"
            self.free_pages.append(p)


class Tree:
    def __init__(self, alloc, req_to_token):
        self.alloc, self.req_to_token = alloc, req_to_token

    def claim_kv_row(self, req) -> bool:
        return False

    def free_kv_row(self, kv, ranges) -> None:
        for a, b in ranges:
            self.alloc.free(self.req_to_token[kv.req_pool_idx, a:b])


@dataclass
class Kv:
    req_pool_idx: int
    kv_committed_len: int
    cache_protected_len: int = 0


@dataclass
class Req:
    rid: str
    kv: Kv
    skip_radix_cache_insert: bool = False
    done: bool = False
    ids: list = field(default_factory=list)

    def finished(self) -> bool:
        return self.done


def cluster(lens=(37, 22, 9), protected=(0, 0, 0)):
    """A pool whose first pages hold requests of ``lens`` tokens, one row each."""
    req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    reqs, page = [], 0
    for i, (n, pre) in enumerate(zip(lens, protected)):
        pages = -(-n // PAGE)
        slots = (torch.arange(page, page + pages).unsqueeze(1) * PAGE + torch.arange(PAGE)).reshape(
            -1
        )[:n]
        req_to_token[i, :n] = slots.int()
        page += pages
        reqs.append(Req(f"req-{i}", Kv(i, n, pre)))
    alloc = Allocator(page)
    return Pool(), alloc, req_to_token, reqs


@pytest.fixture(scope="module")
def engines():
    return TransferEngine("127.0.0.1"), TransferEngine("127.0.0.1")


@pytest.fixture()
def host(engines):
    h = KVHost(engines[1], "127.0.0.1", "host")
    yield h
    h.close()


def lender_for(engines, host, pool, alloc, req_to_token, mid="kv-1", timeout_s=5.0):
    lender = KVLender(
        pool,
        req_to_token,
        alloc,
        Tree(alloc, req_to_token),
        engines[0],
        num_layers=LAYERS,
        timeout_s=timeout_s,
        hook_retraction=False,
    )
    host.open(mid, "lender", LAYERS)
    lender.open_peer(mid, host.endpoint, engines[1].session)
    return lender


def full_kv(pool, req_to_token, req, layer):
    slots = req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].long()
    return pool.k[layer][slots].clone(), pool.v[layer][slots].clone()


def test_the_oldest_own_complete_pages_of_the_longest_requests_are_picked(engines, host):
    pool, alloc, r2t, reqs = cluster(lens=(37, 22, 9), protected=(0, 8, 0))
    lender = lender_for(engines, host, pool, alloc, r2t)
    picks = lender.pick(reqs, pages=12)
    # req-0: pages [0, 36) are complete (36 holds the last token); req-1: after its 8 tree-owned
    # positions, [8, 20); req-2 has one complete page (below min_pages=2 in the next pick)
    assert [(p.req.rid, p.start, p.stop) for p in picks] == [("req-0", 0, 36), ("req-1", 8, 20)]
    assert [(p.req.rid, p.start, p.stop) for p in lender.pick(reqs, pages=3)] == [("req-0", 0, 12)]
    assert [p.req.rid for p in lender.pick(reqs, pages=12, min_pages=4)] == ["req-0"]
    reqs[0].done = True
    assert [p.req.rid for p in lender.pick(reqs, pages=12)] == ["req-1", "req-2"]
    lender.close()


@pytest.mark.parametrize(
    "inline", [True, False], ids=["queries-inline", "queries-through-the-transfer-engine"]
)
def test_moved_pages_are_freed_and_partial_attention_merges_to_the_whole(
    engines, host, inline, monkeypatch
):
    if not inline:
        monkeypatch.setattr(w, "INLINE_MAX", 0)
    pool, alloc, r2t, reqs = cluster()
    lender = lender_for(engines, host, pool, alloc, r2t)
    ref = {(r.rid, i): full_kv(pool, r2t, r, i) for r in reqs for i in range(LAYERS)}
    before = alloc.available_size()
    st = lender.move("kv-1", lender.pick(reqs, pages=11))
    lender.close_peer("kv-1")  # refused: segments are on the host
    assert "kv-1" in lender.peers
    assert st.segments == 2 and st.pages == 11  # req-0 [0,36) then req-1 [0,8)
    assert alloc.available_size() == before + 11 * PAGE
    assert st.bytes_out >= 11 * PAGE * LAYERS * 2 * HKV * D * 4
    assert host.info()["kv-1"]["segments"] == 2
    for s in alloc.free_pages:  # the freed pages get reused by someone else
        for i in range(LAYERS):
            pool.k[i][s * PAGE : (s + 1) * PAGE] = 1e4
    remote = lender.plan([0, 1, 2])
    assert sorted(remote) == [0, 1] and (remote[0].start, remote[0].stop) == (0, 36)
    torch.manual_seed(1)
    q = torch.randn(3, HQ, D)
    for layer in range(LAYERS):
        pend = lender.attend_begin(layer, q, remote, scale=D**-0.5)
        got = lender.attend_end(pend)
        assert sorted(got) == [0, 1]
        for b, req in enumerate(reqs):
            k, v = ref[(req.rid, layer)]
            want = cpu_attention.reference_attention(
                q[b : b + 1], k, v, scale=D**-0.5, q_offset=None
            ).output
            seg = remote.get(b)
            row = r2t[b, : req.kv.kv_committed_len].long()
            if (
                seg is not None
            ):  # the local part skips the remote positions (their slots are someone else's)
                row = torch.cat((row[: seg.start], row[seg.stop :]))
            local = cpu_attention.attend(
                q[b : b + 1],
                pool.k[layer][row],
                pool.v[layer][row],
                scale=D**-0.5,
                q_offset=None,
                need_lse=True,
            )
            out = local.output
            if b in got:
                o_h, lse_h = got[b]
                out = merge.merge_two(
                    local.output, local.lse, o_h.unsqueeze(0), lse_h.unsqueeze(0)
                ).output
            torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert lender.stats["kv-1"].attend_calls == LAYERS
    lender.close()


def test_recall_and_release_restore_the_exact_bytes_and_free_every_page_once(engines, host):
    pool, alloc, r2t, reqs = cluster()
    lender = lender_for(engines, host, pool, alloc, r2t)
    ref = {r.rid: [full_kv(pool, r2t, r, i) for i in range(LAYERS)] for r in reqs}
    total = alloc.available_size() + sum(-(-r.kv.kv_committed_len // PAGE) * PAGE for r in reqs)
    lender.move("kv-1", lender.pick(reqs, pages=11))
    taken = alloc.alloc(alloc.available_size() - 11 * PAGE)  # others use most of the freed memory
    for i in range(LAYERS):
        pool.k[i][taken.long()] = -7.0
    assert lender.recall_migration("kv-1") == (2, 0)  # 11 pages fit exactly
    assert not lender.segments and host.info()["kv-1"]["segments"] in (
        0,
        1,
        2,
    )  # drops are not awaited
    for r in reqs:
        for i in range(LAYERS):
            k, v = full_kv(pool, r2t, r, i)
            assert torch.equal(k, ref[r.rid][i][0]) and torch.equal(v, ref[r.rid][i][1])
    lender.close_peer("kv-1")  # settled: its socket and buffers go (the drops still go out: linger)
    assert "kv-1" not in lender.peers and lender.stats["kv-1"].recalled == 2
    time.sleep(0.3)
    assert host.info()["kv-1"]["segments"] == 0
    # every request ends: SGLang's release frees each row once; the pool is whole again
    alloc.free(taken)
    for r in reqs:
        lender.tree_cache.claim_kv_row(r)
        lender.tree_cache.free_kv_row(r.kv, [(0, r.kv.kv_committed_len)])
    assert alloc.available_size() == total
    lender.close()


def test_a_release_without_free_pages_carves_the_range_out_and_skips_the_tree(engines, host):
    pool, alloc, r2t, reqs = cluster()
    lender = lender_for(engines, host, pool, alloc, r2t)
    total = alloc.available_size() + sum(-(-r.kv.kv_committed_len // PAGE) * PAGE for r in reqs)
    lender.move("kv-1", lender.pick(reqs, pages=4))
    taken = alloc.alloc(alloc.available_size())  # nothing free: the recall cannot allocate
    r0 = reqs[0]
    lender.tree_cache.claim_kv_row(r0)
    assert r0.skip_radix_cache_insert and lender.carve == {0: (0, 16)}
    lender.tree_cache.free_kv_row(r0.kv, [(0, r0.kv.kv_committed_len)])  # no page freed twice
    assert lender.carve == {} and lender.stats["kv-1"].dropped == 1 and not lender.segments
    alloc.free(taken)
    for r in reqs[1:]:
        lender.tree_cache.claim_kv_row(r)
        lender.tree_cache.free_kv_row(r.kv, [(0, r.kv.kv_committed_len)])
    assert alloc.available_size() == total
    time.sleep(0.2)
    assert host.info()["kv-1"]["segments"] == 0  # the host was told to drop it
    lender.close()


class RetractionBackup:
    def __init__(self, cpu_tensors):
        self.cpu_tensors = cpu_tensors


def sglang_cpu_backup(pool, req_to_token):
    """SGLang's ``cpu_tensor`` retraction backup, run on the fake pool: its own
    ``MHATokenToKVPool.get_cpu_copy`` (chunks of ``cpu_offloading_chunk_size``)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool.k_buffer, pool.v_buffer, pool.layer_num, pool.use_hnd = pool.k, pool.v, LAYERS, False
    pool.cpu_offloading_chunk_size = 5  # chunks that the remote range straddles

    def backup(req, tree_cache, req_to_token_pool, allocator, backend):
        assert backend == "cpu_tensor"
        idx = req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].long()
        req.kv.retraction_backup = RetractionBackup(MHATokenToKVPool.get_cpu_copy(pool, idx))
        return True

    def restore(req, slots):
        MHATokenToKVPool.load_cpu_copy(pool, req.kv.retraction_backup.cpu_tensors, slots)

    return backup, restore


def test_a_retraction_without_free_pages_backs_the_remote_positions_up_from_the_host(engines, host):
    pool, alloc, r2t, reqs = cluster()
    lender = lender_for(engines, host, pool, alloc, r2t)
    r0 = reqs[0]
    want = [full_kv(pool, r2t, r0, layer) for layer in range(LAYERS)]
    lender.move("kv-1", lender.pick(reqs, pages=4))
    seg = lender.segments[0]
    assert (seg.start, seg.stop) == (0, 16)
    hosted = host.info()["kv-1"]["segments"]
    backup, restore = sglang_cpu_backup(pool, r2t)
    taken = alloc.alloc(alloc.available_size())  # nothing free: the segment cannot come home first
    pool.k[0][r2t[0, :16].long()] = 0.0  # the stale slots hold someone else's KV now
    assert lender.backup(r0, backup, (None, None, alloc, "cpu_tensor"), {}) is True
    assert lender.carve == {0: (0, 16)} and r0.skip_radix_cache_insert and 0 not in lender.segments
    assert lender.stats["kv-1"].backed_up == 1 and lender.stats["kv-1"].dropped == 0
    lender.tree_cache.free_kv_row(r0.kv, [(0, r0.kv.kv_committed_len)])  # the retraction's release
    assert lender.carve == {}
    alloc.free(taken)
    # resumed later: fresh slots, SGLang's restore writes the backup; the KV is whole again
    slots = alloc.alloc(-(-r0.kv.kv_committed_len // PAGE) * PAGE)[: r0.kv.kv_committed_len]
    restore(r0, slots)
    for layer in range(LAYERS):
        torch.testing.assert_close(pool.k[layer][slots], want[layer][0], rtol=0, atol=0)
        torch.testing.assert_close(pool.v[layer][slots], want[layer][1], rtol=0, atol=0)
    time.sleep(0.2)
    assert host.info()["kv-1"]["segments"] == hosted - 1  # the host was told to drop r0's
    lender.close()


def test_a_retraction_with_another_backup_kind_is_not_resumable(engines, host):
    pool, alloc, r2t, reqs = cluster()
    lender = lender_for(engines, host, pool, alloc, r2t)
    lender.move("kv-1", lender.pick(reqs, pages=4))
    alloc.alloc(alloc.available_size())
    called = []
    assert (
        lender.backup(
            reqs[0], lambda *a: called.append(a) or True, (None, None, alloc, "host_pool"), {}
        )
        is False
    )
    assert not called and lender.carve == {0: (0, 16)} and reqs[0].skip_radix_cache_insert
    lender.close()


def test_a_dead_host_loses_its_segments_without_hanging(engines):
    pool, alloc, r2t, reqs = cluster()
    host = KVHost(engines[1], "127.0.0.1", "host")
    lender = lender_for(engines, host, pool, alloc, r2t, timeout_s=1.0)
    lender.move("kv-1", lender.pick(reqs, pages=4))
    host.close()
    remote = lender.plan([0, 1, 2])
    t0 = time.monotonic()
    got = lender.attend_end(lender.attend_begin(0, torch.randn(3, HQ, D), remote, scale=0.3))
    assert got == {} and time.monotonic() - t0 < 5
    assert lender.lost == {"req-0": lender.lost["req-0"]} and "no answer" in lender.lost["req-0"]
    assert lender.lost_in("kv-1") and lender.segments[0].state == "lost"
    lender.close_peer("kv-1")  # lost segments never talk to the host again
    assert "kv-1" not in lender.peers
    # a lost segment is never read again, and its request's release carves its range
    assert (
        lender.attend_begin(1, torch.randn(3, HQ, D), lender.plan([0, 1, 2]), scale=0.3).calls == []
    )
    lender.tree_cache.claim_kv_row(reqs[0])
    assert reqs[0].skip_radix_cache_insert and lender.carve == {0: (0, 16)}
    lender.close()


def test_the_kv_channel_refuses_bad_requests(engines, host):
    pool, alloc, r2t, reqs = cluster()
    lender = lender_for(engines, host, pool, alloc, r2t)
    peer = lender.peers["kv-1"]
    with pytest.raises(KVLost, match="invalid: segment 'nope' is not hosted"):
        peer.call(
            w.Attend,
            layer=0,
            keys=["nope"],
            scale=1.0,
            session=engines[0].session,
            addr=peer.send.addr,
            nbytes=64,
            layout=[],
        )
    with pytest.raises(KVLost, match="outside the buffer"):
        peer.call(
            w.HostKV,
            session=engines[0].session,
            addr=peer.send.addr,
            nbytes=16,
            layers=LAYERS,
            kv_heads=HKV,
            head_dim=D,
            dtype="float32",
            segments=[w.Segment(key="a", tokens=4, offset=0)],
        )
    with pytest.raises(KVLost, match="unknown dtype"):
        peer.call(
            w.HostKV,
            session=engines[0].session,
            addr=peer.send.addr,
            nbytes=1 << 20,
            layers=LAYERS,
            kv_heads=HKV,
            head_dim=D,
            dtype="Tensor",
            segments=[],
        )
    other = lender.peers["kv-1"]
    other.migration = "kv-unknown"
    with pytest.raises(KVLost, match="no KV migration 'kv-unknown'"):
        other.call(w.DropKV)
    assert w.decode_request(b"\x00").reason == "malformed"
    lender.close()


def test_carving_a_range_out_of_release_ranges():
    assert carve_ranges([(0, 40)], (8, 24)) == [(0, 8), (24, 40)]
    assert carve_ranges([(8, 40)], (8, 24)) == [(24, 40)]
    assert carve_ranges([(0, 8), (24, 40)], (8, 24)) == [(0, 8), (24, 40)]
    assert carve_ranges([(16, 40)], (8, 24)) == [(24, 40)]
