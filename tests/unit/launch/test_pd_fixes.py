"""SGLang 0.5.23's KV sender thread outlives a room that finishes while one of its
chunks is being handled (compat.pd_fixes); any other failure still ends it."""

from __future__ import annotations

import inspect
import queue
import threading

import pytest

from bana_sglang.compat import pd_fixes


class Manager:
    """The shape of SGLang's ``transfer_worker``: take a chunk, read its room's status
    twice, tear down; any exception ends the thread as a RuntimeError."""

    def __init__(self):
        self.request_status: dict[int, str] = {}
        self.transfer_infos: dict[int, dict] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self._staging_outstanding: dict[int, int] = {}
        self.done: list[int] = []

    def check_status(self, room):
        return self.request_status[room]

    def transfer_worker(self, q, executor=None, staging_buffer=None, worker_index=0):
        while True:
            room, cleared_between = q.get()
            if room is None:
                return "stopped"
            try:
                if room in self.request_status:
                    if cleared_between:  # the scheduler thread removes the room here
                        del self.request_status[room]
                    if self.check_status(room) == "boom":
                        raise ValueError("a real bug")
                self.done.append(room)
            except Exception as e:
                raise RuntimeError(f"Transfer thread failed because of {e}.") from e


def run(manager, chunks):
    q: queue.Queue = queue.Queue()
    for c in chunks:
        q.put(c)
    q.put((None, False))
    out = {}
    worker = pd_fixes.resilient_transfer_worker(Manager.transfer_worker)

    def target():
        try:
            out["result"] = worker(manager, q)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out


def test_a_room_cleared_between_the_two_reads_no_longer_ends_the_thread():
    m = Manager()
    m.request_status.update({1: "ok", 2: "ok", 3: "ok"})
    m.transfer_infos[2] = {"s": 1}
    m._staging_outstanding[2] = 0
    out = run(m, [(1, False), (2, True), (3, False)])
    assert out == {"result": "stopped"}
    assert m.done == [1, 3]  # the chunk after the race is still sent
    assert 2 not in m.transfer_infos and 2 not in m._staging_outstanding
    # unpatched, the same sequence ends the thread
    m2 = Manager()
    m2.request_status.update({1: "ok", 2: "ok", 3: "ok"})
    q: queue.Queue = queue.Queue()
    for c in [(1, False), (2, True), (3, False)]:
        q.put(c)
    with pytest.raises(RuntimeError):
        Manager.transfer_worker(m2, q)
    assert m2.done == [1]


def test_any_other_failure_still_ends_the_thread():
    m = Manager()
    m.request_status.update({1: "boom", 2: "ok"})
    out = run(m, [(1, False), (2, False)])
    assert isinstance(out["error"], RuntimeError) and "a real bug" in str(out["error"])
    assert m.done == []


def test_applied_to_sglangs_own_manager_once_with_its_signature():
    conn = pytest.importorskip("sglang.srt.disaggregation.mooncake.conn")
    before = inspect.signature(conn.MooncakeKVManager.transfer_worker)
    assert pd_fixes.apply() == ["MooncakeKVManager.transfer_worker survives a finished room"]
    patched = conn.MooncakeKVManager.transfer_worker
    assert patched.__bana_resilient__ and inspect.signature(patched) == before
    pd_fixes.apply()  # idempotent: not wrapped twice
    assert conn.MooncakeKVManager.transfer_worker is patched
