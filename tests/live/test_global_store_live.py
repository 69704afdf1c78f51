"""The global KV cache store end to end: real SGLang PD workers with the linker,
a real ``mooncake_master``, the storage process and the index service.

One 2P1D cluster (planned by the launcher, run in-process so that the test can
kill and restart single parts). Requests go to a chosen prefill worker with
SGLang's bootstrap protocol, the way a router sends them, so the test decides
which worker computes and which one reuses.

Checks:
- a long prompt computed on prefill-0 is reused by prefill-1 (SGLang's
  ``cached_tokens`` covers the shared pages; its own tree never saw them) and
  the greedy float32 tokens equal a plain single worker's;
- multi-turn: turn 2 (turn 1's prompt + answer + a new message) hits pages
  that only the decode worker published (the answer), on the other prefill worker;
- the store's Prometheus counters on each worker's ``/metrics``;
- the Mooncake master killed while requests flow: every request completes
  with the right tokens; after a restart, hits resume;
- a page forged without the cluster secret (valid header and CRC, no valid MAC)
  and a byte flipped in a real page's last layer: the loading prefill worker
  answers 503 (never tokens from the bad page), and the retry gives the plain
  run's tokens from the pages before it;
- the storage process stopped while prefill-0 loads from it: the forward gives the
  load up after ``BANA_STORE_LOAD_TIMEOUT_S`` (503, never tokens), the retry misses
  and recomputes the plain tokens while the storage is still stopped, and hits come
  back once it runs again;
- the router asks the index with SGLang's own page hashes (equal to SGLang's
  function's) and counts only globally uncached tokens as prefill work;
- ``--no-global-store`` plans stock workers (no linker, no store parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from support.cluster import free_port, free_port_block

from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bana_sglang.launch.procs import tcp_open, wait_until
from bana_sglang.radix_global import summary
from bana_sglang.wire import security

pytestmark = pytest.mark.slow

PAGE = 16
DECODE_KV = 4096
LOAD_TIMEOUT_S = 3.0  # prefill-0's deadline for one layer of a load


class PDCluster:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        plan = cluster.plan
        self.prefill: list[tuple[str, int]] = []
        self.decode: list[str] = []
        for part in plan.workers:
            argv = list(part.argv)
            url = part.health_url.removesuffix("/health")
            if "prefill" in part.name:
                self.prefill.append(
                    (url, int(argv[argv.index("--disaggregation-bootstrap-port") + 1]))
                )
            else:
                self.decode.append(url)

    def generate(
        self, prefill: int, ids: list[int], n: int = 8, *, timeout: float = 300
    ) -> tuple[dict, dict]:
        """One PD request through prefill worker ``prefill``; (decode reply, prefill reply)."""
        d, p = self.attempt(prefill, ids, n, timeout=timeout)
        assert d is not None and d.status_code == 200, (p.status_code, p.text)
        assert p.status_code == 200, p.text
        return d.json(), p.json()

    def attempt(
        self, prefill: int, ids: list[int], n: int = 8, *, timeout: float = 300
    ) -> tuple[httpx.Response | None, httpx.Response]:
        """One PD request, whatever it answers; (decode response, prefill response)."""
        url, boot = self.prefill[prefill]
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot,
            "bootstrap_room": random.getrandbits(63),
        }

        async def both() -> tuple[httpx.Response | None, httpx.Response]:
            # as the router does: a failed prefill leaves its decode waiting for KV that
            # never comes, so the decode request is cancelled then (None)
            async with httpx.AsyncClient(timeout=timeout, headers=security.worker_headers()) as c:
                p_task = asyncio.create_task(c.post(url + "/generate", json=body))
                d_task = asyncio.create_task(c.post(self.decode[0] + "/generate", json=body))
                await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                p = await p_task
                if p.status_code != 200 and not d_task.done():
                    d_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await d_task
                    return None, p
                return await d_task, p

        return asyncio.run(both())

    def metrics(self, url: str) -> dict[str, float]:
        return summary.parse(httpx.get(url + "/metrics", timeout=10).text)


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[PDCluster]:
    """2P1D with the store. prefill-0 loads ``staged`` (the default; on the storage
    process's host, through it), prefill-1 straight into its KV pool (``direct``): a reuse
    on either worker exercises one mode. Every hit is loaded (``BANA_STORE_LOAD_POLICY=always``): the
    tests assert exact hit sizes, which the measured choice of recomputing may change."""
    # a small decode KV pool: finished requests' pages must be released after publishing
    cfg = LaunchConfig(
        num_prefill=2,
        num_decode=1,
        port=free_port(),
        worker_base_port=free_port_block(40),
        log_dir=tmp_path_factory.mktemp("store-logs"),
        store_bytes=256 << 20,
        decode_args=("--max-total-tokens", str(DECODE_KV)),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BANA_STORE_LOAD_POLICY", "always")
        plan = plan_cluster(cfg)
    extra = {
        "prefill-0": (("BANA_STORE_LOAD_TIMEOUT_S", str(LOAD_TIMEOUT_S)),),
        "prefill-1": (("BANA_STORE_MODE", "direct"),),
    }
    workers = tuple(
        dataclasses.replace(w, env=(*w.env, *extra.get(w.name, ()))) for w in plan.workers
    )
    plan = dataclasses.replace(plan, workers=workers)
    with Cluster(plan, log_dir=cfg.log_dir, startup_timeout=900) as cluster:
        yield PDCluster(cluster)


def _json(r: httpx.Response) -> dict:
    try:
        return r.json()
    except ValueError:
        return {}


def plain_tokens(single_server: str, ids: list[int], n: int) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
    r = httpx.post(single_server + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def poll_until(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.2)


def wait_indexed(pd: PDCluster, ids: list[int], timeout: float = 30) -> int:
    """Wait until the index lists every full page of ``ids`` (published by the prefill
    worker that computed them or by the decode worker that received them, whichever
    came first); returns the number of pages."""
    from bana_sglang.radix_global.client import IndexClient
    from bana_sglang.radix_global.keys import namespaced, sglang_page_hashes
    from bana_sglang.router.global_index import layout_for

    plan = pd.cluster.plan
    layout = layout_for(plan.model_path, PAGE)
    chain = [namespaced(h, layout) for h in sglang_page_hashes(ids, PAGE)]
    endpoint = next(a for a in plan.router.argv if a.startswith("tcp://"))
    client = IndexClient(endpoint, name="test")
    try:
        poll_until(
            lambda: client.lookup(chain, touch=False).length >= len(chain),
            f"the index listing {len(chain)} pages",
            timeout,
        )
    finally:
        client.close()
    return len(chain)


def test_prefix_computed_on_one_prefill_worker_is_reused_by_another(pd, single_server):
    ids = prompt(1, 300)
    p1 = pd.prefill[1][0]
    d0, pre0 = pd.generate(0, ids, n=12)
    assert pre0["meta_info"]["cached_tokens"] == 0
    wait_indexed(pd, ids)

    loaded_before = pd.metrics(p1).get("loaded_pages", 0)
    d1, pre1 = pd.generate(1, ids, n=12)
    # every full page of the prompt but the last token's (SGLang always computes >= 1 token)
    assert pre1["meta_info"]["cached_tokens"] == (300 - 1) // PAGE * PAGE
    assert d1["output_ids"] == d0["output_ids"] == plain_tokens(single_server, ids, 12)
    m1 = pd.metrics(p1)
    assert m1["loaded_pages"] - loaded_before == (300 - 1) // PAGE
    assert m1["loaded_bytes"] > 0 and m1["load_seconds"] > 0


def test_a_load_through_the_storage_process_and_a_direct_load_give_the_plain_tokens(
    pd, single_server
):
    """The same prompt computed on prefill-1 and loaded by prefill-0 (staged, on the
    storage process's host: the storage process copies the whole pages into its shared
    load arena), then another computed on prefill-0 and loaded by prefill-1 (direct: over
    the transfer engine into the pool's slots); both give a plain worker's greedy tokens.
    (Staged loads over the engine run live in ``test_multihost.py``: there the loading
    worker is on another host than the store.)"""
    pages = (420 - 1) // PAGE
    for seed, (computes, loads) in ((21, (1, 0)), (22, (0, 1))):
        ids = prompt(seed, 420)
        pl = pd.prefill[loads][0]
        d0, _ = pd.generate(computes, ids, n=10)
        wait_indexed(pd, ids)
        before = pd.metrics(pl)
        d1, p1 = pd.generate(loads, ids, n=10)
        assert p1["meta_info"]["cached_tokens"] == pages * PAGE
        after = pd.metrics(pl)
        assert after["loaded_pages"] - before.get("loaded_pages", 0) == pages
        local = after.get("local_loaded_pages", 0) - before.get("local_loaded_pages", 0)
        assert local == (pages if loads == 0 else 0)
        assert d1["output_ids"] == d0["output_ids"] == plain_tokens(single_server, ids, 10)


def test_next_turn_hits_the_answer_published_by_the_decode_worker(pd, single_server):
    turn1 = prompt(2, 200)
    d1, _ = pd.generate(0, turn1, n=40)
    answer = d1["output_ids"]
    assert len(answer) == 40
    full = (len(turn1) + len(answer) - 1) // PAGE  # pages the decode worker can publish
    poll_until(
        lambda: pd.metrics(pd.decode[0]).get("published_pages", 0) > 0,
        "the decode worker publishing",
    )
    time.sleep(1.0)
    turn2 = turn1 + answer + prompt(3, 30)
    d2, pre2 = pd.generate(1, turn2, n=8)
    cached = pre2["meta_info"]["cached_tokens"]
    # more than the prompt alone: the answer's pages came from the decode worker
    assert cached > len(turn1) // PAGE * PAGE, cached
    assert cached >= full * PAGE - PAGE, (cached, full)
    assert d2["output_ids"] == plain_tokens(single_server, turn2, 8)


def test_metrics_and_counters_add_up(pd):
    table = summary.table(
        [(url, pd.metrics(url)) for url, _ in pd.prefill] + [("decode", pd.metrics(pd.decode[0]))]
    )
    print(table)
    assert "(no answer)" not in table and len(table.splitlines()) == 4
    for url, _ in pd.prefill:
        m = pd.metrics(url)
        assert m.get("lookups", 0) >= 1
        assert m.get("load_failures", 0) == 0
        assert (
            0 <= m.get("load_wait_seconds", 0) <= m.get("load_seconds", 0) + 1e-6
            or m.get("load_seconds", 0) == 0
        )
    assert pd.metrics(pd.decode[0]).get("published_pages", 0) > 0


def test_decode_pool_is_released_after_publishing(pd):
    """More finished requests than the decode worker's KV pool holds: each one's
    pages are published, then released for eviction (SGLang's decode loop does not
    acknowledge linker offloads by itself; without the plugin's hook this hangs)."""
    n, length = 3 * DECODE_KV // 300 + 2, 300
    for i in range(n):
        d, _ = pd.generate(i % 2, prompt(100 + i, length), n=4, timeout=120)
        assert d["output_ids"] and d["meta_info"]["finish_reason"]["type"] in ("length", "stop")

    # every request offers its full pages to the store (its prompt's 18 at least). Each is written,
    # or skipped because the prefill worker's copy got there first (present or pending: a race
    # the two workers' timing decides); publishing is asynchronous, so the last may be in flight
    def offered() -> float:
        m = pd.metrics(pd.decode[0])
        return m.get("published_pages", 0) + m.get("publish_skipped_pages", 0)

    poll_until(lambda: offered() >= 18 * n, f"{18 * n} pages offered by decode")
    m = pd.metrics(pd.decode[0])
    assert m.get("published_pages", 0) > 0
    # ... its prompt's 18 when its KV arrived, held back until its first token was out
    assert m.get("publish_held_arrival_pages", 0) >= 18 * n


def test_a_load_stuck_on_a_stopped_storage_process_is_given_up_and_recomputed(pd, single_server):
    storage = next(p for p in pd.cluster.procs if p.name == "kv-storage")
    p0 = pd.prefill[0][0]
    ids = prompt(14, 260)
    want = plain_tokens(single_server, ids, 6)
    d1, _ = pd.generate(1, ids, n=6)  # computed and published by prefill-1
    assert d1["output_ids"] == want
    wait_indexed(pd, ids)
    before = pd.metrics(p0)
    os.kill(storage.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        d, p = pd.attempt(0, ids, n=6, timeout=120)  # a hit: its load hangs in the read
        took = time.monotonic() - t0
        assert p.status_code == 503, p.text  # given up, never tokens from the slots
        assert d is None
        assert LOAD_TIMEOUT_S <= took < LOAD_TIMEOUT_S + 30, took
        t0 = time.monotonic()
        d, p = pd.attempt(0, ids, n=6, timeout=120)  # the router's retry: a miss now
        assert p.status_code == 200 and d is not None and d.status_code == 200, p.text
        assert d.json()["output_ids"] == want
        assert p.json()["meta_info"]["cached_tokens"] == 0
        assert time.monotonic() - t0 < 30
        during = pd.metrics(p0)
        assert during.get("load_timeouts", 0) == before.get("load_timeouts", 0) + 1
        assert during.get("stuck_lookups", 0) > before.get("stuck_lookups", 0)
    finally:
        os.kill(storage.pid, signal.SIGCONT)

    def hit() -> bool:  # the stuck read returns, lookups hit again
        d, p = pd.attempt(0, ids, n=6, timeout=120)
        assert p.status_code in (200, 503), p.text
        if p.status_code != 200:
            return False
        assert d is not None and d.json()["output_ids"] == want
        return p.json()["meta_info"]["cached_tokens"] > 0

    poll_until(hit, "a hit on prefill-0 after the storage process ran again", 90)


def test_master_down_then_back_requests_stay_correct_and_hits_resume(pd, single_server):
    master = next(p for p in pd.cluster.procs if p.name == "mooncake-master")
    part = pd.cluster.plan.master
    rpc = int(next(a for a in part.argv if a.startswith("-rpc_port=")).split("=")[1])
    master.kill()
    master.reap()
    pd.cluster.procs.remove(master)
    try:
        for seed in (4, 5):  # both workers, cold and "cached" prompts: misses, right tokens
            ids = prompt(seed, 180)
            want = plain_tokens(single_server, ids, 6)
            for w in (0, 1):
                d, _ = pd.generate(w, ids, n=6, timeout=120)
                assert d["output_ids"] == want
    finally:
        proc = pd.cluster._spawn(part)
        wait_until(
            lambda: tcp_open("127.0.0.1", rpc, 0.2), proc=proc, what="the master's port", timeout=60
        )
    # the storage process re-mounts its segment, the index notices the empty store
    # and forgets what it listed; publishing and hits resume on their own
    ids = prompt(6, 260)
    want = plain_tokens(single_server, ids, 6)

    def reused() -> bool:
        d0, _ = pd.generate(0, ids, n=6)
        assert d0["output_ids"] == want
        time.sleep(1.0)
        d1, pre1 = pd.generate(1, ids, n=6)
        assert d1["output_ids"] == want
        return pre1["meta_info"]["cached_tokens"] > 0

    # each try may still land in the recovery window; a fresh prompt per try
    deadline = time.monotonic() + 120
    while not reused():
        assert time.monotonic() < deadline, "hits never resumed after the master restarted"
        ids = prompt(int(time.monotonic() * 1000), 260)
        want = plain_tokens(single_server, ids, 6)


def test_router_counts_only_globally_uncached_tokens(pd, single_server):
    """The router asks the index about each prompt with SGLang's own page hashes,
    namespaced like the workers' (a mismatch anywhere would make this a miss)."""
    router = pd.cluster.plan.endpoint
    ids = prompt(7, 200)
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}

    def counters() -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
            if line.startswith("bana_router_global_"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    before = counters()
    first = httpx.post(router + "/generate", json=body, timeout=300)
    assert first.status_code == 200, first.text
    poll_until(
        lambda: (
            counters().get('bana_router_global_lookups_total{outcome="miss"}', 0)
            > before.get('bana_router_global_lookups_total{outcome="miss"}', 0)
        ),
        "a miss counted",
    )
    time.sleep(1.5)  # the prefill worker publishes asynchronously
    second = httpx.post(router + "/generate", json=body, timeout=300)
    assert second.status_code == 200, second.text
    after = counters()
    assert after['bana_router_global_lookups_total{outcome="hit"}'] > before.get(
        'bana_router_global_lookups_total{outcome="hit"}', 0
    )
    assert (
        after["bana_router_global_cached_tokens_total"]
        - before.get("bana_router_global_cached_tokens_total", 0)
        == (200 - 1) // PAGE * PAGE
    )
    assert (
        second.json()["output_ids"]
        == first.json()["output_ids"]
        == plain_tokens(single_server, ids, 6)
    )


def test_a_forged_or_corrupt_page_is_a_miss_and_the_tokens_stay_plain(pd, single_server):
    """Someone who can write to the Mooncake store but lacks the cluster secret puts a page
    with a valid header and CRC but no valid MAC; and a byte of a real page's last layer
    flips after its header verified. Either way the other prefill worker's load stops
    there (a miss, reported), and the answer is the plain run's."""
    import torch

    from bana_sglang.radix_global.keys import namespaced, sglang_page_hashes
    from bana_sglang.radix_global.mooncake_kv import StoreConfig, page_key
    from bana_sglang.radix_global.store import PageStore
    from bana_sglang.router.global_index import layout_for

    plan = pd.cluster.plan
    layout = layout_for(plan.model_path, PAGE)
    master = f"127.0.0.1:{plan.master.tcp_port}"
    store = PageStore.connect(layout, StoreConfig(master_addr=master))
    forger = PageStore(layout, store.kv, mac_key=b"no cluster secret")
    p1 = pd.prefill[1][0]
    try:
        for seed, how in ((12, "forged"), (13, "flipped")):
            ids = prompt(seed, 160)  # 9 full pages below the last token
            chain = [namespaced(h, layout) for h in sglang_page_hashes(ids, PAGE)]
            d0, _ = pd.generate(0, ids, n=10)
            wait_indexed(pd, ids)
            bad = chain[3]
            raw = store.kv.get_bytes(page_key(bad))
            assert raw is not None and len(raw) == store.object_size
            store.kv.remove_many([page_key(bad)], force=True)
            if how == "forged":
                garbage = torch.randn(layout.page_shape)
                assert forger.put_pages([bad], [garbage]).written == 1
            else:
                flipped = bytearray(raw)
                flipped[-3] ^= 0x10  # the last layer: the header verifies, the layers land
                store.kv.put_bytes(page_key(bad), bytes(flipped))
            loaded = pd.metrics(p1).get("loaded_pages", 0)
            failures = pd.metrics(p1).get("load_failures", 0)
            want = plain_tokens(single_server, ids, 10)
            # the load of the bad page fails after its layers landed: SGLang answers the
            # request 503 (the router retries it), never with tokens computed from it
            d, p = pd.attempt(1, ids, n=10, timeout=120)
            assert p.status_code == 503, (how, p.status_code, p.text)  # the MAC caught it
            assert d is None or _json(d).get("output_ids") in (None, want), how
            assert pd.metrics(p1).get("load_failures", 0) > failures, how
            d, p = pd.attempt(1, ids, n=10, timeout=120)  # what the router's retry does
            assert d is not None and d.status_code == 200, (how, p.text)
            assert p.status_code == 200, (how, p.text)
            assert d.json()["output_ids"] == d0["output_ids"] == want, how
            # the bad page and what follows it were reported and forgotten: this request
            # loaded at most the pages before it
            assert p.json()["meta_info"]["cached_tokens"] <= 3 * PAGE, (how, p.json()["meta_info"])
            assert pd.metrics(p1).get("loaded_pages", 0) - loaded <= 3, how
    finally:
        store.kv.close()


def test_router_page_hashes_equal_sglangs():
    """keys.sglang_page_hashes against SGLang's own function, in an SGLang-ready process."""
    import subprocess
    import sys

    from bana_sglang import compat

    code = (
        "import random, json\n"
        "from sglang.srt.mem_cache.utils import get_storage_hash_str\n"
        "from sglang.srt.mem_cache.radix_cache import RadixKey\n"
        "from bana_sglang.radix_global.keys import sglang_page_hashes\n"
        "ids = [random.randrange(0, 2**32) for _ in range(80)]\n"
        "ok = get_storage_hash_str(RadixKey(ids), None, page_size=16) == sglang_page_hashes(ids, 16)\n"
        "salted = get_storage_hash_str(RadixKey(ids, extra_key='x', cache_salt='s'), None, page_size=16)\n"
        "ok2 = salted == sglang_page_hashes(ids, 16, extra_key='x', cache_salt='s')\n"
        "print(json.dumps([ok, ok2]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=compat.child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[true, true]"


def test_no_global_store_plans_stock_workers():
    plan = plan_cluster(
        LaunchConfig(port=free_port(), worker_base_port=free_port_block(20), global_store=False)
    )
    assert not plan.store
    for part in plan.workers:
        assert "--enable-unified-cache-external-linker" not in part.argv
    plan = plan_cluster(LaunchConfig(port=free_port(), worker_base_port=free_port_block(20)))
    assert [p.name for p in plan.store] == ["kv-storage", "kv-index"]
    for part in plan.workers:
        assert "--enable-unified-cache-external-linker" in part.argv
        assert part.argv[part.argv.index("--page-size") + 1] == "16"
