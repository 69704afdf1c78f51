"""The migration control plane on real SGLang workers: the launcher starts a
1P1D cluster (``pd_1p1d_keyed``, shared with ``test_cluster.py``) whose
workers run the migration agent inside their schedulers (plugin hook), the
router exposes the admin endpoints behind its API key, and the command line
drives a layer-weight migration from the prefill worker to the decode worker
through the Mooncake transfer engine while requests run.

Checks: the weights the decode worker holds for the prefill worker's layers
have the checksums of the checkpoint on disk (fused the way SGLang fuses
them); requests before, during and after give the plain worker's greedy
float32 tokens; malformed, unknown-version and stale messages sent to a live
agent are answered with the reason and the worker keeps serving; the admin
endpoints refuse a request without the key and say why for a bad one.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import torch
from safetensors import safe_open
from support.migrate import (
    KEY,
    agents,
    cli,
    counter,
    generate,
    migration,
    pid_of,
    prompts_of,
    wait_state,
)

from bana_sglang import models
from bana_sglang.migrate.client import AgentClient
from bana_sglang.wire import agent as m
from bana_sglang.wire import security

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(pd_1p1d_keyed):
    """The shared keyed 1P1D cluster (tests/conftest.py): its migration timeouts are short."""
    return pd_1p1d_keyed


def status_of(agent: AgentClient) -> m.StatusResult:
    """The agent's ``Status``. The scheduler thread answers the agent at batch
    boundaries; while a step waits for a frozen guest it answers nothing, so on a
    slow machine a call can be read past its deadline and refused as
    ``stale_deadline``: that call is asked again. Any other reply fails the test
    with its reason."""
    for _ in range(3):
        st = agent.call(m.Status)
        if isinstance(st, m.StatusResult):
            return st
        assert isinstance(st, m.Error) and st.reason == "stale_deadline", st
    raise AssertionError(f"Status refused three times in a row: {st}")


def checkpoint_crc(layer: int, name: str) -> int:
    """CRC32 of a layer parameter as SGLang holds it, computed from the checkpoint."""
    path = glob.glob(str(models.resolve("tiny") / "*.safetensors"))[0]
    with safe_open(path, "pt") as f:

        def get(n: str) -> torch.Tensor:
            return f.get_tensor(f"model.layers.{layer}.{n}")

        fused = {
            "self_attn.qkv_proj.weight": [
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ],
            "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        }
        t = torch.cat([get(x) for x in fused[name]]) if name in fused else get(name)
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy()) & 0xFFFFFFFF


def test_status_lists_every_worker_executing_its_own_layers(cluster):
    a = agents(cluster)
    assert set(a) == {"prefill-0", "decode-0"}
    for name, st in a.items():
        assert st["placement"] == [{"start": 0, "stop": st["num_layers"], "executor": name}]
    out = cli(cluster, "status")
    assert out.returncode == 0, out.stderr
    assert "prefill-0 (prefill" in out.stdout and "decode-0 (decode" in out.stdout


def test_layer_weights_move_to_the_decode_worker_while_requests_run(cluster, single_server):
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 1000) for _ in range(20 + 9 * i)] for i in range(6)]
    want = [generate(single_server, ids, 12) for ids in prompts]
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(generate, cluster.url, ids, 12, KEY) for ids in prompts]
        out = cli(
            cluster,
            "migrate",
            "prefill-0",
            "decode-0",
            "--layers",
            "1:3",
            "--id",
            "mig-live",
            "--wait",
            "--stage-only",
        )
        got = [f.result() for f in running]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mig-live: staged" in out.stdout
    assert got == want
    a = agents(cluster)
    src = next(x for x in a["prefill-0"]["migrations"] if x["migration"] == "mig-live")
    dst = next(x for x in a["decode-0"]["migrations"] if x["migration"] == "mig-live")
    assert (src["side"], src["state"], dst["side"], dst["state"]) == (
        "source",
        "staged",
        "guest",
        "verified",
    )
    assert dst["tensors"] == src["tensors"] and len(src["tensors"]) >= 12
    disk = [checkpoint_crc(int(t.split(".", 1)[0]), t.split(".", 1)[1]) for t in dst["tensors"]]
    assert dst["crc32"] == src["crc32"] == disk
    assert a["decode-0"]["guest_bytes"] == src["bytes_total"] == dst["bytes_done"] > 0
    urls = {a[w]["worker"]: a[w]["url"] for w in a}
    assert counter(urls["decode-0"], "bana_migrate_guest_bytes_received_total") == dst["bytes_done"]
    assert counter(urls["prefill-0"], "bana_migrate_migrations_staged_total") == 1
    # still serving, same tokens, after the migration
    assert [generate(cluster.url, ids, 12, KEY) for ids in prompts[:2]] == want[:2]
    # cancel: the decode worker frees its copy
    assert cli(cluster, "cancel", "mig-live").returncode == 0
    deadline = time.monotonic() + 30
    while agents(cluster)["decode-0"]["guest_bytes"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert agents(cluster)["decode-0"]["guest_bytes"] == 0


def test_live_agent_rejects_bad_messages_and_keeps_serving(cluster, single_server):
    a = agents(cluster)
    st = a["prefill-0"]
    client = AgentClient(st["agent"], timeout_s=10)
    try:
        for frame, reason in [
            (b"\x93garbage", "malformed"),
            (
                msgspec.msgpack.encode(
                    {"type": "shrink", "id": 3, "v": 1, "deadline": time.time() + 9}
                ),
                "unknown_type",
            ),
            (
                msgspec.msgpack.encode(
                    {"type": "status", "id": 4, "v": 2, "deadline": time.time() + 9}
                ),
                "unsupported_version",
            ),
            (
                msgspec.msgpack.encode(
                    {"type": "status", "id": 5, "v": 1, "deadline": time.time() - 5}
                ),
                "stale_deadline",
            ),
        ]:
            r = client.send_raw(frame)
            assert isinstance(r, m.Error) and r.reason == reason, r
        r = client.call(
            m.MigrateLayers, migration="too-far", start=0, stop=999, peer="tcp://127.0.0.1:9"
        )
        assert isinstance(r, m.Error) and r.reason == "invalid" and "layers" in r.detail
        assert isinstance(client.call(m.Ping), m.Pong)
    finally:
        client.close()
    ids = [11, 22, 33, 44, 55]
    assert generate(cluster.url, ids, 6, KEY) == generate(single_server, ids, 6)


def test_admin_endpoints_need_the_key_and_name_bad_requests(cluster):
    assert httpx.get(cluster.url + "/bana/admin/agents", timeout=10).status_code == 401
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        cluster.url + "/bana/admin/migrations",
        headers=h,
        timeout=30,
        json={"worker": "prefill-7", "peer": "decode-0", "layers": [0, 1]},
    )
    assert r.status_code == 404 and "prefill-7" in r.text
    r = httpx.post(
        cluster.url + "/bana/admin/migrations",
        headers=h,
        timeout=30,
        json={"worker": "prefill-0", "peer": "decode-0", "layers": [0]},
    )
    assert r.status_code == 400 and "layers" in r.text
    r = httpx.post(
        cluster.url + "/bana/admin/migrations",
        headers=h,
        timeout=30,
        json={"worker": "prefill-0", "peer": "decode-0", "layers": [3, 1]},
    )
    assert r.status_code == 400 and "non-empty range" in r.text
    assert (
        httpx.get(cluster.url + "/bana/admin/migrations/nope", headers=h, timeout=30).status_code
        == 404
    )


# --------------------------------------------------------------------------- the execution switch
def router_speeds(c, until, timeout: float = 15) -> dict[str, float]:
    """Each worker's prefill speed in the router's loads, once ``until(speeds)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        ws = httpx.get(
            c.url + "/bana/router/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        ).json()["workers"]
        speeds = {w["url"]: w["load"]["prefill_speed"] for w in ws}
        if until(speeds):
            return speeds
        assert time.monotonic() < deadline, speeds
        time.sleep(0.3)


def test_prefill_layers_run_on_the_decode_worker_then_come_home(cluster, single_server):
    """Moving compute: layers [1, 3) of the prefill worker execute on the decode
    worker from a batch boundary on, while requests run; then a recall reads the
    weights back from the decode worker's copy and the prefill runs them again."""
    prompts = prompts_of(7, 6)
    want = [generate(single_server, ids, 12) for ids in prompts]
    cached = prompts_of(8, 1, base=70)[0]  # computed before the switch: its KV is not on the guest
    assert generate(cluster.url, cached, 4, KEY) == generate(single_server, cached, 4)
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(generate, cluster.url, ids, 12, KEY) for ids in prompts]
        out = cli(
            cluster,
            "migrate",
            "prefill-0",
            "decode-0",
            "--layers",
            "1:3",
            "--id",
            "sw-prefill",
            "--wait",
        )
        got = [f.result() for f in running]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sw-prefill: remote" in out.stdout
    assert got == want  # requests that finished before, spanned, and started after the switch
    a = agents(cluster)
    assert a["prefill-0"]["placement"] == [
        {"start": 0, "stop": 1, "executor": "prefill-0"},
        {"start": 1, "stop": 3, "executor": "decode-0"},
        {"start": 3, "stop": 4, "executor": "prefill-0"},
    ]
    src = migration(cluster, "prefill-0", "sw-prefill")
    assert src["state"] == "remote" and src["executor"] == "decode-0"
    assert (
        src["released_bytes"] == src["bytes_total"] > 0
    )  # the prefill freed its copy of the weights
    assert a["decode-0"]["guest_bytes"] > src["bytes_total"]  # the weights plus the guest KV
    # after the switch: a prompt extending the one cached before ships its prefix KV to the guest
    before = migration(cluster, "prefill-0", "sw-prefill")
    longer = cached + prompts_of(9, 1, base=30)[0]
    assert generate(cluster.url, longer, 10, KEY) == generate(single_server, longer, 10)
    after = migration(cluster, "prefill-0", "sw-prefill")
    assert after["steps"] > before["steps"] and after["shipped_rows"] >= before["shipped_rows"] + 64
    urls = {w: a[w]["url"] for w in a}
    # the router reads the placements: prefill-0 computes 2 of its 4 layers (twice the
    # prefill speed), decode-0 gives them part of its time
    speeds = router_speeds(cluster, lambda s: s[urls["prefill-0"]] != 1.0)
    assert speeds[urls["prefill-0"]] == pytest.approx(2.0) and speeds[urls["decode-0"]] < 1.0, (
        speeds
    )
    assert counter(urls["prefill-0"], "bana_migrate_migrations_switched_total") == 1
    assert counter(urls["decode-0"], "bana_migrate_guest_steps_total") >= after["steps"]
    # recall: the weights come back from the decode worker, checked against their CRC32
    out = cli(cluster, "recall", "sw-prefill", "--wait")
    assert out.returncode == 0 and "sw-prefill: home" in out.stdout, out.stdout + out.stderr
    a = agents(cluster)
    assert a["prefill-0"]["placement"] == [{"start": 0, "stop": 4, "executor": "prefill-0"}]
    router_speeds(cluster, lambda s: all(v == 1.0 for v in s.values()))
    assert [generate(cluster.url, ids, 12, KEY) for ids in prompts[:3]] == want[:3]
    deadline = time.monotonic() + 30
    while agents(cluster)["decode-0"]["guest_bytes"] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert agents(cluster)["decode-0"]["guest_bytes"] == 0
    assert migration(cluster, "decode-0", "sw-prefill")["state"] == "dropped"


def test_decode_layers_with_the_last_layer_run_on_the_prefill_worker(cluster, single_server):
    """Moving memory: the decode worker's layers [2, 4) (the last one included)
    run on the prefill worker while requests decode; the KV the decode worker
    received through the PD transfer is shipped to the guest as it is read.
    Recalled from the checkpoint on disk."""
    prompts = prompts_of(11, 4)
    want = [generate(single_server, ids, 40) for ids in prompts]
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(generate, cluster.url, ids, 40, KEY) for ids in prompts]
        time.sleep(1.0)
        out = cli(
            cluster,
            "migrate",
            "decode-0",
            "prefill-0",
            "--layers",
            "2:4",
            "--id",
            "sw-decode",
            "--wait",
        )
        got = [f.result() for f in running]
    assert out.returncode == 0 and "sw-decode: remote" in out.stdout, out.stdout + out.stderr
    assert got == want
    assert [generate(cluster.url, ids, 40, KEY) for ids in prompts[:2]] == want[
        :2
    ]  # all after the switch
    src = migration(cluster, "decode-0", "sw-decode")
    assert src["steps"] >= 40 and src["shipped_rows"] > 0
    out = cli(cluster, "recall", "sw-decode", "--from-checkpoint", "--wait")
    assert out.returncode == 0 and "sw-decode: home" in out.stdout, out.stdout + out.stderr
    assert agents(cluster)["decode-0"]["placement"] == [
        {"start": 0, "stop": 4, "executor": "decode-0"}
    ]
    assert [generate(cluster.url, ids, 40, KEY) for ids in prompts[2:]] == want[2:]


def test_a_guest_that_stops_answering_after_the_switch(cluster, single_server):
    """Layers [0, 2) of the decode worker run on the prefill worker; the prefill
    worker then freezes (SIGSTOP). The decode worker's next step gets no answer,
    it reloads the layers from the checkpoint and runs them itself: every
    running request ends with the plain tokens, none hangs."""
    prompts = prompts_of(13, 3)
    want = [generate(single_server, ids, 60) for ids in prompts]
    out = cli(
        cluster, "migrate", "decode-0", "prefill-0", "--layers", "0:2", "--id", "sw-fail", "--wait"
    )
    assert out.returncode == 0 and "sw-fail: remote" in out.stdout, out.stdout + out.stderr
    guest_pid = pid_of(cluster, "prefill-0")
    decode_agent = AgentClient(agents(cluster)["decode-0"]["agent"], timeout_s=20)
    try:
        with ThreadPoolExecutor(3) as pool:
            running = [pool.submit(generate, cluster.url, ids, 60, KEY) for ids in prompts]
            deadline = time.monotonic() + 120
            decode_url = agents(cluster)["decode-0"]["url"]
            while (
                True
            ):  # every request is decoding on decode-0 (none still waits for the prefill worker)
                loads = httpx.get(
                    decode_url + "/v1/loads", headers=security.worker_headers(), timeout=10
                ).json()["loads"]
                if sum(int(x.get("num_running_reqs", 0)) for x in loads) == len(prompts):
                    break
                assert time.monotonic() < deadline and not any(f.done() for f in running), loads
                time.sleep(0.05)
            os.kill(guest_pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 60
                while (
                    info := next(
                        x for x in status_of(decode_agent).migrations if x.migration == "sw-fail"
                    )
                ).state != "restored":
                    assert time.monotonic() < deadline, info
                    time.sleep(0.3)
                got = [f.result(timeout=120) for f in running]
            finally:
                os.kill(guest_pid, signal.SIGCONT)
        assert got == want
        # the freeze lands before the guest answers the step ("no answer from the guest") or
        # after it answered but before its output was read (the bounded transfer-engine read)
        assert info.reason == "peer_lost", info
        assert "no answer from the guest" in info.detail or (
            "reading the guest's output" in info.detail
            and "no data from the transfer engine" in info.detail
        ), info
        st = status_of(decode_agent)
        assert [(p.start, p.stop, p.executor) for p in st.placement] == [(0, 4, "decode-0")]
    finally:
        decode_agent.close()
    wait_healthy(cluster)
    assert [generate(cluster.url, ids, 60, KEY) for ids in prompts[:1]] == want[:1]
    # the guest, running again, is told to drop its copy
    x = wait_state(cluster, "prefill-0", "sw-fail", ("dropped",), timeout=120)
    assert x["side"] == "guest"
    assert agents(cluster)["prefill-0"]["guest_bytes"] == 0


def test_a_guest_that_is_frozen_before_the_switch(cluster, single_server):
    """The peer freezes before the migration: staging fails (peer_unreachable)
    and the worker never stops executing its own layers."""
    endpoints = {w: x["agent"] for w, x in agents(cluster).items()}
    guest_pid = pid_of(cluster, "prefill-0")
    os.kill(guest_pid, signal.SIGSTOP)
    try:
        client = AgentClient(endpoints["decode-0"], timeout_s=20)
        try:
            r = client.call(
                m.MigrateLayers,
                migration="sw-frozen",
                start=1,
                stop=3,
                peer=endpoints["prefill-0"],
                switch=True,
            )
            assert isinstance(r, m.Accepted), r
            deadline = time.monotonic() + 60
            while not isinstance(
                w := client.call(m.Watch, migration="sw-frozen"), (m.Done, m.Failed)
            ):
                assert time.monotonic() < deadline, w
                time.sleep(0.5)
            st = status_of(client)
        finally:
            client.close()
    finally:
        os.kill(guest_pid, signal.SIGCONT)
    assert isinstance(w, m.Failed) and w.reason == "peer_unreachable", w
    assert [(p.start, p.stop, p.executor) for p in st.placement] == [(0, 4, "decode-0")]
    wait_healthy(cluster)
    ids = prompts_of(17, 1)[0]
    assert generate(cluster.url, ids, 12, KEY) == generate(single_server, ids, 12)


def wait_healthy(c, timeout: float = 60) -> None:
    """Until the router sees every worker again (after a frozen one resumed)."""
    deadline = time.monotonic() + timeout
    h = {"Authorization": f"Bearer {KEY}"}
    while httpx.get(c.url + "/health", headers=h, timeout=30).json().get("status") != "ok":
        assert time.monotonic() < deadline, "the router did not see every worker again"
        time.sleep(0.5)


def test_the_live_balancer_moves_prefill_layers_under_a_burst_and_brings_them_home(
    cluster, single_server, tiny_model
):
    """The controller process reads the loads from the router, sees the prefill
    tier hot under a burst of long prompts, switches the prefill worker's tail
    layers to the idle decode worker, and recalls them once the cluster is calm;
    every request gives the plain worker's tokens."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bana_sglang.balancer",
            "--router",
            cluster.url,
            "--model-path",
            str(tiny_model),
            "--interval",
            "0.25",
            "--consecutive",
            "1",
            "--imbalance-threshold",
            "1.2",
            "--min-interval-s",
            "0",
            "--cooldown-s",
            "5",
            "--min-peak",
            "0.5",
            "--prefill-tokens-per-s",
            "200",
            "--recall-after-s",
            "2",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "BANA_API_KEY": KEY},
    )
    try:
        line = proc.stdout.readline()
        assert "bana-balancer ready on" in line, line
        base = line.split(" on ", 1)[1].split()[0]

        def decisions() -> list[dict]:
            return httpx.get(base + "/decisions", timeout=10).json()["decisions"]

        started: list[dict] = []
        for attempt in range(
            3
        ):  # a burst normally suffices; the machine may be slow to report load
            prompts = prompts_of(100 + attempt, 10, base=900, step=40)
            want = [generate(single_server, ids, 6) for ids in prompts]
            with ThreadPoolExecutor(10) as pool:
                got = list(pool.map(lambda ids: generate(cluster.url, ids, 6, KEY), prompts))
            assert got == want
            started = [
                d
                for d in decisions()
                if d["kind"] == "layer_migration" and d["result"] == "started"
            ]
            if started:
                break
        assert started, decisions()
        d = started[0]
        assert d["src"].endswith(str(agents(cluster)["prefill-0"]["url"]).rsplit(":", 1)[1])
        assert d["peak_after"] < d["peak_before"]
        deadline = time.monotonic() + 60
        while not any(
            x["kind"] == "recall" and x["migration"] == d["migration"] for x in decisions()
        ):
            assert time.monotonic() < deadline, decisions()
            time.sleep(0.3)
        x = wait_state(cluster, "prefill-0", d["migration"], ("home",), timeout=60)
        assert x["steps"] >= 0
        assert agents(cluster)["prefill-0"]["placement"] == [
            {"start": 0, "stop": 4, "executor": "prefill-0"}
        ]
        text = httpx.get(base + "/metrics", timeout=10).text
        assert 'bana_balancer_decisions_total{kind="layer_migration",result="started"}' in text
        ids = prompts_of(5, 1)[0]
        assert generate(cluster.url, ids, 12, KEY) == generate(single_server, ids, 12)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
