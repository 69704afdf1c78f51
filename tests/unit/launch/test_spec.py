"""The cluster spec: validation with errors that name the field, the example
specs in docs/specs, and the per-node plans the launcher derives from them
(fast: nothing is started)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bana_sglang.launch import plan_spec
from bana_sglang.launch import spec as cluster_spec

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "docs" / "specs").glob("*.yaml"))


def two_hosts() -> dict:
    return {
        "model": "tiny",
        "nodes": [
            {
                "name": "a",
                "address": "10.9.0.1",
                "workers": [
                    {"role": "prefill", "port": 30100, "bootstrap_port": 30101, "agent_port": 30103}
                ],
            },
            {
                "name": "b",
                "address": "10.9.0.2",
                "workers": [
                    {"role": "prefill", "port": 30100, "bootstrap_port": 30101},
                    {"role": "decode", "port": 30102},
                ],
            },
        ],
        "master": {"node": "a", "rpc_port": 50051, "metrics_port": 50052},
        "store": {"node": "a", "index_port": 50053, "bytes": "512M"},
        "router": {"node": "a", "port": 30000},
    }


def write(tmp_path: Path, data: dict, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def load_error(tmp_path: Path, data: dict) -> str:
    with pytest.raises(cluster_spec.SpecError) as e:
        cluster_spec.load(write(tmp_path, data))
    return str(e.value)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_specs_are_valid_and_plan_every_node(path):
    assert len(EXAMPLES) >= 3
    spec = cluster_spec.load(path)
    seen: list[str] = []
    for n in spec.nodes:
        plan = plan_spec(spec, n.name, dry_run=True)
        seen += [p.name for p in plan.parts]
        for part in plan.workers:  # every worker binds its node's bind address
            argv = list(part.argv)
            assert argv[argv.index("--host") + 1] == n.bind_address
    workers = [name for _, name, _ in spec.workers()]
    assert sorted(seen) == sorted(
        ["mooncake-master", "router", *workers, *(["kv-storage", "kv-index"] if spec.store else [])]
    )


def test_node_plan_advertises_addresses_and_binds_only_its_own(tmp_path):
    spec = cluster_spec.load(write(tmp_path, two_hosts()))
    a = plan_spec(spec, "a")
    b = plan_spec(spec, "b")
    assert [p.name for p in a.parts] == [
        "mooncake-master",
        "kv-storage",
        "kv-index",
        "prefill-0",
        "router",
    ]
    assert [p.name for p in b.parts] == ["prefill-1", "decode-0"]
    assert b.master is None and b.router is None and not b.store
    router = list(a.router.argv)
    # peers by their advertised addresses, bind on its own
    assert router[router.index("--host") + 1] == "10.9.0.1"
    prefills = [tuple(router[i + 1 : i + 3]) for i, a in enumerate(router) if a == "--prefill"]
    assert prefills == [("http://10.9.0.1:30100", "30101"), ("http://10.9.0.2:30100", "30101")]
    assert "http://10.9.0.2:30102" in router
    assert (
        "--watch" in router
        and "mooncake-master=10.9.0.1:50051" in router
        and "kv-index=10.9.0.1:50053" in router
    )
    # every part of b reaches the master and index on a; Mooncake and SGLang advertise b's address
    decode = " ".join(b.workers[1].argv)
    assert "tcp://10.9.0.1:50053" in decode and "10.9.0.1:50051" in decode
    assert b.env["SGLANG_HOST_IP"] == "10.9.0.2" and b.env["BANA_STORE_HOST"] == "10.9.0.2"
    assert b.env["MC_TCP_BIND_ADDRESS"] == "10.9.0.2" and b.env["MOONCAKE_PROTOCOL"] == "tcp"
    assert a.endpoint == b.endpoint == "http://10.9.0.1:30000"
    assert a.router.health_url == "http://10.9.0.1:30000/health"
    # the migration agent where the spec asks for one, and the router knows it
    assert dict(a.workers[0].env)["BANA_AGENT_ENDPOINT"] == "tcp://10.9.0.1:30103"
    assert "http://10.9.0.1:30100=tcp://10.9.0.1:30103" in router
    assert "BANA_AGENT_ENDPOINT" not in dict(b.workers[0].env)
    # every worker requires the cluster's worker key (the bana router sends it)
    assert all(dict(w.env)["BANA_WORKER_AUTH"] == "1" for w in (*a.workers, *b.workers))
    # the storage process takes puts on loopback; only the store node's workers use it
    storage = list(a.store[0].argv)
    assert storage[storage.index("--put-listen") + 1] == "tcp://127.0.0.1:50054"
    assert '"storage":"tcp://127.0.0.1:50054"' in " ".join(a.workers[0].argv)
    assert all('"storage"' not in " ".join(w.argv) for w in b.workers)


def test_single_machine_plan_gives_every_worker_an_agent():
    from bana_sglang.launch import LaunchConfig, plan_cluster

    plan = plan_cluster(
        LaunchConfig(num_prefill=2, num_decode=1, port=30000, worker_base_port=30100)
    )
    assert plan.router.health_url == "http://127.0.0.1:30000/health"
    endpoints = [dict(w.env)["BANA_AGENT_ENDPOINT"] for w in plan.workers]
    assert len(set(endpoints)) == 3
    argv = list(plan.router.argv)
    assert [argv[i + 1] for i, x in enumerate(argv) if x == "--agent"] == [
        f"{w.health_url.removesuffix('/health')}={e}" for w, e in zip(plan.workers, endpoints)
    ]


def test_bind_differs_from_advertised_address(tmp_path):
    data = two_hosts()
    data["nodes"][1]["bind"] = "0.0.0.0"
    spec = cluster_spec.load(write(tmp_path, data))
    b = plan_spec(spec, "b")
    argv = list(b.workers[0].argv)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert b.workers[0].health_url == "http://10.9.0.2:30100/health"
    assert b.env["MC_TCP_BIND_ADDRESS"] == "0.0.0.0" and b.env["SGLANG_HOST_IP"] == "10.9.0.2"


def test_store_on_another_node_than_the_master_waits_for_it(tmp_path):
    data = two_hosts()
    data["store"]["node"] = "b"
    spec = cluster_spec.load(write(tmp_path, data))
    storage = plan_spec(spec, "b").store[0]
    assert storage.needs == (("mooncake-master", "10.9.0.1:50051"),)
    assert "--setup-timeout" in storage.argv


def test_gpu_worker_devices_and_rdma(tmp_path):
    data = two_hosts()
    data["nodes"][1].update(transport="rdma", rdma_devices="mlx5_0")
    data["nodes"][1]["workers"][1]["device"] = "cuda:3"
    spec = cluster_spec.load(write(tmp_path, data))
    b = plan_spec(spec, "b")
    argv = " ".join(b.workers[1].argv)
    assert "--base-gpu-id 3" in argv and "--disaggregation-ib-device mlx5_0" in argv
    assert b.env["MOONCAKE_PROTOCOL"] == "rdma" and b.env["BANA_STORE_RDMA_DEVICES"] == "mlx5_0"


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (
            lambda d: d["nodes"][0]["workers"][0].pop("bootstrap_port"),
            "nodes.0.workers.0: a prefill worker needs",
        ),
        (
            lambda d: d["nodes"][1]["workers"][1].update(bootstrap_port=1),
            "bootstrap_port is for prefill",
        ),
        (lambda d: d["nodes"][1].update(name="a"), "node names must be unique: a"),
        (lambda d: d["master"].update(node="zz"), "master.node 'zz' is not one of the nodes"),
        (lambda d: d["nodes"][1]["workers"].pop(), "at least one decode worker"),
        (lambda d: d["nodes"][0].update(address="127.0.0.1"), "advertises loopback"),
        (lambda d: d["nodes"][0].update(address="0.0.0.0"), "address '0.0.0.0' is a wildcard"),
        (lambda d: d["nodes"][0].update(address="not an address!"), "nodes.0: address"),
        (
            lambda d: d["nodes"][0]["workers"][0].update(port=50051),
            "port 50051 on node 'a' is used by both",
        ),
        (
            lambda d: d["router"].update(port=70000),
            "router.port: Input should be less than or equal to 65535",
        ),
        (lambda d: d["router"].update(policy="nope"), "router.policy 'nope'"),
        (lambda d: d["store"].update(bytes="lots"), "store.bytes"),
        (
            lambda d: d["nodes"][0].update(tranport="tcp"),
            "nodes.0.tranport: Extra inputs are not permitted",
        ),
        (lambda d: d["nodes"][0]["workers"][0].update(device="gpu"), "device 'gpu'"),
    ],
)
def test_invalid_specs_name_the_field(tmp_path, mutate, expect):
    data = two_hosts()
    mutate(data)
    assert expect in load_error(tmp_path, data)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(cluster_spec.SpecError, match="cannot read cluster spec"):
        cluster_spec.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(cluster_spec.SpecError, match="is not valid YAML"):
        cluster_spec.load(bad)
    (tmp_path / "c.ini").write_text("x")
    with pytest.raises(cluster_spec.SpecError, match="use a .yaml"):
        cluster_spec.load(tmp_path / "c.ini")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(cluster_spec.SpecError, match="top level must be a mapping"):
        cluster_spec.load(tmp_path / "list.yaml")


def test_toml_spec(tmp_path):
    toml = """
model = "tiny"
[[nodes]]
name = "solo"
address = "127.0.0.1"
workers = [{role = "prefill", port = 30100, bootstrap_port = 30101}, {role = "decode", port = 30102}]
[master]
node = "solo"
[router]
node = "solo"
"""
    p = tmp_path / "c.toml"
    p.write_text(toml)
    spec = cluster_spec.load(p)
    assert spec.store is None and [n for _, n, _ in spec.workers()] == ["prefill-0", "decode-0"]


def test_launcher_cli_errors(tmp_path):
    path = write(tmp_path, two_hosts())

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "bana_sglang.launch", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = run("--spec", str(path))
    assert r.returncode == 2 and "has 2 nodes: say which to start with --node (a, b)" in r.stderr
    r = run("--spec", str(path), "--node", "zz")
    assert r.returncode == 2 and "--node 'zz' is not in the spec" in r.stderr
    r = run("--spec", str(path), "--node", "a", "--num-prefill", "3")
    assert r.returncode == 2 and "--spec replaces --num-prefill" in r.stderr
    r = run("--node", "a")
    assert r.returncode == 2 and "--node needs --spec" in r.stderr
    r = run("--spec", str(path), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "[a] mooncake-master:" in r.stdout and "[b] decode-0:" in r.stdout


def test_a_spec_across_a_network_needs_the_same_secret_file_on_every_node(tmp_path):
    spec = two_hosts()
    path = write(tmp_path, spec)
    env = {k: v for k, v in os.environ.items() if k != "BANA_CLUSTER_SECRET_FILE"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "bana_sglang.launch", "--spec", str(path), "--node", "a", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    r = run()  # a router open to the network is refused first
    assert r.returncode == 2 and "spans a network: set router.api_key_env" in r.stderr
    spec["router"]["api_key_env"] = "BANA_API_KEY"
    path = write(tmp_path, spec)
    env["BANA_API_KEY"] = "a key for the router"
    r = run()
    assert r.returncode == 2 and "spans a network: give --cluster-secret-file" in r.stderr
    missing = tmp_path / "nowhere.secret"
    r = run("--cluster-secret-file", str(missing))
    assert r.returncode == 2 and "is missing: every node must read the same file" in r.stderr
    assert not missing.exists()  # never made up on one node
    loose = tmp_path / "loose.secret"
    loose.write_text("x" * 64)
    loose.chmod(0o644)
    r = run("--cluster-secret-file", str(loose))
    assert r.returncode == 2 and "readable by others" in r.stderr
