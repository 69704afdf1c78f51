"""The live balancer's controller against a fake router on a real HTTP socket:
it reads the loads the router publishes, runs the same policy object as the
simulator, turns a layer migration into a switched migration through the
admin API, a KV-block plan into a KV-block migration, recalls what it started once the
cluster is calm, and says all of it on /metrics and /decisions. The controller
on a live cluster is in ``test_migrate_live.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from bana_sglang.balancer.actions import BalancerConfig, MigrationCostModel
from bana_sglang.balancer.controller import Controller, model_shape
from bana_sglang.balancer.server import serve
from bana_sglang.router.workers import load_to_json
from bana_sglang.types import Tier, WorkerLoad


class FakeRouter:
    def __init__(self):
        self.loads: list[WorkerLoad] = []
        self.posts: list[tuple[str, dict]] = []
        self.refuse = False
        self.movable: dict[str, list[dict]] = {}  # worker url -> what its agent lists as movable
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/bana/admin/agents":
                    self._send(
                        200,
                        {"agents": [{"url": u, "movable": mv} for u, mv in fake.movable.items()]},
                    )
                    return
                assert self.path == "/bana/router/workers"
                self._send(
                    200,
                    {
                        "workers": [
                            {"url": w.worker_id, "healthy": True, "load": load_to_json(w)}
                            for w in fake.loads
                        ]
                    },
                )

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.posts.append((self.path, body))
                if fake.refuse:
                    self._send(400, {"error": {"message": "invalid: no"}})
                else:
                    self._send(202, {"kind": "accepted", "migration": body.get("id", "")})

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def router():
    r = FakeRouter()
    yield r
    r.close()


@pytest.fixture
def shape(tiny_model):
    return model_shape(str(tiny_model), page_size=16, prefill_tokens_per_s=1000.0)


def controller(router: FakeRouter, shape, **kw) -> Controller:
    cfg = BalancerConfig(consecutive=1, min_interval_s=0.0, cooldown_s=0.0, min_peak=0.5)
    return Controller(
        router=router.url,
        balancer_name=kw.pop("balancer", "bana"),
        shape=shape,
        cost=MigrationCostModel(150e6),
        config=cfg,
        **kw,
    )


def hot_prefill() -> list[WorkerLoad]:
    return [
        WorkerLoad(
            "http://p0",
            Tier.PREFILL,
            queued_prefill_tokens=9000,
            busy_fraction=1.0,
            kv_total_tokens=32768,
        ),
        WorkerLoad(
            "http://d0", Tier.DECODE, busy_fraction=0.05, kv_used_tokens=100, kv_total_tokens=32768
        ),
    ]


def test_the_model_shape_comes_from_the_checkpoint(shape):
    assert shape.num_layers == 4 and shape.kv_bytes_per_token == 2 * 2 * 16 * 4 * 4
    assert shape.layer_weight_bytes > 0


def test_a_hot_prefill_tier_moves_tail_layers_to_the_idle_decode_worker(router, shape):
    ctl = controller(router, shape, recall_after_s=0.0)
    router.loads = hot_prefill()
    plan = ctl.tick(now=100.0)
    assert len(plan.actions) == 1
    ((path, body),) = router.posts
    assert path == "/bana/admin/migrations"
    assert body["worker"] == "http://p0" and body["peer"] == "http://d0" and body["switch"] is True
    assert body["layers"][1] == 4 and 0 < body["layers"][0] < 4  # the donor's tail layers
    d = ctl.decisions[-1]
    assert (d.kind, d.result, d.migration) == ("layer_migration", "started", body["id"])
    assert d.peak_after < d.peak_before
    # calm again: what it started is recalled, and said so
    router.loads = [
        WorkerLoad("http://p0", Tier.PREFILL, kv_total_tokens=32768),
        WorkerLoad("http://d0", Tier.DECODE, kv_total_tokens=32768),
    ]
    ctl.tick(now=200.0)
    assert router.posts[-1] == (f"/bana/admin/migrations/{body['id']}/recall", {})
    assert (
        ctl.decisions[-1].kind == "recall"
        and ctl.decisions[-1].result == "recalled"
        and not ctl.active
    )
    text = ctl.metrics_text()
    assert 'bana_balancer_decisions_total{kind="layer_migration",result="started"} 1' in text
    assert 'bana_balancer_decisions_total{kind="recall",result="recalled"} 1' in text


def test_workers_in_a_started_migration_are_not_picked_again(router, shape):
    ctl = controller(router, shape, recall_after_s=1e9)
    router.loads = hot_prefill()
    assert len(ctl.tick(now=100.0).actions) == 1 and len(ctl.active) == 1
    # still hot, cool-down over: the only pair is the one already migrating
    later = ctl.tick(now=200.0)
    assert later.empty and later.reason == "no beneficial action" and len(router.posts) == 1
    # a second idle decode worker can take the other prefill worker's tail
    router.loads = hot_prefill() + [
        WorkerLoad(
            "http://p1",
            Tier.PREFILL,
            queued_prefill_tokens=9000,
            busy_fraction=1.0,
            kv_total_tokens=32768,
        ),
        WorkerLoad("http://d1", Tier.DECODE, busy_fraction=0.05, kv_total_tokens=32768),
    ]
    (act,) = ctl.tick(now=300.0).actions
    assert (act.src, act.dst) == ("http://p1", "http://d1")


def test_a_refused_migration_is_recorded_with_the_answer(router, shape):
    ctl = controller(router, shape)
    router.loads, router.refuse = hot_prefill(), True
    ctl.tick(now=100.0)
    d = ctl.decisions[-1]
    assert d.result == "refused" and "400" in d.reason and not ctl.active


def test_a_memory_bound_decode_worker_moves_kv_pages_and_gets_them_back_when_calm(router, shape):
    ctl = controller(router, shape, recall_after_s=0.0)
    router.loads = [
        WorkerLoad(
            "http://d0", Tier.DECODE, busy_fraction=0.2, kv_used_tokens=30000, kv_total_tokens=32768
        ),
        WorkerLoad(
            "http://d1", Tier.DECODE, busy_fraction=0.1, kv_used_tokens=1000, kv_total_tokens=32768
        ),
    ]
    plan = ctl.tick(now=100.0)
    d = ctl.decisions[-1]
    (act,) = plan.actions  # no running request listed: pages, not a whole request
    ((path, body),) = router.posts
    assert path == "/bana/admin/migrations" and "layers" not in body
    assert (
        body["worker"] == "http://d0"
        and body["peer"] == "http://d1"
        and body["kv_pages"] == act.pages > 0
    )
    assert (d.kind, d.result, d.migration, d.detail) == (
        "kv_block_migration",
        "started",
        body["id"],
        f"{act.pages} KV pages",
    )
    router.loads = [
        WorkerLoad("http://d0", Tier.DECODE, kv_total_tokens=32768),
        WorkerLoad("http://d1", Tier.DECODE, kv_total_tokens=32768),
    ]
    ctl.tick(now=200.0)
    assert router.posts[-1] == (f"/bana/admin/migrations/{body['id']}/recall", {})
    assert ctl.decisions[-1].detail == f"{act.pages} KV pages" and not ctl.active


def test_a_memory_bound_decode_worker_hands_a_listed_request_to_its_peer(router, shape):
    ctl = controller(router, shape)
    router.loads = [
        WorkerLoad(
            "http://d0", Tier.DECODE, busy_fraction=0.2, kv_used_tokens=30000, kv_total_tokens=32768
        ),
        WorkerLoad(
            "http://d1", Tier.DECODE, busy_fraction=0.1, kv_used_tokens=1000, kv_total_tokens=32768
        ),
    ]
    router.movable = {
        "http://d0": [
            {"rid": "bana-m-small", "kv_tokens": 3000, "tokens_left": 50},
            {"rid": "bana-m-big", "kv_tokens": 9000, "tokens_left": 400},
        ]
    }
    plan = ctl.tick(now=100.0)
    (act,) = plan.actions
    ((path, body),) = router.posts
    # the largest request that fits the equalising target moves, whole
    assert body == {
        "worker": "http://d0",
        "peer": "http://d1",
        "id": body["id"],
        "request": "bana-m-big",
    }
    d = ctl.decisions[-1]
    assert (d.kind, d.result, d.migration) == (
        "request_migration",
        "started",
        body["id"],
    ) and act.bytes > 0
    assert not ctl.active  # nothing to recall: the request lives on d1 now
    router.loads = [
        WorkerLoad("http://d0", Tier.DECODE, kv_total_tokens=32768),
        WorkerLoad("http://d1", Tier.DECODE, kv_total_tokens=32768),
    ]
    ctl.tick(now=200.0)
    assert len(router.posts) == 1


def test_the_none_policy_never_acts(router, shape):
    ctl = controller(router, shape, balancer="none")
    router.loads = hot_prefill()
    for t in range(5):
        ctl.tick(now=100.0 + t)
    assert router.posts == [] and not ctl.decisions


def test_metrics_and_decisions_are_served(router, shape):
    ctl = controller(router, shape)
    router.loads = hot_prefill()
    ctl.tick(now=100.0)
    server = serve(ctl, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert "bana_balancer_ticks_total 1" in httpx.get(base + "/metrics").text
        got = httpx.get(base + "/decisions").json()
        assert got["balancer"] == "bana" and got["decisions"][0]["result"] == "started"
        assert httpx.get(base + "/nope").status_code == 404
    finally:
        server.shutdown()


def test_the_command_line_refuses_an_unknown_policy(tiny_model):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bana_sglang.balancer",
            "--model-path",
            str(tiny_model),
            "--balancer",
            "greedy",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and "greedy" in out.stderr


def test_a_layer_host_short_of_memory_gets_the_layers_recalled_before_the_plan(router, shape):
    """The decode worker hosting a donor's layers comes to need its memory (requests
    wait for KV it has not got): the controller recalls that migration at the next tick,
    while the cluster is still busy (no calm period), and says why."""
    ctl = controller(router, shape, recall_after_s=1e9)
    router.loads = hot_prefill()
    ctl.tick(now=100.0)
    ((_, body),) = router.posts
    assert len(ctl.active) == 1
    router.loads = [
        WorkerLoad(
            "http://p0",
            Tier.PREFILL,
            queued_prefill_tokens=9000,
            busy_fraction=1.0,
            kv_total_tokens=32768,
        ),
        WorkerLoad(
            "http://d0",
            Tier.DECODE,
            busy_fraction=0.3,
            kv_used_tokens=32000,
            kv_waiting_tokens=4000,
            inflight_tokens=36000,
            kv_total_tokens=32768,
        ),
    ]
    ctl.tick(now=101.0)
    assert (f"/bana/admin/migrations/{body['id']}/recall", {}) in router.posts
    d = next(x for x in ctl.decisions if x.kind == "recall")
    assert d.result == "recalled" and d.dst == "http://d0" and "needs its memory" in d.reason
    assert "4000 waiting" in d.reason and not ctl.active


def test_a_layer_host_whose_requests_are_all_resident_keeps_the_layers(router, shape):
    """The router's in-flight tokens count resident requests too (live): a host with
    plenty in flight and nothing waiting for memory is not asked for it."""
    ctl = controller(router, shape, recall_after_s=1e9)
    router.loads = hot_prefill()
    ctl.tick(now=100.0)
    assert len(ctl.active) == 1
    router.loads = [
        WorkerLoad(
            "http://p0",
            Tier.PREFILL,
            queued_prefill_tokens=9000,
            busy_fraction=1.0,
            kv_total_tokens=32768,
        ),
        WorkerLoad(
            "http://d0",
            Tier.DECODE,
            busy_fraction=0.3,
            kv_used_tokens=20000,
            inflight_tokens=20000,
            kv_total_tokens=32768,
        ),
    ]
    ctl.tick(now=101.0)
    assert not any(x.kind == "recall" for x in ctl.decisions) and len(ctl.active) == 1
