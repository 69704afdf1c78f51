"""KV-block migration on real SGLang workers: the launcher starts a 2P1D cluster
with the global store; the decode worker's running requests move KV pages to
the second prefill worker's KV host through the Mooncake transfer engine, and
from then on that worker computes the attention over them.

Checks: greedy float32 tokens equal a plain worker's for requests whose pages
move mid-answer (and the peer really computed attention: its calls are
counted); the decode worker's free KV grows by exactly the pages moved; after
the requests end every page is back on both sides (SGLang's own invariant:
free + tree-evictable == pool size on the decode worker, nothing hosted on the
peer); a recall while requests run brings the pages home with the same tokens;
bad commands are refused with the reason; and when the host is killed while it
holds pages, the affected requests never return wrong tokens (they end with an
error or are recomputed), nothing hangs, and the decode worker keeps serving.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.cluster import launched_cluster
from support.migrate import (
    KEY,  # the helpers imported here send it
    agents,
    cli,
    counter,
    generate,
    generate_many,
    migration,
    pid_of,
    prompts_of,
    wait_state,
)

pytestmark = pytest.mark.slow

PAGE = 16  # the launcher's page size with the global store


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with launched_cluster(
        ["--num-prefill", "2", "--num-decode", "1", "--api-key", KEY],
        tmp_path_factory.mktemp("kv-migrate-logs"),
        env={"BANA_KV_STEP_TIMEOUT_S": "5", "BANA_MIGRATE_PEER_TIMEOUT_S": "20"},
    ) as c:
        yield c


def post(url: str, ids: list[int], n: int) -> httpx.Response:
    return httpx.post(
        url + "/generate",
        timeout=300,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}},
    )


def wait_running(c, requests: int, timeout: float = 120) -> None:
    """Until the decode worker's running batch has ``requests`` requests (they decode)."""
    deadline = time.monotonic() + timeout
    while True:
        d = agents(c)["decode-0"]
        if d["running_requests"] >= requests:
            return
        assert time.monotonic() < deadline, d
        time.sleep(0.1)


def wait_idle_and_whole(c, timeout: float = 60) -> dict:
    """Until the decode worker runs nothing and its pool is whole, and the host holds nothing."""
    deadline = time.monotonic() + timeout
    while True:
        a = agents(c)
        d = a["decode-0"]
        if (
            d["kv_free_tokens"] + d["kv_evictable_tokens"] == d["kv_total_tokens"]
            and a["prefill-1"]["kv_hosted_bytes"] == 0
        ):
            return a
        assert time.monotonic() < deadline, (d, a["prefill-1"]["kv_hosted_bytes"])
        time.sleep(0.2)


LONG = prompts_of(21, 4, base=120, step=40)  # 120..240-token prompts
NEW = 200  # tokens each: the requests overlap for seconds on this machine


def test_kv_pages_move_mid_answer_and_the_tokens_stay_the_same(cluster, single_server):
    # long answers without EOS: the move lands at a batch boundary after the peer opened its
    # host (a round trip, seconds on a loaded machine), and requests must still be running then
    n = 3 * NEW
    want = generate_many(single_server, LONG, n, ignore_eos=True)
    wait_idle_and_whole(cluster)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(generate, cluster.url, ids, n, KEY, True) for ids in LONG]
        wait_running(cluster, 2)
        out = cli(
            cluster, "kv", "decode-0", "prefill-1", "--pages", "24", "--id", "kv-live", "--wait"
        )
        during = migration(cluster, "decode-0", "kv-live")
        host = agents(cluster)["prefill-1"]
        got = [f.result() for f in running]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kv-live: remote" in out.stdout
    assert got == want  # requests whose oldest pages moved while they decoded
    kv = during["kv"]
    assert during["kind"] == "kv" and kv["segments"] >= 1 and 1 <= kv["pages"] <= 24
    # the pages went back to the decode worker's allocator at the move's batch boundary
    assert kv["free_after"] - kv["free_before"] == kv["pages"] * PAGE
    assert host["kv_hosted_bytes"] > 0 or during["state"] != "remote"
    # after the requests ended: every segment came home (read back before SGLang freed the row)
    after = wait_state(cluster, "decode-0", "kv-live", ("home",))
    assert after["kv"]["recalled"] == after["kv"]["segments"] and after["kv"]["dropped"] == 0
    assert (
        after["kv"]["attend_calls"] > 0 and after["kv"]["host_s"] > 0
    )  # the peer computed attention
    a = wait_idle_and_whole(cluster)
    urls = {w: a[w]["url"] for w in a}
    assert counter(urls["decode-0"], "bana_migrate_kv_pages_moved_total") >= kv["pages"]
    # the finished requests went into the tree whole: the next turn reuses them exactly
    assert generate(cluster.url, LONG[0] + want[0][:40], 20, KEY) == generate(
        single_server, LONG[0] + want[0][:40], 20
    )


@pytest.mark.parametrize("who", ["lender", "host"])
def test_a_recall_while_requests_run_brings_the_pages_home(cluster, single_server, who):
    """``recall`` on the lender, or ``reclaim`` on the host (it needs its memory:
    it asks the lender to recall)."""
    prompts = prompts_of(22 if who == "lender" else 23, 3, base=150, step=30)
    # longer answers than the other tests: the two CLI calls (a second or more of imports each on
    # a loaded machine) must land while the requests still run, or the pages are home already
    n = 3 * NEW
    want = generate_many(single_server, prompts, n)
    wait_idle_and_whole(cluster)
    mid = f"kv-recall-{who}"
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(generate, cluster.url, ids, n, KEY) for ids in prompts]
        wait_running(cluster, 2)
        out = cli(cluster, "kv", "decode-0", "prefill-1", "--pages", "12", "--id", mid, "--wait")
        assert out.returncode == 0, out.stdout + out.stderr
        rec = (
            cli(cluster, "recall", mid) if who == "lender" else cli(cluster, "reclaim", "prefill-1")
        )
        assert rec.returncode == 0, rec.stdout + rec.stderr
        if who == "host":
            assert "asked 1 lender migration(s) to recall" in rec.stdout, rec.stdout
        home = wait_state(cluster, "decode-0", mid, ("home",))
        got = [f.result() for f in running]
    assert got == want
    assert home["kv"]["recalled"] == home["kv"]["segments"] >= 1
    wait_idle_and_whole(cluster)


def test_bad_kv_commands_are_refused_with_the_reason(cluster):
    hdr = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        cluster.url + "/bana/admin/migrations",
        headers=hdr,
        timeout=30,
        json={"worker": "decode-0", "peer": "prefill-1", "kv_pages": 0},
    )
    assert r.status_code == 400 and "kv_pages" in r.json()["error"]["message"]
    r = httpx.post(
        cluster.url + "/bana/admin/migrations",
        headers=hdr,
        timeout=30,
        json={"worker": "decode-0", "peer": "prefill-1", "kv_pages": 4, "layers": [0, 1]},
    )
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    out = cli(cluster, "kv", "prefill-0", "prefill-1", "--pages", "4")
    assert out.returncode == 2 and "prefill worker" in out.stderr
    # nothing runs: the migration fails and says why
    wait_idle_and_whole(cluster)
    out = cli(cluster, "kv", "decode-0", "prefill-1", "--pages", "4", "--id", "kv-idle", "--wait")
    assert out.returncode == 1 and "no running request" in out.stdout, out.stdout + out.stderr
    # a layer switch is refused while KV pages are away, and the cluster still serves
    assert generate(cluster.url, LONG[1][:50], 8, KEY) == generate(
        cluster.url, LONG[1][:50], 8, KEY
    )


def test_killing_the_host_never_returns_wrong_tokens_and_the_decode_worker_keeps_serving(
    cluster, single_server
):
    prompts = prompts_of(23, 4, base=140, step=30)
    n = 2 * NEW  # long enough that the kill lands while the requests still decode
    want = generate_many(single_server, prompts, n)
    wait_idle_and_whole(cluster)
    host_pid = pid_of(cluster, "prefill-1")  # its scheduler, where the KV host runs
    agents_urls = {name: a["url"] for name, a in agents(cluster).items()}
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(post, cluster.url, ids, n) for ids in prompts]
        wait_running(cluster, 2)
        out = cli(
            cluster, "kv", "decode-0", "prefill-1", "--pages", "40", "--id", "kv-kill", "--wait"
        )
        assert out.returncode == 0, out.stdout + out.stderr
        moved = migration(cluster, "decode-0", "kv-kill")["kv"]["segments"]
        os.kill(host_pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = [f.result() for f in running]
        waited = time.monotonic() - t0
    errors = 0
    for r, w in zip(results, want):
        if r.status_code == 200:
            assert r.json()["output_ids"] == w  # recomputed or unaffected: the plain tokens
        else:
            errors += 1
            assert r.status_code >= 500 and "KV blocks lost" in r.text, r.text
    assert waited < 120
    # the router's listing waits for the dead agent once (30 s), then no longer than 3 s
    r = httpx.get(
        cluster.url + "/bana/admin/agents", headers={"Authorization": f"Bearer {KEY}"}, timeout=90
    )
    assert "error" in next(
        a for a in r.json()["agents"] if a["url"].endswith(agents_urls["prefill-1"])
    )
    t0 = time.monotonic()
    lost = wait_state(cluster, "decode-0", "kv-kill", ("failed",))
    assert time.monotonic() - t0 < 20
    assert lost["reason"] == "peer_lost" and moved >= 1
    # the decode worker keeps serving (with the other prefill worker), exact tokens
    again = prompts_of(24, 2, base=60)
    assert [generate(cluster.url, ids, 16, KEY) for ids in again] == [
        generate(single_server, ids, 16) for ids in again
    ]
    d = agents(cluster)["decode-0"]
    deadline = time.monotonic() + 60
    while d["kv_free_tokens"] + d["kv_evictable_tokens"] != d["kv_total_tokens"]:
        assert time.monotonic() < deadline, d
        time.sleep(0.3)
        d = agents(cluster)["decode-0"]
    print(
        f"host killed: {errors} of {len(results)} requests ended with an error, the rest were exact"
    )
