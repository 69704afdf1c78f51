"""Multi-host deployment from a cluster spec, on one machine: three network
namespaces ("hosts") joined by a bridge, one ``python -m bana_sglang.launch
--spec ... --node NAME`` per host, started in reverse order (the router's
host last, the workers' hosts before the master they report to).

    host a: mooncake_master, the global store (segment + index), the router
    host b: prefill-0, decode-0
    host c: prefill-1

Checks: greedy float32 tokens through the router equal a plain worker's; a
prefix computed by prefill-0 (host b) is reused by prefill-1 (host c) through
the store on host a; no part listens on a wildcard address; cutting host c's
link makes the router answer every request on host b and report c missing in
``/health``, and after the link is restored c is routed to again.
Skipped, with the reason, where namespaces cannot be created (not root, no
iproute2). Everything (processes, namespaces, links) is torn down even when
a test fails.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from bana_sglang.launch import NODE_READY_MARK, READY_MARK
from bana_sglang.wire import security

pytestmark = pytest.mark.slow

PAGE = 16
ROUTER_KEY = "multihost-router-key"
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}
HOSTS = ("a", "b", "c")


class Launcher:
    """One node's launcher inside its namespace, its output collected."""

    def __init__(self, lab, i: int, spec: Path, log_dir: Path):
        self.name = HOSTS[i]
        self.lines: list[str] = []
        self.proc = lab.popen(
            i,
            [
                sys.executable,
                "-m",
                "bana_sglang.launch",
                "--spec",
                str(spec),
                "--node",
                self.name,
                "--log-dir",
                str(log_dir / self.name),
                "--startup-timeout",
                "900",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "BANA_API_KEY": ROUTER_KEY},
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def saw(self, text: str) -> bool:
        return any(text in x for x in self.lines)

    def signal_stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class MultiHost:
    def __init__(self, lab, spec: dict, launchers: dict[str, Launcher]):
        self.lab = lab
        self.spec = spec
        self.launchers = launchers
        addr = dict(zip(HOSTS, lab.addrs))
        self.addr = addr
        self.router = f"http://{addr['a']}:{spec['router']['port']}"
        self.prefill = [(f"http://{addr['b']}:30100", 30101), (f"http://{addr['c']}:30100", 30101)]
        self.decode = f"http://{addr['b']}:30102"

    def via_router(self, ids: list[int], n: int, timeout: float = 300) -> httpx.Response:
        return httpx.post(
            self.router + "/generate",
            headers=AUTH,
            timeout=timeout,
            json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}},
        )

    def direct(self, prefill: int, ids: list[int], n: int) -> tuple[dict, dict]:
        """One PD request through prefill worker ``prefill`` (bootstrap protocol, as a router sends it)."""
        url, boot = self.prefill[prefill]
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n},
            "bootstrap_host": url.split("//")[1].rsplit(":", 1)[0],
            "bootstrap_port": boot,
            "bootstrap_room": random.getrandbits(63),
        }
        with ThreadPoolExecutor(1) as pool:
            h = security.worker_headers()
            pre = pool.submit(httpx.post, url + "/generate", json=body, headers=h, timeout=300)
            d = httpx.post(self.decode + "/generate", json=body, headers=h, timeout=300)
            p = pre.result()
        assert d.status_code == 200 and p.status_code == 200, (d.text, p.text)
        return d.json(), p.json()

    def health(self) -> dict:
        return httpx.get(self.router + "/health", headers=AUTH, timeout=10).json()

    def routed(self) -> dict[str, int]:
        workers = httpx.get(self.router + "/bana/router/workers", headers=AUTH, timeout=10).json()
        rows = workers.get("workers", workers) if isinstance(workers, dict) else workers
        return {w["url"]: w["routed"] for w in rows}


def make_spec(addrs: list[str]) -> dict:
    a, b, c = addrs
    return {
        "model": "tiny",
        "nodes": [
            {"name": "a", "address": a, "workers": []},
            {
                "name": "b",
                "address": b,
                "workers": [
                    {"role": "prefill", "port": 30100, "bootstrap_port": 30101},
                    {"role": "decode", "port": 30102, "agent_port": 30103},
                ],
            },
            {
                "name": "c",
                "address": c,
                "workers": [
                    {"role": "prefill", "port": 30100, "bootstrap_port": 30101, "agent_port": 30103}
                ],
            },
        ],
        "master": {"node": "a", "rpc_port": 30110, "metrics_port": 30111},
        "store": {"node": "a", "index_port": 30112, "bytes": "256M"},
        # a short probe backoff: a restored host is readmitted within seconds
        "router": {
            "node": "a",
            "port": 30000,
            "args": "--poll-interval 0.2",
            "api_key_env": "BANA_API_KEY",  # required of a spec across a network
        },
    }


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[MultiHost]:
    netlab = pytest.importorskip("support.netlab")
    why = netlab.unavailable()
    if why:
        pytest.skip(why)
    with netlab.Netlab(3) as lab:
        why = lab.check_reachable()
        if why:
            pytest.skip(f"namespaces cannot reach each other here: {why}")
        tmp = tmp_path_factory.mktemp("multihost")
        spec = make_spec(lab.addrs)
        path = tmp / "cluster.yaml"
        path.write_text(yaml.safe_dump(spec))
        launchers: dict[str, Launcher] = {}
        try:
            for i in (2, 1, 0):  # any order: workers first, the master and router last
                launchers[HOSTS[i]] = Launcher(lab, i, path, tmp / "logs")
                time.sleep(2)
            deadline = time.monotonic() + 900
            # the router's host is ready once requests flow end to end; each node
            # prints its own ready line when its launcher has seen its parts healthy
            while not (
                launchers["a"].saw(READY_MARK)
                and all(x.saw(f"{NODE_READY_MARK} {n}") for n, x in launchers.items())
            ):
                dead = [n for n, x in launchers.items() if x.proc.poll() is not None]
                if dead or time.monotonic() > deadline:
                    out = "\n".join(
                        f"[{n}] {line}" for n, x in launchers.items() for line in x.lines[-25:]
                    )
                    pytest.fail(f"multi-host cluster did not start (exited: {dead}):\n{out}")
                time.sleep(1)
            yield MultiHost(lab, spec, launchers)
        finally:
            for x in launchers.values():  # every node stops at once
                x.signal_stop()
            for x in launchers.values():
                x.wait_stopped()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def plain_tokens(single_server: str, ids: list[int], n: int) -> list[int]:
    r = httpx.post(
        single_server + "/generate",
        timeout=300,
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}},
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def wait_for(check, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.5)


def test_every_node_started_its_share_and_health_lists_every_part(hosts):
    for name in ("b", "c"):
        assert hosts.launchers[name].saw(f"{NODE_READY_MARK} {name}")
    # A node's ready line says its own parts answer; the router learns it at its
    # next health probe, so give the router a few probe intervals to see them.
    seen: dict = {}

    def all_up() -> bool:
        seen.update(hosts.health())
        return seen["status"] == "ok"

    wait_for(all_up, "health 'ok' at the router", timeout=30)
    h = seen
    assert h["missing"] == []
    assert set(h["parts"]) == {f"prefill {u}" for u, _ in hosts.prefill} | {
        f"decode {hosts.decode}",
        "mooncake-master",
        "kv-index",
    }


def test_requests_through_the_router_across_hosts_give_plain_tokens(hosts, single_server):
    for seed in range(4):
        ids = prompt(100 + seed, 40 + 13 * seed)
        r = hosts.via_router(ids, 10)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == plain_tokens(single_server, ids, 10)


def test_prefix_computed_on_one_host_is_reused_on_another(hosts, single_server):
    ids = prompt(7, 300)
    d0, pre0 = hosts.direct(0, ids, 12)  # prefill-0 on host b
    assert pre0["meta_info"]["cached_tokens"] == 0
    want = (300 - 1) // PAGE * PAGE  # every full page but the last token's

    def reused() -> bool:
        nonlocal d1, pre1
        d1, pre1 = hosts.direct(1, ids, 12)  # prefill-1 on host c
        return pre1["meta_info"]["cached_tokens"] == want

    d1 = pre1 = None
    # prefill-0 publishes asynchronously: a first try on host c may come before it landed
    wait_for(reused, f"{want} cached tokens on host c", timeout=60)
    assert d1["output_ids"] == d0["output_ids"] == plain_tokens(single_server, ids, 12)


def spec_ports(spec: dict, node: str) -> set[int]:
    ports = {
        p
        for w in next(n for n in spec["nodes"] if n["name"] == node)["workers"]
        for p in (w["port"], w.get("bootstrap_port"))
        if p
    }
    if node == spec["master"]["node"]:
        ports |= {spec["master"]["rpc_port"], spec["master"]["metrics_port"]}
    ports |= {
        w["agent_port"]
        for n in spec["nodes"]
        if n["name"] == node
        for w in n["workers"]
        if "agent_port" in w
    }
    if node == spec["store"]["node"]:
        ports.add(spec["store"]["index_port"])
    if node == spec["router"]["node"]:
        ports.add(spec["router"]["port"])
    return ports


def test_every_port_the_spec_names_listens_on_its_hosts_address_only(hosts):
    """Mooncake 0.3.13's transfer engine also opens listeners of its own on
    ephemeral ports bound to every interface (its handshake and RPC servers;
    MC_TCP_BIND_ADDRESS does not reach them): those are the only wildcard
    listeners allowed, and none of them is a port the spec names."""
    for i, name in enumerate(HOSTS):
        listeners = hosts.lab.listeners(i)
        named = spec_ports(hosts.spec, name)
        bound = {p: a for a, p in listeners if p in named}
        assert set(bound) == named, f"host {name}: not listening: {sorted(named - set(bound))}"
        assert all(a == hosts.addr[name] for a in bound.values()), f"host {name}: {bound}"
        other = [(a, p) for a, p in listeners if p not in named]
        assert all(
            a in (hosts.addr[name], "127.0.0.1", "::1", "0.0.0.0", "::", "*") for a, _ in other
        ), other


def test_layer_weights_move_between_hosts(hosts):
    """prefill-1 (host c) stages layers on decode-0 (host b) through the router
    on host a: the agents' transfer engines reach each other at the addresses
    the spec advertises."""
    r = httpx.post(
        hosts.router + "/bana/admin/migrations",
        headers=AUTH,
        timeout=60,
        json={
            "worker": "prefill-1",
            "peer": "decode-0",
            "layers": [0, 2],
            "id": "cross-host",
            "switch": False,
        },
    )
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while (
        w := httpx.get(
            hosts.router + "/bana/admin/migrations/cross-host", headers=AUTH, timeout=60
        ).json()
    )["kind"] == "progress":
        assert time.monotonic() < deadline, w
        time.sleep(0.2)
    assert w["kind"] == "done" and w["state"] == "staged", w
    agents = {
        a["worker"]: a
        for a in httpx.get(hosts.router + "/bana/admin/agents", headers=AUTH, timeout=60).json()[
            "agents"
        ]
    }
    assert set(agents) == {"prefill-1", "decode-0"}  # prefill-0 has no agent_port in the spec
    src = next(x for x in agents["prefill-1"]["migrations"] if x["migration"] == "cross-host")
    dst = next(x for x in agents["decode-0"]["migrations"] if x["migration"] == "cross-host")
    assert dst["state"] == "verified" and dst["crc32"] == src["crc32"] and dst["bytes_done"] > 0
    assert agents["prefill-1"]["transfer_session"].startswith(hosts.addr["c"] + ":")
    assert agents["decode-0"]["transfer_session"].startswith(hosts.addr["b"] + ":")
    assert (
        httpx.delete(
            hosts.router + "/bana/admin/migrations/cross-host", headers=AUTH, timeout=60
        ).status_code
        == 200
    )


def test_router_fails_over_when_a_host_is_cut_off_and_recovers(hosts, single_server):
    c_url = hosts.prefill[1][0]
    ids_list = [prompt(200 + s, 30 + 7 * s) for s in range(6)]
    want = [plain_tokens(single_server, ids, 8) for ids in ids_list]
    hosts.lab.cut(2)
    try:
        before = hosts.routed()
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda ids: hosts.via_router(ids, 8), ids_list))
        assert [r.status_code for r in got] == [200] * 6, [
            r.text for r in got if r.status_code != 200
        ]
        assert [r.json()["output_ids"] for r in got] == want
        wait_for(
            lambda: f"prefill {c_url}" in hosts.health()["missing"], "host c reported missing", 30
        )
        h = hosts.health()
        assert h["status"] == "degraded" and h["healthy_prefill"] == 1, h
        # the cut host got nothing after it was marked down
        mid = hosts.routed()
        more = hosts.via_router(ids_list[0], 8)
        assert more.status_code == 200 and more.json()["output_ids"] == want[0]
        assert hosts.routed()[c_url] == mid[c_url]
        assert sum(mid.values()) - sum(before.values()) >= 12  # prefill + decode per request
    finally:
        hosts.lab.restore(2)
    wait_for(lambda: hosts.health()["status"] == "ok", "router health back to ok", 90)
    base = hosts.routed()[c_url]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ids: hosts.via_router(ids, 8), ids_list))
    assert [r.json()["output_ids"] for r in got] == want
    assert hosts.routed()[c_url] > base, "host c was never routed to after its link came back"
