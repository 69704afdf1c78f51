"""The cluster secret and CurveZMQ on the one transport, on real sockets on 127.0.0.1."""

from __future__ import annotations

import os
import stat
import threading
from typing import Union

import pytest
import zmq

from bana_sglang.wire import security
from bana_sglang.wire.envelope import Channel, Error, Reply, Request, encode
from bana_sglang.wire.transport import ChannelError, Client, Server


class Echo(Request, tag="echo"):
    text: str


class Echoed(Reply, tag="echoed"):
    text: str


CHANNEL = Channel("the secured test channel", 1, Union[Echo], Union[Echoed, Error])


def echo(req: Echo) -> Echoed:
    return Echoed(id=req.id, text=req.text)


@pytest.fixture
def secret_file(tmp_path, monkeypatch):
    path = security.create_secret_file(tmp_path / "secret")
    monkeypatch.setenv("BANA_CLUSTER_SECRET_FILE", str(path))
    return path


@pytest.fixture
def secured(secret_file):
    calls = []

    def counted(req):
        calls.append(req)
        return echo(req)

    srv = Server(CHANNEL, {Echo: counted}, "tcp://127.0.0.1:*").start("secure-test-server")
    yield srv, calls
    srv.close()


def test_the_secret_file_is_private_and_long_enough(tmp_path):
    p = security.create_secret_file(tmp_path / "s")
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert len(security.read_secret(p)) == 64
    assert security.create_secret_file(p).read_text() == p.read_text()  # never overwritten
    os.chmod(p, 0o644)
    with pytest.raises(security.SecretError, match="readable by others.*chmod 600"):
        security.read_secret(p)
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(security.SecretError, match="at least 32"):
        security.read_secret(short)
    with pytest.raises(security.SecretError, match="missing"):
        security.read_secret(tmp_path / "missing")


def test_keys_are_derived_per_purpose_and_per_secret():
    a, b = security.curve_keys(b"a" * 32), security.curve_keys(b"b" * 32)
    assert a == security.curve_keys(b"a" * 32)
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert security.derive(b"a" * 32, "bana-kv-page") != security.derive(b"a" * 32, "other")


def test_a_client_holding_the_secret_is_answered(secured):
    srv, calls = secured
    assert srv.keys is not None
    client = Client(srv.endpoint, CHANNEL, timeout_s=5)
    assert client.keys == srv.keys
    assert client.request(Echo, text="hi").text == "hi"
    assert len(calls) == 1
    client.close()


def test_a_client_without_the_secret_gets_nothing_and_commands_nothing(secured):
    srv, calls = secured
    plain = Client(srv.endpoint, CHANNEL, timeout_s=1, keys=None)
    with pytest.raises(ChannelError, match="no reply"):
        plain.request(Echo, text="let me in")
    plain.close()
    # a raw socket speaking the protocol without CURVE
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(srv.endpoint)
    raw.send(encode(Echo(id=1, deadline=2e9, text="raw")))
    assert not raw.poll(1000)
    raw.close()
    assert calls == []


def test_a_client_with_another_clusters_secret_is_refused(secured, tmp_path):
    srv, calls = secured
    other = security.curve_keys(b"another cluster's secret, long enough")
    wrong_client = security.CurveKeys(
        srv.keys.server_public, srv.keys.server_secret, other.client_public, other.client_secret
    )  # knows the server's public key, not the clients' secret
    for keys in (other, wrong_client):
        c = Client(srv.endpoint, CHANNEL, timeout_s=1, keys=keys)
        with pytest.raises(ChannelError):
            c.request(Echo, text="spoof")
        c.close()
    assert calls == []


def test_many_clients_on_many_threads(secured):
    srv, calls = secured
    errors = []

    def run(i):
        c = Client(srv.endpoint, CHANNEL, timeout_s=10)
        try:
            for j in range(20):
                assert c.request(Echo, text=f"{i}-{j}").text == f"{i}-{j}"
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(calls) == 80


def test_a_context_with_a_zap_handler_can_be_released_and_terminated(secret_file):
    ctx = zmq.Context()
    srv = Server(CHANNEL, {Echo: echo}, "tcp://127.0.0.1:*", ctx=ctx)
    srv.close()
    security.release(ctx)
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(5)
