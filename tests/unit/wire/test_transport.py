"""The one ZMQ transport (bana_sglang.wire.transport) on real sockets on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from typing import Union

import msgspec
import pytest
import zmq

from bana_sglang.wire import transport
from bana_sglang.wire.envelope import Channel, Error, Reply, Request, encode
from bana_sglang.wire.transport import ChannelError, Client, Server


class Echo(Request, tag="echo"):
    text: str
    sleep_s: float = 0.0


class Boom(Request, tag="boom"):
    pass


class Unhandled(Request, tag="unhandled"):
    pass


class Echoed(Reply, tag="echoed"):
    text: str


CHANNEL = Channel("the test channel", 1, Union[Echo, Boom, Unhandled], Union[Echoed, Error])


def echo(req: Echo) -> Echoed:
    time.sleep(req.sleep_s)
    return Echoed(id=req.id, text=req.text)


def boom(req: Boom) -> Echoed:
    raise RuntimeError("a bug")


@pytest.fixture
def server():
    srv = Server(CHANNEL, {Echo: echo, Boom: boom}, "tcp://127.0.0.1:*").start("test-server")
    yield srv
    srv.close()


def test_a_request_gets_its_reply_and_ids_advance(server):
    client = Client(server.endpoint, CHANNEL, timeout_s=5)
    first = client.request(Echo, text="hi")
    second = client.request(Echo, text="again")
    assert (first.text, second.text) == ("hi", "again") and second.id == first.id + 1
    client.close()


def test_refused_requests_are_answered_and_never_executed(server):
    client = Client(server.endpoint, CHANNEL, timeout_s=5)
    now = time.time()
    assert client.send_raw(b"\x00not msgpack").reason == "malformed"
    assert (
        client.send_raw(
            msgspec.msgpack.encode({"type": "nope", "id": 7, "v": 1, "deadline": now + 5})
        ).reason
        == "unknown_type"
    )
    assert (
        client.send_raw(encode(Echo(id=8, deadline=now + 5, v=2, text="x"))).reason
        == "unsupported_version"
    )
    assert (
        client.send_raw(encode(Echo(id=9, deadline=now - 1, text="x"))).reason == "stale_deadline"
    )
    assert (
        client.send_raw(encode(Echo(id=10, deadline=now + 5, text="x")), b"extra").reason
        == "malformed"
    )
    # a type the channel carries but nobody handles
    assert client.request(Unhandled).reason == "unknown_type"
    assert client.request(Echo, text="still serving").text == "still serving"


def test_a_handler_that_raises_is_answered_internal_and_the_server_keeps_serving(server):
    client = Client(server.endpoint, CHANNEL, timeout_s=5)
    err = client.request(Boom)
    assert (
        isinstance(err, Error) and err.reason == "internal" and "RuntimeError: a bug" in err.detail
    )
    assert client.request(Echo, text="after").text == "after"


def test_a_timeout_raises_channel_error_and_the_late_reply_is_skipped(server):
    client = Client(server.endpoint, CHANNEL, timeout_s=5)
    with pytest.raises(ChannelError, match="no reply within 0.20s") as e:
        client.request(Echo, text="slow", sleep_s=0.6, timeout_s=0.2)
    assert e.value.endpoint == server.endpoint and e.value.channel == "the test channel"
    time.sleep(0.6)  # the late reply arrives on a socket that was dropped
    assert client.request(Echo, text="next").text == "next"


def test_the_client_skips_a_reply_to_an_earlier_request(server):
    client = Client(server.endpoint, CHANNEL, timeout_s=5)
    early = client.post(Echo(id=client.next_id(), deadline=client.deadline(), text="early"))
    late = client.post(Echo(id=client.next_id(), deadline=client.deadline(), text="late"))
    assert client.wait(late).text == "late"  # the reply to `early` came first and was skipped
    assert early < late


def test_no_server_is_a_channel_error_not_a_hang():
    client = Client("tcp://127.0.0.1:1", CHANNEL, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ChannelError):
        client.request(Echo, text="anyone?")
    assert time.monotonic() - t0 < 2


def test_extra_frames_travel_both_ways():
    def attend(req: Echo, frames):
        return Echoed(id=req.id, text=req.text), bytes(frames[0])[::-1]

    srv = Server(CHANNEL, {Echo: attend}, "tcp://127.0.0.1:*", extra_frames=True).start("frames")
    try:
        client = Client(srv.endpoint, CHANNEL, timeout_s=5)
        reply = client.request(Echo, b"abc", text="with bytes")
        assert reply.text == "with bytes" and [f.bytes for f in client.frames] == [b"cba"]
    finally:
        srv.close()


def test_a_message_over_the_cap_gets_no_reply():
    srv = Server(CHANNEL, {Echo: echo}, "tcp://127.0.0.1:*", max_message_bytes=1024).start("capped")
    try:
        client = Client(srv.endpoint, CHANNEL, timeout_s=0.5)
        with pytest.raises(ChannelError):
            client.request(Echo, text="x" * 4096)
        assert client.request(Echo, text="small").text == "small"  # a new connection is served
    finally:
        srv.close()


def test_poll_mode_never_blocks_and_counts_rejections():
    rejected = []
    srv = Server(CHANNEL, {Echo: echo}, "tcp://127.0.0.1:*", on_reject=rejected.append)
    try:
        t0 = time.monotonic()
        assert srv.poll() == 0 and time.monotonic() - t0 < 0.05
        client = Client(srv.endpoint, CHANNEL, timeout_s=5)
        stop = threading.Event()
        pump = threading.Thread(target=srv.serve, args=(stop, 10), daemon=True)
        pump.start()
        assert client.send_raw(b"junk").reason == "malformed"
        assert client.request(Echo, text="polled").text == "polled"
        stop.set()
        pump.join(5)
        assert [e.reason for e in rejected] == ["malformed"]
    finally:
        srv.close()


def test_handlers_must_be_for_the_channels_types():
    class Other(Request, tag="other"):
        pass

    with pytest.raises(ValueError, match="Other"):
        Server(CHANNEL, {Other: echo}, "tcp://127.0.0.1:*")


def test_a_server_comes_back_on_its_port_while_the_old_one_is_let_go(monkeypatch):
    """A restarted server binds its old port as soon as it is free (the old socket
    closes on ZMQ's I/O thread; a reconnecting client may hold the port a moment),
    and a port another server holds is refused once the wait is over."""
    first = Server(CHANNEL, {Echo: echo}, "tcp://127.0.0.1:*").start("first")
    endpoint = first.endpoint
    monkeypatch.setattr(transport, "BIND_WAIT_S", 0.3)
    t0 = time.monotonic()
    with pytest.raises(zmq.ZMQError) as held:
        Server(CHANNEL, {Echo: echo}, endpoint)
    assert held.value.errno == zmq.EADDRINUSE and time.monotonic() - t0 >= 0.3
    monkeypatch.setattr(transport, "BIND_WAIT_S", 5.0)
    threading.Timer(0.2, first.close).start()  # let go while the second one waits
    second = Server(CHANNEL, {Echo: echo}, endpoint).start("second")
    try:
        client = Client(endpoint, CHANNEL, timeout_s=5)
        assert client.request(Echo, text="back").text == "back"
        client.close()
    finally:
        second.close()
