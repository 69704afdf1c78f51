"""A real 1P1D cluster started through ``python -m bana_sglang.launch``:
the OpenAI-compatible endpoint, the official ``openai`` client, an SGLang
frontend program, exact tokens, bad input, and a clean shutdown.

The cluster is ``pd_1p1d_keyed`` (tests/conftest.py), shared with
``test_migrate_live.py``: its router wants the admin API key on every request,
so every request here sends it. The shutdown test runs after the migration
tests (it stops the cluster).

Everything here is real: mooncake_master, two SGLang workers with the
extension, PD KV transfer over the Mooncake transfer engine (TCP), and the
project's router (``bana_sglang.router``, the launcher's default) in front.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import httpx
import psutil
import pytest
from support.cluster import LaunchedCluster
from support.migrate import KEY, generate

from bana_sglang.launch.procs import shared_files
from bana_sglang.wire import security

pytestmark = pytest.mark.slow

MODEL = "bana-tiny-v1"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def cluster(pd_1p1d_keyed):
    return pd_1p1d_keyed


def post(cluster: LaunchedCluster, path: str, body) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, headers=AUTH, timeout=120)


def test_models_and_completions(cluster):
    models = httpx.get(cluster.url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    r = post(
        cluster,
        "/v1/completions",
        {"model": MODEL, "prompt": "The cache", "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (
        body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    )


def test_chat_streamed_and_not_agree(cluster):
    req = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    r = post(cluster, "/v1/chat/completions", req)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]["message"]["content"]
    pieces = []
    with httpx.stream(
        "POST",
        cluster.url + "/v1/chat/completions",
        json={**req, "stream": True},
        headers=AUTH,
        timeout=120,
    ) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert len(pieces) > 1  # really streamed, chunk by chunk
    assert "".join(pieces) == whole


def test_greedy_tokens_equal_a_plain_single_worker(cluster, single_server):
    for text in ["The prefix cache of the model", "Decode workers publish pages. " * 20]:
        req = {
            "text": text,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        }
        pd = post(cluster, "/generate", req)
        assert pd.status_code == 200, pd.text
        plain = httpx.post(single_server + "/generate", json=req, timeout=120).json()
        assert pd.json()["output_ids"] == plain["output_ids"]


def test_openai_client(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert out.choices[0].message.content and out.usage.completion_tokens == 6
    whole = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=8, temperature=0, stream=True
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    # Byte-level tokens that end inside a UTF-8 character are held back and sent
    # with the next one, so there can be fewer chunks than tokens, never less text.
    assert len(chunks) >= 2
    assert "".join(chunks) == whole.choices[0].text


def test_sglang_frontend_program(cluster, single_server):
    import sglang as sgl

    @sgl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=10, temperature=0)

    through_pd = qa.run(
        question="what is a prefix cache?", backend=sgl.RuntimeEndpoint(cluster.url, api_key=KEY)
    )
    plain = qa.run(question="what is a prefix cache?", backend=sgl.RuntimeEndpoint(single_server))
    assert through_pd["answer"] == plain["answer"]
    assert len(through_pd["answer"]) > 0


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
            400,
            "max_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": -3}},
            400,
            "max_new_tokens",
        ),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "integer"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 4},
            400,
            "longer than the model's context length",
        ),
    ],
)
def test_bad_input_gets_a_4xx_that_names_the_problem_and_serving_goes_on(
    cluster, path, body, status, words
):
    if isinstance(body, bytes):
        r = httpx.post(
            cluster.url + path,
            content=body,
            headers={"content-type": "application/json", **AUTH},
            timeout=120,
        )
    else:
        r = post(cluster, path, body)
    assert r.status_code == status, r.text
    assert words in r.text
    ok = post(
        cluster, "/v1/completions", {"model": MODEL, "prompt": "still there?", "max_tokens": 3}
    )
    assert ok.status_code == 200, ok.text


def test_workers_refuse_calls_without_the_clusters_worker_key(cluster):
    """Every worker requires SGLang's API key, derived from the cluster secret, on every
    endpoint but /health and /metrics: the router (and the project's clients) send it;
    the clients' own key, or none, is refused."""
    r = httpx.get(cluster.url + "/bana/router/workers", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    urls = [w["url"] for w in r.json()["workers"]]
    assert len(urls) == 2
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    for url in urls:
        for path in ("/health", "/metrics"):
            assert httpx.get(url + path, timeout=30).status_code == 200, (url, path)
        for headers in ({}, AUTH):  # nothing, or the router's client key
            for method, path in (
                ("GET", "/bana/info"),
                ("POST", "/flush_cache"),
                ("GET", "/v1/loads"),
            ):
                r = httpx.request(method, url + path, headers=headers, timeout=30)
                assert r.status_code == 401, (url, path, headers, r.status_code)
            r = httpx.post(url + "/generate", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (url, r.status_code)
        ok = httpx.get(url + "/bana/info", headers=security.worker_headers(), timeout=30)
        assert ok.status_code == 200 and ok.json()["bana_sglang"], ok.text
    assert post(cluster, "/generate", body).status_code == 200  # the router gets through


def test_workers_are_forked_and_their_metrics_hold_every_process(cluster):
    """On CPU a worker's scheduler and detokenizer are forked from its server process
    (``BANA_CPU_START_METHOD``), and the worker's /metrics holds the server process's
    own metrics (SGLang's token counters, once lost to an early import of
    prometheus_client) next to the scheduler's, ours included."""
    assert (
        post(
            cluster, "/generate", {"text": "count me", "sampling_params": {"max_new_tokens": 2}}
        ).status_code
        == 200
    )
    workers = httpx.get(cluster.url + "/bana/router/workers", headers=AUTH, timeout=30).json()[
        "workers"
    ]
    prompt_tokens = 0.0
    for w in workers:
        text = httpx.get(w["url"] + "/metrics", timeout=30).text
        samples = {
            line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        # the migration agent's counters live in the scheduler process
        assert "bana_migrate_rejected_requests_total" in samples, w["url"]
        prompt_tokens += samples.get("sglang:prompt_tokens_total", 0.0)  # the server's
    assert prompt_tokens > 0
    root = psutil.Process(cluster.proc.pid)
    spawned = [
        p.cmdline() for p in root.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())
    ]
    assert not spawned, spawned


def test_memory_of_the_1p1d_cluster(cluster, capsys):
    root = psutil.Process(cluster.proc.pid)
    procs = [root, *root.children(recursive=True)]
    rss = sum(p.memory_info().rss for p in procs if p.is_running())
    with capsys.disabled():
        print(f"\n1P1D cluster RSS: {rss / 2**30:.2f} GiB over {len(procs)} processes")
    assert rss < 16 * 2**30


@pytest.mark.stops_shared_cluster
def test_killed_store_processes_are_restarted_and_the_cluster_serves_on(cluster, single_server):
    """SIGKILL of the index service, of the storage process, then of the Mooncake
    master: requests keep getting the plain run's tokens meanwhile (the store is off:
    misses), the launcher restarts each, and the router's /health says ok again.
    (Before the SIGTERM test: it breaks the cluster for a while.)"""
    rng = random.Random(31)
    ids = [rng.randrange(10, 1000) for _ in range(120)]
    want = generate(single_server, ids, 8)
    root = psutil.Process(cluster.proc.pid)

    def health() -> str:
        return httpx.get(cluster.url + "/health", headers=AUTH, timeout=10).json().get("status")

    for marker, name in (
        ("bana_sglang.radix_global.service", "kv-index"),
        ("bana_sglang.radix_global.storage_server", "kv-storage"),
        ("mooncake_master", "mooncake-master"),
    ):
        victim = next(p for p in root.children() if any(marker in a for a in p.cmdline()))
        victim.kill()
        victim.wait(10)
        assert generate(cluster.url, ids, 8, KEY) == want  # served while it is down
        deadline = time.monotonic() + 90
        while not any(f"restarted {name}" in line for line in cluster.lines):
            assert time.monotonic() < deadline, f"{name} was not restarted"
            assert cluster.proc.poll() is None, "the launcher stopped the cluster"
            time.sleep(0.5)
        while health() != "ok":
            assert time.monotonic() < deadline, f"/health not ok after {name} came back"
            time.sleep(1.0)
        assert generate(cluster.url, ids, 8, KEY) == want
    assert cluster.proc.poll() is None


@pytest.mark.stops_shared_cluster
def test_sigterm_stops_everything_and_frees_the_ports(cluster):
    """Last on the cluster (after test_migrate_live.py too): it stops it."""
    root = psutil.Process(cluster.proc.pid)
    tree = [root, *root.children(recursive=True)]
    assert len(tree) >= 5
    ports = set()
    for p in tree:
        try:
            ports |= {
                c.laddr.port
                for c in p.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN
            }
        except psutil.Error:
            pass
    assert ports
    left = shared_files([p.pid for p in tree])  # SGLang's own, never removed by it
    assert left, "every worker maps its load snapshot file"
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(timeout=120) == 0
    time.sleep(1)
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]
    # Nothing listens on them any more. (Binding them again can still fail for a
    # minute: the kernel keeps the killed processes' accepted connections in
    # FIN_WAIT, and those share the listening port; that is not a leak.)
    listening = {
        c.laddr.port for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
    }
    assert not ports & listening
    assert not [f for f in left if os.path.exists(f)], "the launcher removes them"
    assert any("cluster stopped" in line for line in cluster.lines)
