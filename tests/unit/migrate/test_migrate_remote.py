"""The execution switch's parts, fast: packed step buffers read through real
Mooncake transfer engines (TCP on 127.0.0.1), the KV slot mirror against an
allocator's page releases, the guest attention plan, the step channel's
envelope, and the agent's refusals. The switch itself, on real SGLang workers,
is in ``test_migrate_live.py``."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import torch
from support.agents import wait_state

from bana_sglang.migrate.agent import TransferEngine
from bana_sglang.migrate.layers.guest import _GuestPlan
from bana_sglang.migrate.layers.owner import SlotMirror, StepBuffer, unpack
from bana_sglang.wire import agent as m
from bana_sglang.wire import layer_steps as s


@pytest.fixture(scope="module")
def engines():
    return TransferEngine("127.0.0.1"), TransferEngine("127.0.0.1")


def test_a_packed_step_crosses_the_transfer_engine_intact(engines):
    a, b = engines
    out, into = StepBuffer(a, capacity=64), StepBuffer(b, capacity=64)  # both must grow
    torch.manual_seed(0)
    tensors = {
        "hidden_states": torch.randn(7, 33),
        "positions": torch.arange(7),
        "empty": torch.zeros(0, 4),
        "miss_k": torch.randn(2, 5, 2, 16).to(torch.bfloat16),
        "flags": torch.tensor([True, False]),
    }
    layout, nbytes = out.pack(tensors)
    assert all(slot.offset % 64 == 0 for slot in layout) and nbytes >= sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    into.ensure(nbytes)
    b.read(a.session, [into.buf[:nbytes]], [out.addr])
    got = into.views(layout, nbytes)
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    out.close()
    into.close()


def test_a_layout_outside_its_buffer_or_of_an_unknown_dtype_is_refused():
    buf = torch.zeros(256, dtype=torch.uint8)
    ok = [s.TensorSlot(name="h", dtype="float32", shape=[4, 4], offset=64)]
    assert unpack(buf, ok, 256)["h"].shape == (4, 4)
    with pytest.raises(ValueError, match="outside"):
        unpack(buf, [s.TensorSlot(name="h", dtype="float32", shape=[64, 4], offset=0)], 256)
    with pytest.raises(
        ValueError, match="outside"
    ):  # nbytes is the sender's claim: smaller than the buffer
        unpack(buf, ok, 100)
    with pytest.raises(ValueError, match="unknown dtype"):
        unpack(buf, [s.TensorSlot(name="h", dtype="Tensor", shape=[1], offset=0)], 256)


class PagedAllocator:
    """The two methods of SGLang's paged allocator the mirror hooks."""

    page_size = 4

    def __init__(self):
        self.released: list[torch.Tensor] = []
        self.cleared = 0

    def _release_page_ids(self, *page_ids):
        self.released.extend(page_ids)

    def clear(self):
        self.cleared += 1


def test_the_slot_mirror_forgets_released_pages_and_unhooks():
    alloc = PagedAllocator()
    mirror = SlotMirror(40, alloc)
    assert mirror.hooked
    mirror.valid[:] = True
    alloc._release_page_ids(torch.tensor([1, 3]))  # slots 4..7 and 12..15
    assert alloc.released and torch.equal(
        alloc.released[0], torch.tensor([1, 3])
    )  # the original still ran
    want = torch.ones(40, dtype=torch.bool)
    want[4:8] = want[12:16] = False
    assert torch.equal(mirror.valid, want)
    assert mirror.missing(torch.tensor([0, 5, 13, 20])).tolist() == [5, 13]
    alloc.clear()
    assert alloc.cleared == 1 and not mirror.valid.any()
    mirror.close()
    assert "_release_page_ids" not in vars(alloc) and "clear" not in vars(alloc)
    mirror.valid[:] = True
    alloc._release_page_ids(torch.tensor([0]))
    assert mirror.valid.all()  # unhooked


def test_without_a_known_allocator_every_step_ships_its_whole_kv():
    mirror = SlotMirror(16, object())
    assert not mirror.hooked
    mirror.valid[:] = True
    assert mirror.missing(torch.tensor([1, 2, 3])).tolist() == [1, 2, 3]


def test_the_guest_plan_rebuilds_the_batch_attention_layout():
    slots = torch.tensor([10, 11, 12, 20, 21, 30])
    dec = _GuestPlan("decode", [3, 2, 1], [1, 1, 1], slots)
    assert dec.is_decode and dec.kv_table.tolist() == [[10, 11, 12], [20, 21, 0], [30, 0, 0]]
    ext = _GuestPlan("extend", [3, 2, 1], [2, 2, 1], slots)
    assert not ext.is_decode and [t.tolist() for t in ext.kv_indices] == [
        [10, 11, 12],
        [20, 21],
        [30],
    ]
    assert ext.extend_lens == (2, 2, 1)


def test_the_step_channel_rejects_bad_frames_with_a_reason():
    assert s.decode_request(b"\x81garbage").reason == "malformed"
    frame = msgspec.msgpack.encode(
        {"type": "run_layers", "id": 3, "v": 9, "deadline": time.time() + 5}
    )
    assert s.decode_request(frame).reason == "unsupported_version"
    frame = msgspec.msgpack.encode(
        {"type": "ping", "id": 4, "v": 1, "deadline": time.time() - 1, "migration": "x"}
    )
    assert s.decode_request(frame).reason == "stale_deadline"
    frame = msgspec.msgpack.encode(
        {
            "type": "run_layers",
            "id": 5,
            "v": 1,
            "deadline": time.time() + 5,
            "migration": "x",
            "step": 0,
            "mode": "sideways",
            "session": "h:1",
            "addr": 1,
            "nbytes": 0,
            "layout": [],
            "seq_lens": [],
            "extend_lens": [],
        }
    )
    assert s.decode_request(frame).reason == "malformed"  # mode is extend or decode


def test_the_agent_refuses_what_it_cannot_switch_or_recall(pair):
    x, y = pair
    r = x.client.call(
        m.MigrateLayers, migration="sw", start=0, stop=2, peer=y.agent.endpoint, switch=True
    )
    assert isinstance(r, m.Error) and r.reason == "invalid" and "no model runner" in r.detail
    r = x.client.call(m.Recall, migration="nope")
    assert isinstance(r, m.Error) and r.reason == "invalid" and "no migration" in r.detail
    # staged only: nothing runs remotely, so there is nothing to recall
    assert isinstance(
        x.client.call(m.MigrateLayers, migration="st", start=0, stop=2, peer=y.agent.endpoint),
        m.Accepted,
    )
    assert isinstance(wait_state(x.client, "st"), m.Done)
    r = x.client.call(m.Recall, migration="st")
    assert isinstance(r, m.Error) and "staged, not remote" in r.detail
    # a guest executor opens only for a verified guest copy, on the agent that holds it
    r = x.client.call(m.OpenGuest, migration="st", kv_rows=16)
    assert isinstance(r, m.Error) and r.reason == "invalid"
    r = y.client.call(m.OpenGuest, migration="nope", kv_rows=16)
    assert isinstance(r, m.Error) and r.reason == "invalid"
    assert [(p.start, p.stop, p.executor) for p in x.client.call(m.Status).placement] == [
        (0, 4, "prefill-0")
    ]


def test_two_mirrors_on_one_allocator_each_see_every_release_until_closed():
    """Two migrations of one worker (different layer ranges) may be remote at
    once: closing either mirror must not unhook the other."""
    alloc = PagedAllocator()
    first, second = SlotMirror(16, alloc), SlotMirror(16, alloc)
    for order in ((first, second), (second, first)):
        alloc2 = PagedAllocator()
        a, b = SlotMirror(16, alloc2), SlotMirror(16, alloc2)
        a.valid[:] = b.valid[:] = True
        (a if order[0] is first else b).close()
        alive = b if order[0] is first else a
        alloc2._release_page_ids(torch.tensor([2]))
        assert not alive.valid[8:12].any() and alive.valid[:8].all()
        assert alloc2.released  # the allocator's own method still ran once
        assert len(alloc2.released) == 1
        alive.close()
        assert "_release_page_ids" not in vars(alloc2) and "clear" not in vars(alloc2)
    first.close()
    second.close()
    assert "_release_page_ids" not in vars(alloc)


_FROZEN_PEER = """
import sys, time, torch
from bana_sglang.migrate.transfer import TransferEngine
te = TransferEngine("127.0.0.1")
buf = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
te.register(buf)
print(te.session, buf.data_ptr(), flush=True)
time.sleep(120)
"""


def _wait_all_threads_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is in the stopped state (``T``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"peer {pid} did not stop: thread states {states}"
        time.sleep(0.01)


def test_a_read_from_a_frozen_peer_times_out_and_the_late_bytes_land_in_a_buffer_kept_for_them(
    engines,
):
    """A remote step's read runs on the scheduler thread: from a peer that stops
    (SIGSTOP) it must give up at its timeout, not block until Mooncake drops the
    connection; the destination stays registered until the late read ends."""
    import os
    import signal
    import subprocess
    import sys

    _, te = engines
    peer = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_PEER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    try:
        session, addr = peer.stdout.readline().split()
        want = torch.arange(1 << 16, dtype=torch.int32)
        dst = torch.zeros(1 << 16, dtype=torch.int32)
        te.register(dst)
        te.read(session, [dst], [int(addr)], timeout_s=10)  # alive: an ordinary read
        assert torch.equal(dst, want)
        dst.zero_()
        os.kill(peer.pid, signal.SIGSTOP)
        _wait_all_threads_stopped(
            peer.pid
        )  # kill() only queues the stop; a busy machine may run the peer on
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="within 0.5s"):
            te.read(session, [dst], [int(addr)], timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        te.unregister(dst)  # deferred: the late read may still write here
        assert dst.data_ptr() in te._registered and dst.data_ptr() in te._deferred
        os.kill(peer.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while dst.data_ptr() in te._registered:
            assert time.monotonic() < deadline, "the late read never ended"
            time.sleep(0.05)
        assert (
            torch.equal(dst, want) and not te._inflight
        )  # it landed, then the buffer was released
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait()
