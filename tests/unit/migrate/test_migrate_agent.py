"""The migration agent's control plane and weight staging, fast: two agents in
this process on real ZMQ sockets, real Mooncake transfer engines (TCP on
127.0.0.1) and small layer stacks (the live SGLang path is
``test_migrate_live.py``)."""

from __future__ import annotations

import time

import msgspec
import pytest
from support.agents import Running, wait_state

from bana_sglang.migrate.agent import crc32
from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.wire import agent as m


def test_ping_and_status_say_who_executes_what(pair):
    x, _ = pair
    pong = x.client.call(m.Ping)
    assert isinstance(pong, m.Pong) and (pong.worker, pong.role, pong.num_layers) == (
        "prefill-0",
        "prefill",
        4,
    )
    st = x.client.call(m.Status)
    assert st.placement == [m.Placement(start=0, stop=4, executor="prefill-0")]
    assert st.migrations == [] and st.guest_bytes == 0


def test_layers_are_staged_on_the_peer_with_equal_checksums(pair):
    x, y = pair
    assert not x.agent.busy() and not y.agent.busy()  # their schedulers may sleep long
    r = x.client.call(m.MigrateLayers, migration="mig-1", start=1, stop=3, peer=y.agent.endpoint)
    assert r == m.Accepted(id=r.id, migration="mig-1")
    done = wait_state(x.client, "mig-1")
    assert isinstance(done, m.Done) and done.state == "staged", done
    want = [crc32(p.data) for i in (1, 2) for _, p in x.layers[i].named_parameters()]
    size = sum(p.numel() * 4 for i in (1, 2) for p in x.layers[i].parameters())
    assert done.bytes == size
    guest = y.agent.migrations["mig-1"]
    assert guest.state == "verified" and [crc32(t) for t in guest.guest] == want
    # the guest area holds X's weights, not Y's own (different seeds)
    own_y = [crc32(p.data) for i in (1, 2) for _, p in y.layers[i].named_parameters()]
    assert own_y != want
    sx, sy = x.client.call(m.Status), y.client.call(m.Status)
    assert [(i.migration, i.side, i.state, i.crc32) for i in sx.migrations] == [
        ("mig-1", "source", "staged", want)
    ]
    assert [(i.migration, i.side, i.state, i.peer) for i in sy.migrations] == [
        ("mig-1", "guest", "verified", "prefill-0")
    ]
    assert sy.guest_bytes == size
    assert x.agent.busy() and y.agent.busy()  # staged: both hold a copy
    assert (
        x.agent.metrics.values["migrations_staged"] == 1
        and x.agent.metrics.values["sent_bytes"] == size
    )
    assert y.agent.metrics.values["guest_bytes_received"] == size
    # cancel after staging: the peer frees its copy
    assert isinstance(x.client.call(m.Cancel, migration="mig-1"), m.Ok)
    deadline = time.monotonic() + 10
    while y.client.call(m.Status).guest_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert y.client.call(m.Status).guest_bytes == 0
    assert y.agent.migrations["mig-1"].state == "dropped"
    assert not x.agent.busy() and not y.agent.busy()


def test_invalid_commands_are_refused_with_the_reason(pair):
    x, y = pair
    r = x.client.call(m.MigrateLayers, migration="a", start=3, stop=9, peer=y.agent.endpoint)
    assert isinstance(r, m.Error) and r.reason == "invalid" and "4 layers" in r.detail
    r = x.client.call(m.Watch, migration="nope")
    assert isinstance(r, m.Error) and r.reason == "invalid"
    x.client.call(m.MigrateLayers, migration="b", start=0, stop=2, peer=y.agent.endpoint)
    r = x.client.call(m.MigrateLayers, migration="c", start=1, stop=3, peer=y.agent.endpoint)
    assert isinstance(r, m.Error) and "overlap migration 'b'" in r.detail
    r = x.client.call(m.MigrateLayers, migration="b", start=3, stop=4, peer=y.agent.endpoint)
    assert isinstance(r, m.Error) and "taken" in r.detail
    assert isinstance(wait_state(x.client, "b"), m.Done)


def test_a_peer_with_another_architecture_refuses_the_offer():
    x, z = Running("prefill-0", "prefill", 1), Running("decode-9", "decode", 3, width=32)
    try:
        x.client.call(m.MigrateLayers, migration="arch", start=0, stop=1, peer=z.agent.endpoint)
        r = wait_state(x.client, "arch")
        assert (
            isinstance(r, m.Failed)
            and r.reason == "peer_refused"
            and "same architecture" in r.detail
        )
    finally:
        x.close()
        z.close()


def test_an_unreachable_peer_fails_the_migration_and_the_source_keeps_serving(pair):
    x, _ = pair
    x.client.call(m.MigrateLayers, migration="gone", start=0, stop=1, peer="tcp://127.0.0.1:9")
    r = wait_state(x.client, "gone", timeout=30)
    assert isinstance(r, m.Failed) and r.reason == "peer_unreachable"
    assert isinstance(x.client.call(m.Ping), m.Pong)


def test_peer_killed_mid_transfer_fails_cleanly():
    x, y = (
        Running("prefill-0", "prefill", 1, n=6, width=512),
        Running("decode-0", "decode", 2, n=6, width=512),
    )
    try:
        real_read = y.agent.services.engine().read

        def slow_read(*a, **k):  # one layer at a time, slowly: the kill lands mid-transfer
            time.sleep(0.3)
            return real_read(*a, **k)

        y.agent.services.engine().read = slow_read
        x.client.call(m.MigrateLayers, migration="mid", start=0, stop=6, peer=y.agent.endpoint)
        deadline = time.monotonic() + 10
        while x.agent.migrations["mid"].state != "transferring" and time.monotonic() < deadline:
            time.sleep(0.02)
        y.close()  # the peer's agent goes away
        r = wait_state(x.client, "mid", timeout=30)
        assert isinstance(r, m.Failed) and r.reason in ("peer_unreachable", "cancelled"), r
        assert isinstance(x.client.call(m.Ping), m.Pong)
        assert x.client.call(m.Status).placement == [
            m.Placement(start=0, stop=6, executor="prefill-0")
        ]
    finally:
        x.close()


def test_malformed_unknown_version_and_stale_messages_get_a_reason(pair):
    x, _ = pair
    c = x.client
    cases = [
        (b"\xc1 not msgpack", "malformed"),
        (msgspec.msgpack.encode([1, 2]), "malformed"),
        (
            msgspec.msgpack.encode(
                {"type": "teleport", "id": 5, "v": 1, "deadline": time.time() + 5}
            ),
            "unknown_type",
        ),
        (
            msgspec.msgpack.encode({"type": "ping", "id": 6, "v": 99, "deadline": time.time() + 5}),
            "unsupported_version",
        ),
        (
            msgspec.msgpack.encode({"type": "ping", "id": 7, "v": 1, "deadline": time.time() - 1}),
            "stale_deadline",
        ),
        (
            msgspec.msgpack.encode(
                {
                    "type": "migrate_layers",
                    "id": 8,
                    "v": 1,
                    "deadline": time.time() + 5,
                    "migration": "x y!",
                    "start": 0,
                    "stop": 1,
                    "peer": "tcp://h:1",
                }
            ),
            "malformed",
        ),
    ]
    for frame, reason in cases:
        r = c.send_raw(frame)
        assert isinstance(r, m.Error) and r.reason == reason, (frame, r)
    assert (
        c.send_raw(msgspec.msgpack.encode({"type": "ping", "id": 6, "v": 99, "deadline": 0})).id
        == 6
    )
    assert x.agent.metrics.values["rejected_requests"] == len(cases) + 1
    assert isinstance(c.call(m.Ping), m.Pong)  # still serving


def test_a_client_times_out_on_a_silent_endpoint():
    c = AgentClient("tcp://127.0.0.1:9", timeout_s=0.3)
    with pytest.raises(AgentUnavailable, match="no reply"):
        c.call(m.Ping)
    c.close()


class _SilentAgent:
    """The client of an agent that does not answer: each call blocks until the test
    releases it, then fails as a real client's timeout does. The test decides when a
    probe ends, so what it asserts does not depend on the machine's speed."""

    endpoint = "tcp://127.0.0.1:9"

    def __init__(self):
        import threading

        self.release = threading.Event()
        self.calls = 0

    def call(self, make, *, timeout_s=None, **fields):
        self.calls += 1
        assert self.release.wait(30), "the test never released the probe"
        raise AgentUnavailable(f"no reply from the agent at {self.endpoint} within {timeout_s}s")

    def close(self):
        self.release.set()


def test_the_admin_listing_is_not_held_by_a_silent_agent(pair):
    """A dead worker's agent must not make every listing wait its timeout: the
    listing answers with the live agents while the silent one's probe is out and
    reports it as unanswered, starts no second probe meanwhile, then reports the
    probe's error and probes again."""
    import asyncio

    from bana_sglang.router import admin

    x, _ = pair
    api = admin.AdminAPI(
        (("http://live", x.agent.endpoint), ("http://dead", _SilentAgent.endpoint)),
        is_down=lambda url: url == "http://dead",
    )
    api.agents["http://dead"].close()
    silent = api.agents["http://dead"] = _SilentAgent()

    async def listing() -> dict:
        # a listing that waited for the blocked probe would run into this bound
        return await asyncio.wait_for(api._statuses(), admin.PROBE_WAIT_S + 10)

    async def probes_begun(n: int) -> None:
        # a listing waits PROBE_WAIT_S, not for the probe's thread to pick the call up:
        # on a busy machine that thread can start later than the listing returns
        for _ in range(100):
            if silent.calls >= n:
                return
            await asyncio.sleep(0.1)

    async def scenario() -> list[dict]:
        got = [await listing(), await listing()]  # the probe is blocked throughout
        await probes_begun(1)
        silent.release.set()
        probe = api._probes["http://dead"]
        await asyncio.wait({probe}, timeout=10)
        silent.release.clear()  # the next probe blocks again
        got += [await listing(), await listing()]
        await probes_begun(2)
        return got

    try:
        got = asyncio.run(scenario())
    finally:
        silent.release.set()
        api.close()
    assert all(isinstance(st["http://live"], m.StatusResult) for st in got)
    dead = [st["http://dead"] for st in got]
    assert all(isinstance(d, str) for d in dead), dead
    assert "has not answered yet" in dead[0] and "has not answered yet" in dead[1], dead
    assert "no reply" in dead[2], dead  # the finished probe's error
    assert "has not answered yet" in dead[3], dead  # probed again, not held
    assert silent.calls == 2  # one probe at a time
