"""The migration control plane on real SGLang workers: the launcher starts a
1P1D cluster whose workers run the migration agent inside their schedulers
(plugin hook), the router exposes the admin endpoints behind its API key, and
the command line drives a layer-weight migration from the prefill worker to
the decode worker through the Mooncake transfer engine while requests run.

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
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import torch
from conftest import launched_cluster
from safetensors import safe_open

from bana_sglang import models
from bana_sglang.migrate import messages as m
from bana_sglang.migrate.client import AgentClient

pytestmark = pytest.mark.slow

KEY = "migrate-test-key"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with launched_cluster(["--num-prefill", "1", "--num-decode", "1", "--api-key", KEY],
                          tmp_path_factory.mktemp("migrate-logs")) as c:
        yield c


def cli(c, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bana_sglang.migrate", "--router", c.url, *args],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "BANA_API_KEY": KEY})


def agents(c) -> dict[str, dict]:
    r = httpx.get(c.url + "/bana/admin/agents", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {a["worker"]: a for a in r.json()["agents"]}


def generate(url: str, ids: list[int], n: int, key: str | None = None) -> list[int]:
    r = httpx.post(url + "/generate", timeout=300, headers={"Authorization": f"Bearer {key}"} if key else {},
                   json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def checkpoint_crc(layer: int, name: str) -> int:
    """CRC32 of a layer parameter as SGLang holds it, computed from the checkpoint."""
    path = glob.glob(str(models.resolve("tiny") / "*.safetensors"))[0]
    with safe_open(path, "pt") as f:
        def get(n: str) -> torch.Tensor:
            return f.get_tensor(f"model.layers.{layer}.{n}")

        fused = {"self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight"],
                 "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}
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
        out = cli(cluster, "migrate", "prefill-0", "decode-0", "--layers", "1:3", "--id", "mig-live", "--wait")
        got = [f.result() for f in running]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mig-live: staged" in out.stdout
    assert got == want
    a = agents(cluster)
    src = next(x for x in a["prefill-0"]["migrations"] if x["migration"] == "mig-live")
    dst = next(x for x in a["decode-0"]["migrations"] if x["migration"] == "mig-live")
    assert (src["side"], src["state"], dst["side"], dst["state"]) == ("source", "staged", "guest", "verified")
    assert dst["tensors"] == src["tensors"] and len(src["tensors"]) >= 12
    disk = [checkpoint_crc(int(t.split(".", 1)[0]), t.split(".", 1)[1]) for t in dst["tensors"]]
    assert dst["crc32"] == src["crc32"] == disk
    assert a["decode-0"]["guest_bytes"] == src["bytes_total"] == dst["bytes_done"] > 0
    # the counters on the workers' /metrics (SGLang's multiprocess registry)
    def counter(url: str, name: str) -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))

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
            (msgspec.msgpack.encode({"type": "shrink", "id": 3, "v": 1, "deadline": time.time() + 9}),
             "unknown_type"),
            (msgspec.msgpack.encode({"type": "status", "id": 4, "v": 2, "deadline": time.time() + 9}),
             "unsupported_version"),
            (msgspec.msgpack.encode({"type": "status", "id": 5, "v": 1, "deadline": time.time() - 5}),
             "stale_deadline"),
        ]:
            r = client.send_raw(frame)
            assert isinstance(r, m.Error) and r.reason == reason, r
        r = client.call(m.MigrateLayers, migration="too-far", start=0, stop=999, peer="tcp://127.0.0.1:9")
        assert isinstance(r, m.Error) and r.reason == "invalid" and "layers" in r.detail
        assert isinstance(client.call(m.Ping), m.Pong)
    finally:
        client.close()
    ids = [11, 22, 33, 44, 55]
    assert generate(cluster.url, ids, 6, KEY) == generate(single_server, ids, 6)


def test_admin_endpoints_need_the_key_and_name_bad_requests(cluster):
    assert httpx.get(cluster.url + "/bana/admin/agents", timeout=10).status_code == 401
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(cluster.url + "/bana/admin/migrations", headers=h, timeout=30,
                   json={"worker": "prefill-7", "peer": "decode-0", "layers": [0, 1]})
    assert r.status_code == 404 and "prefill-7" in r.text
    r = httpx.post(cluster.url + "/bana/admin/migrations", headers=h, timeout=30,
                   json={"worker": "prefill-0", "peer": "decode-0", "layers": [0]})
    assert r.status_code == 400 and "layers" in r.text
    r = httpx.post(cluster.url + "/bana/admin/migrations", headers=h, timeout=30,
                   json={"worker": "prefill-0", "peer": "decode-0", "layers": [3, 1]})
    assert r.status_code == 400 and "non-empty range" in r.text
    assert httpx.get(cluster.url + "/bana/admin/migrations/nope", headers=h, timeout=30).status_code == 404
