"""The index service as a real process on a real ZMQ socket, and its client.

Covers: lookup/publish/commit round trips, two-phase publishing between two
workers, eviction through the service, malformed / unknown-type /
unknown-version / stale messages each answered with an Error (and the service
keeps serving), intent expiry, and a client that fails soft while the service
is down and recovers by itself when it comes back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from support.cluster import free_port
from support.radix_index import index_service

from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.wire import index as m
from bana_sglang.wire import security

LAYOUT = KVLayout("svc-test", "float16", page_size=4, num_kv_heads=2, head_dim=8, num_layers=2)


@pytest.fixture(scope="module")
def service() -> Iterator[str]:
    port = free_port()
    with index_service(port, "--capacity-bytes", "10000", "--intent-ttl", "1.5") as proc:
        yield f"tcp://127.0.0.1:{port}"
        assert proc.alive(), "the service died during the tests"


def chain_of(*tokens: int) -> list:
    return page_chain(list(tokens), LAYOUT)


def test_publish_then_lookup_round_trip(service):
    c = IndexClient(service, timeout_s=5, name="w0")
    chain = chain_of(*range(100, 116))  # 4 pages
    assert c.lookup(chain) == (0, (), True)
    grant = c.publish_intent(chain, [100] * 4, "w0")
    assert (grant.start, grant.stop) == (0, 4) and grant.intent > 0
    assert c.lookup(chain).length == 0  # not visible before the commit
    assert c.commit(grant.intent, 4) == 4
    match = c.lookup(chain)
    assert match.length == 4 and match.sizes == (100,) * 4 and match.available
    again = c.publish_intent(chain, [100] * 4, "w0")
    assert again.start == again.stop == 4 and again.note == "present"
    # a longer chain sharing the prefix only writes its new pages
    longer = chain_of(*range(100, 124))
    grant = c.publish_intent(longer, [100] * 6, "w0")
    assert (grant.start, grant.stop) == (4, 6)
    assert c.commit(grant.intent, 1) == 1  # only one of the two was written
    assert c.lookup(longer).length == 5
    assert c.report_loss([longer[2]], "w0") == 3  # page 2 and its descendants
    assert c.lookup(longer).length == 2
    c.close()


def test_clear_forgets_every_page_and_every_pending_intent(service):
    c = IndexClient(service, timeout_s=5, name="clear")
    done, pending = chain_of(*range(700, 708)), chain_of(*range(710, 718))
    g = c.publish_intent(done, [100] * 2, "clear")
    assert c.commit(g.intent, 2) == 2
    g2 = c.publish_intent(pending, [100] * 2, "clear")
    assert c.lookup(done).length == 2
    assert c.clear() >= 2
    assert c.lookup(done).length == 0
    assert c.commit(g2.intent, 2) in (None, 0)  # the intent is gone with the rest
    again = c.publish_intent(pending, [100] * 2, "clear")  # not "pending elsewhere" any more
    assert (again.start, again.stop) == (0, 2)
    c.close()


def test_two_workers_do_not_write_the_same_pages(service):
    a, b = IndexClient(service, timeout_s=5, name="a"), IndexClient(service, timeout_s=5, name="b")
    chain = chain_of(*range(200, 212))
    ga = a.publish_intent(chain, [100] * 3, "a")
    gb = b.publish_intent(chain, [100] * 3, "b")
    assert (ga.start, ga.stop) == (0, 3)
    assert gb.start == gb.stop == 0 and gb.note == "pending elsewhere"
    assert a.commit(ga.intent, 3) == 3
    assert b.lookup(chain).length == 3
    a.close(), b.close()


def test_capacity_is_enforced_by_evicting_lru_leaves(service):
    c = IndexClient(service, timeout_s=5, name="cap")
    chains = [chain_of(*([t] * 8)) for t in range(300, 310)]  # 10 chains x 2 pages x 1000 B
    for ch in chains:
        g = c.publish_intent(ch, [1000, 1000], "cap")
        assert c.commit(g.intent, g.stop - g.start) == g.stop - g.start
        s = c.stats()
        assert s.used_bytes + s.pending_bytes <= s.capacity_bytes
    s = c.stats()
    assert s.evicted > 0 and s.used_bytes <= 10000
    assert c.lookup(chains[-1]).length == 2  # the newest survived
    assert c.lookup(chains[0], touch=False).length == 0  # the oldest went first
    c.close()


def _raw(service: str, *frames: bytes) -> m.Reply:
    """Frames as they come, on a socket of this cluster (the suite's secret)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    keys = security.process_keys()
    if keys is not None:
        security.secure_client(s, keys)
    s.connect(service)
    try:
        s.send_multipart(list(frames))
        assert s.poll(5000), "no reply"
        return m.decode_reply(s.recv())
    finally:
        s.close(0)


def test_bad_messages_get_error_replies_and_service_keeps_serving(service):
    enc = msgspec.msgpack.encode
    cases = {
        b"\xc1not msgpack": "malformed",
        enc([1, 2, 3]): "malformed",
        enc(
            {"type": "lookup", "id": 7, "v": 1, "deadline": time.time() + 5, "chain": ["xyz"]}
        ): "malformed",
        enc({"type": "lookup", "id": 8, "v": 1}): "malformed",  # missing fields
        enc({"type": "drop_tables", "id": 9, "v": 1, "deadline": time.time() + 5}): "unknown_type",
        enc(
            {"type": "stats", "id": 10, "v": 99, "deadline": time.time() + 5}
        ): "unsupported_version",
        m.encode(m.Stats(id=11, deadline=time.time() - 1)): "stale_deadline",
        m.encode(
            m.Commit(id=12, deadline=time.time() + 5, intent=999_999, written=1)
        ): "unknown_intent",
        m.encode(
            m.PublishIntent(
                id=13, deadline=time.time() + 5, chain=chain_of(*range(8)), sizes=[1], owner="x"
            )
        ): "invalid",
    }
    for frame, reason in cases.items():
        reply = _raw(service, frame)
        assert isinstance(reply, m.Error) and reply.reason == reason, (frame, reply)
        assert reply.detail
    reply = _raw(service, b"two", b"frames")
    assert isinstance(reply, m.Error) and reply.reason == "malformed"
    # ids are echoed when readable
    assert _raw(service, enc({"type": "stats", "id": 10, "v": 99, "deadline": 0})).id == 10
    c = IndexClient(service, timeout_s=5)
    assert c.stats() is not None
    c.close()


def test_uncommitted_intent_expires(service):
    c = IndexClient(service, timeout_s=5, name="slow")
    chain = chain_of(*range(400, 404))
    g = c.publish_intent(chain, [100], "slow")
    assert g.stop == 1
    time.sleep(2.0)  # the service runs with --intent-ttl 1.5
    assert c.commit(g.intent, 1) is None  # unknown_intent: logged, not raised
    assert c.lookup(chain).length == 0
    g2 = IndexClient(service, timeout_s=5).publish_intent(chain, [100], "other")
    assert g2.stop == 1  # the pages are free to publish again
    c.close()


def test_client_fails_soft_while_service_is_down_and_recovers(caplog):
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    c = IndexClient(ep, timeout_s=0.3, retry_interval_s=0.5, name="w")
    chain = chain_of(*range(16))
    caplog.set_level(logging.WARNING, logger="bana_sglang.radix_global.client")
    t0 = time.monotonic()
    assert c.lookup(chain) == (0, (), False)
    assert time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    for _ in range(20):  # within the retry interval: immediate misses, no waiting
        assert c.lookup(chain).available is False
        assert c.publish_intent(chain, [1] * 4, "w") is None
    assert time.monotonic() - t0 < 0.25
    with index_service(port, "--capacity-bytes", "100000") as proc:
        deadline = time.monotonic() + 10
        while not c.lookup(chain).available:
            assert time.monotonic() < deadline, "client never recovered"
            time.sleep(0.1)
        g = c.publish_intent(chain, [10] * 4, "w")
        assert c.commit(g.intent, 4) == 4
        proc.kill()  # crash: no goodbye
        proc.reap()
        assert c.lookup(chain).available is False
    with index_service(port, "--capacity-bytes", "100000"):
        deadline = time.monotonic() + 10
        while not (match := c.lookup(chain)).available:
            assert time.monotonic() < deadline, "client never recovered"
            time.sleep(0.1)
        assert match.length == 0  # a restarted index starts empty: misses, not errors
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("unavailable" in x for x in msgs) == 2, msgs  # once per outage episode
    assert sum("reachable again" in x for x in msgs) == 2, msgs
    c.close()


def test_commit_after_the_prefix_was_evicted_indexes_nothing():
    """Between intent and commit the page before the written range can be evicted
    (its bytes leave the store): the commit must not index pages below a hole."""
    port = free_port()
    with index_service(port, "--capacity-bytes", "3000"):
        c = IndexClient(f"tcp://127.0.0.1:{port}", timeout_s=5, name="w")
        base = chain_of(*range(500, 508))  # 2 pages
        g = c.publish_intent(base[:1], [1000], "w")
        assert c.commit(g.intent, 1) == 1
        g = c.publish_intent(base, [1000, 1000], "w")  # writes page 1 below page 0
        assert (g.start, g.stop) == (1, 2)
        other = chain_of(*range(600, 604))
        assert c.report_loss([base[0]], "w") == 1  # page 0 lost meanwhile
        assert c.commit(g.intent, 1) == 0
        assert c.lookup(base, touch=False).length == 0
        g2 = c.publish_intent(other, [1000], "w")
        assert c.commit(g2.intent, 1) == 1
        c.close()
