"""The CPU compatibility layer: active without CUDA, inert with it, and each
fix reaches the processes that need it (SGLang's ``spawn``-ed children too)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from bana_sglang import compat


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cpu")


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cuda")


def test_child_env_on_cpu_adds_every_process_level_fix(on_cpu):
    env = compat.child_env({"PYTHONPATH": "/a:/b", "PATH": "/bin"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(compat.PYPATH_DIR), "/a", "/b"]
    assert env["MOONCAKE_PROTOCOL"] == "tcp"
    assert env["SGLANG_HOST_IP"] == "127.0.0.1"
    assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] == "0"
    assert env["PATH"] == "/bin"
    # idempotent: applying it twice does not stack PYTHONPATH entries
    assert compat.child_env(env)["PYTHONPATH"] == env["PYTHONPATH"]


def test_child_env_keeps_operator_overrides(on_cpu):
    env = compat.child_env({"SGLANG_HOST_IP": "10.1.2.3", "MC_LOG_LEVEL": "INFO"})
    assert env["SGLANG_HOST_IP"] == "10.1.2.3"
    assert env["MC_LOG_LEVEL"] == "INFO"


def test_inert_on_cuda(on_cuda):
    env = compat.child_env({"PATH": "/bin"})
    assert "SGLANG_USE_CPU_ENGINE" not in env
    assert "PYTHONPATH" not in env
    assert compat.server_args("prefill") == []
    assert compat.server_args("decode") == []


def test_bad_device_override_is_named(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "tpu")
    with pytest.raises(ValueError, match="BANA_DEVICE"):
        compat.cpu_mode()


def test_idle_schedulers_sleep_on_cpu_and_the_knob_is_checked(on_cpu, monkeypatch):
    monkeypatch.delenv("BANA_IDLE_POLL_MS", raising=False)
    assert "--sleep-on-idle" in compat.server_args("decode")
    assert compat.idle_poll_ms() == compat.DEFAULT_IDLE_POLL_MS
    monkeypatch.setenv("BANA_IDLE_POLL_MS", "0")  # the stock busy loop
    assert "--sleep-on-idle" not in compat.server_args("decode")
    for bad in ("-1", "soon"):
        monkeypatch.setenv("BANA_IDLE_POLL_MS", bad)
        with pytest.raises(ValueError, match="BANA_IDLE_POLL_MS"):
            compat.idle_poll_ms()


def test_server_args_per_role(on_cpu):
    prefill = compat.server_args("prefill")
    decode = compat.server_args("decode")
    for args in (prefill, decode):
        assert args[args.index("--device") + 1] == "cpu"
        assert args[args.index("--sampling-backend") + 1] == "pytorch"
        assert "--max-total-tokens" in args
    assert "--disaggregation-decode-retraction-backup" not in prefill
    assert decode[decode.index("--disaggregation-decode-retraction-backup") + 1] == "cpu_tensor"
    with pytest.raises(ValueError, match="role"):
        compat.server_args("encoder")


def test_server_args_do_not_override_user_flags(on_cpu):
    args = compat.server_args("decode", user_args=["--max-total-tokens", "1024", "--device=cpu"])
    assert "--max-total-tokens" not in args
    assert "--device" not in args


def test_sgl_kernel_standin_assign_matches_reference():
    sys.path.insert(0, str(compat.PYPATH_DIR))
    try:
        import sgl_kernel
    finally:
        sys.path.remove(str(compat.PYPATH_DIR))
    assert sgl_kernel.BANA_STANDIN
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros((6, 32), dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    start = torch.tensor([3, 0, 10])
    end = torch.tensor([7, 5, 10])  # the third request adds nothing
    out = torch.randint(0, 1000, (9,), generator=g, dtype=torch.int64)
    expected = req_to_token.clone()
    expected[4, 3:7] = out[0:4].int()
    expected[0, 0:5] = out[4:9].int()
    sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out, 32)
    assert torch.equal(req_to_token, expected)
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(None)


_SPAWN_PROBE = r"""
import json, multiprocessing as mp

def probe(q):
    import sgl_kernel, torchvision
    from bana_sglang import compat
    q.put({"standin": sgl_kernel.BANA_STANDIN, "torchvision": torchvision.__version__,
           "fixes": compat.apply_in_process_fixes()})

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=probe, args=(q,))
    p.start()
    print(json.dumps(q.get(timeout=120)))
    p.join()
"""


def test_fixes_reach_spawned_children(on_cpu, tmp_path):
    """What SGLang's scheduler sees: a ``spawn`` child of a process started with
    the CPU env imports sgl_kernel and torchvision and gets the PD fix."""
    script = tmp_path / "probe.py"
    script.write_text(_SPAWN_PROBE)
    out = subprocess.run(
        [sys.executable, str(script)],
        env=compat.child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["standin"] is True
    assert result["torchvision"]
    assert result["fixes"] == [
        "MooncakeKVSender.supports_host_tensor_indices=False",
        "allocation.get_last_loc uses torch",
        f"IdleSleeper.maybe_sleep polls {compat.DEFAULT_IDLE_POLL_MS} ms",
    ]


def test_plugin_is_registered_with_sglang():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("bana_sglang") == "bana_sglang.plugin:register"


class _Sleeper:
    def __init__(self):
        import zmq

        self.poller = zmq.Poller()


class _Scheduler:
    def __init__(self, fully_idle: bool, busy: bool = False):
        self.idle_sleeper = _Sleeper()
        self._fully_idle = fully_idle
        self._bana_keep_awake = (lambda: busy,)

    def is_fully_idle(self):
        return self._fully_idle


def _slept(scheduler, **kw) -> float:
    import time

    t0 = time.monotonic()
    out = compat.sleep_on_idle_hook(lambda s: "stock", scheduler, **kw)
    assert out is None  # the stock wait (1000 ms) is not taken
    return time.monotonic() - t0


def test_an_idle_scheduler_sleeps_long_only_with_nothing_under_way():
    import threading

    import zmq

    kw = {"short_ms": 20, "long_ms": 3000}
    assert _slept(_Scheduler(fully_idle=False), **kw) < 1  # PD work in flight: short
    assert _slept(_Scheduler(fully_idle=True, busy=True), **kw) < 1  # a migration: short
    # fully idle: long, but a message on a registered socket (the agent's) wakes it
    ctx = zmq.Context.instance()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = rx.bind_to_random_port("tcp://127.0.0.1")
    tx.connect(f"tcp://127.0.0.1:{port}")
    s = _Scheduler(fully_idle=True)
    s.idle_sleeper.poller.register(rx, zmq.POLLIN)
    threading.Timer(0.2, lambda: tx.send(b"command")).start()
    took = _slept(s, **kw)
    assert 0.15 < took < 2, took
    assert rx.recv(zmq.NOBLOCK) == b"command"  # left for its owner to receive
    rx.close(0)
    tx.close(0)
    # a sleeper without a poller (SGLang's Rust-server one) keeps SGLang's own wait
    s = _Scheduler(fully_idle=True)
    s.idle_sleeper = object()
    assert compat.sleep_on_idle_hook(lambda sch: "stock", s, **kw) == "stock"


def test_a_scheduler_waiting_for_pd_events_polls_instead_of_spinning():
    import time

    calls: list[str] = []

    def on_idle(s):
        calls.append("stock")  # SGLang's: a time.sleep(0) when not fully idle
        return "stock"

    def waited(s) -> float:
        t0 = time.monotonic()
        assert compat.wait_while_waiting_hook(on_idle, s, short_ms=150) == "stock"
        return time.monotonic() - t0

    import zmq

    rx = zmq.Context.instance().socket(zmq.PULL)  # SGLang's request socket, silent
    rx.bind_to_random_port("tcp://127.0.0.1")

    def sched(fully_idle: bool) -> _Scheduler:
        s = _Scheduler(fully_idle=fully_idle)
        s.idle_sleeper.poller.register(rx, zmq.POLLIN)
        return s

    assert waited(sched(False)) > 0.1  # PD requests waiting: a short wait
    assert waited(sched(True)) < 0.1  # fully idle: SGLang's own sleep decides
    rx.close(0)
    s = _Scheduler(fully_idle=False)
    s.idle_sleeper = object()  # no poller to wait on: stock behaviour
    assert waited(s) < 0.1
    assert calls == ["stock"] * 3  # SGLang's idle housekeeping always runs
