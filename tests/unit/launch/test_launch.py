"""Launcher planning and process supervision (fast: no SGLang server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from bana_sglang import launch
from bana_sglang.launch.procs import ManagedProcess, ProcessStartError, port_free, wait_until


def test_plan_2p1d_has_distinct_ports_and_pd_wiring(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cpu")
    plan = launch.plan_cluster(launch.LaunchConfig(num_prefill=2, num_decode=1, port=30500))
    names = [p.name for p in plan.parts]
    assert names == [
        "mooncake-master",
        "kv-storage",
        "kv-index",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "router",
    ]
    ports = []
    for part in plan.workers:
        argv = list(part.argv)
        ports.append(int(argv[argv.index("--port") + 1]))
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        role = argv[argv.index("--disaggregation-mode") + 1]
        assert part.name.startswith(role)
        if role == "prefill":
            ports.append(int(argv[argv.index("--disaggregation-bootstrap-port") + 1]))
        ports.append(int(argv[argv.index("--nccl-port") + 1]))  # planned, not SGLang's pick
        assert argv[argv.index("--device") + 1] == "cpu"
    router = list(plan.router.argv)
    assert router.count("--prefill") == 2 and router.count("--decode") == 1
    assert "30500" in router
    index = list(plan.store[1].argv)
    ports.append(int(index[index.index("--port") + 1]))
    # every worker publishes through the storage process, which listens on loopback
    storage = list(plan.store[0].argv)
    puts = storage[storage.index("--put-listen") + 1]
    assert puts.startswith("tcp://127.0.0.1:")
    ports.append(int(puts.rpartition(":")[2]))
    assert all(f'"storage":"{puts}"' in " ".join(p.argv) for p in plan.workers)
    assert len(ports) == len(set(ports)) and 30500 not in ports
    assert plan.env["SGLANG_USE_CPU_ENGINE"] == "1"
    # float32 checkpoints stay float32 (SGLang's "auto" would downcast to float16)
    assert all(p.argv[p.argv.index("--dtype") + 1] == "float32" for p in plan.workers)


def test_the_live_balancer_starts_after_the_router_and_stops_before_it(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cpu")
    assert launch.plan_cluster(launch.LaunchConfig()).balancer is None  # static PD unless asked
    plan = launch.plan_cluster(
        launch.LaunchConfig(balancer="bana", api_key="k", balancer_args=("--interval", "0.5"))
    )
    assert [p.name for p in plan.parts][-2:] == ["router", "balancer"]
    argv = list(plan.balancer.argv)
    assert argv[argv.index("--router") + 1] == plan.endpoint and argv[-2:] == ["--interval", "0.5"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert (
        dict(plan.balancer.env) == {"BANA_API_KEY": "k"} and "k" not in argv
    )  # the key is not on argv


def test_user_dtype_wins(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cpu")
    plan = launch.plan_cluster(launch.LaunchConfig(sglang_args=("--dtype", "bfloat16")))
    for part in plan.workers:
        assert part.argv.count("--dtype") == 1 and "bfloat16" in part.argv


def test_extra_args_reach_the_right_role(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cpu")
    plan = launch.plan_cluster(
        launch.LaunchConfig(
            sglang_args=("--max-total-tokens", "2048"),
            decode_args=("--max-running-requests", "7"),
            router_args=("--policy", "round_robin"),
        )
    )
    prefill, decode = plan.workers
    assert prefill.argv.count("--max-total-tokens") == 1  # the user's value replaced the default
    assert "2048" in prefill.argv and "--max-running-requests" not in prefill.argv
    assert "7" in decode.argv
    assert plan.router.argv[-2:] == ("--policy", "round_robin")


def test_cpu_workers_share_the_machines_cores_unless_told(monkeypatch):
    """torch's default (every core in every worker) oversubscribes a machine running
    several workers; the launcher divides the CPUs among them, and an operator's
    OMP_NUM_THREADS or --cpu-threads wins."""
    import os

    monkeypatch.setenv("BANA_DEVICE", "cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    plan = launch.plan_cluster(launch.LaunchConfig(num_prefill=2, num_decode=1))
    assert plan.env["OMP_NUM_THREADS"] == str(max(1, cpus // 3))
    assert launch.plan_single_server().env["OMP_NUM_THREADS"] == str(cpus)
    assert launch.plan_cluster(launch.LaunchConfig(cpu_threads=3)).env["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert launch.plan_cluster(launch.LaunchConfig(cpu_threads=3)).env["OMP_NUM_THREADS"] == "5"
    monkeypatch.setenv("BANA_DEVICE", "cuda")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert (
        "OMP_NUM_THREADS" not in launch.plan_cluster(launch.LaunchConfig(gpus=1)).env
    )  # GPU: torch's default


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-prefill", "0"], "at least one prefill"),
        (["--port", "70000"], "not a TCP port"),
        (["--model-path", "/nonexistent/model"], "neither an embedded model"),
        (["--balancer", "bana", "--router", "sglang"], "--balancer needs --router bana"),
        (["--cpu-threads", "-1"], "--cpu-threads -1"),
        (["--store-bytes", "8M"], "below the smallest Mooncake segment"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message):
    out = subprocess.run(
        [sys.executable, "-m", "bana_sglang.launch", *argv, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert message in out.stderr


def test_cli_help_and_dry_run():
    out = subprocess.run(
        [sys.executable, "-m", "bana_sglang.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--num-prefill" in out.stdout and "--sglang-args" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "bana_sglang.launch", "--dry-run", "--num-decode", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "decode-1:" in out.stdout and "router:" in out.stdout


_TREE = r"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
import os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a stubborn parent: needs SIGKILL
print("ready", flush=True)
time.sleep(600)
"""


def test_stop_reaps_the_whole_tree_even_when_sigterm_is_ignored():
    proc = ManagedProcess("stubborn", [sys.executable, "-c", _TREE])
    proc.start()
    wait_until(
        lambda: "ready" in proc.tail(), proc=proc, what="ready line", timeout=30, interval=0.1
    )
    wait_until(
        lambda: len(proc.descendants()) == 1, proc=proc, what="grandchild", timeout=30, interval=0.1
    )
    tree = [psutil.Process(proc.pid), *proc.descendants()]
    t0 = time.monotonic()
    proc.stop(timeout=1.0)
    assert time.monotonic() - t0 < 10
    for p in tree:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE


_MAPS_LOAD_FILE = """
import mmap, os, subprocess, sys, time
def make(path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    return fd
mapped = mmap.mmap(make(sys.argv[1]), 4096)  # as SGLang's load snapshot writer does
make(sys.argv[2])  # created, never mapped: not the child's to say
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("ending", ["stop", "crash"])
def test_the_shm_files_sglang_leaves_are_removed_with_their_process(ending):
    """SGLang never removes its load-snapshot file in /dev/shm: the launcher notes the
    ones a part's tree maps once it is ready and removes them when the part is stopped
    or has died; a file the tree does not map is left alone."""
    tag = f"bana-test-{os.getpid()}-{ending}"
    mapped, other = f"/dev/shm/sglang_loads_{tag}.shm", f"/dev/shm/sglang_loads_{tag}-x.shm"
    proc = ManagedProcess("shm", [sys.executable, "-c", _MAPS_LOAD_FILE, mapped, other])
    try:
        proc.start()
        wait_until(
            lambda: "ready" in proc.tail(), proc=proc, what="ready line", timeout=30, interval=0.1
        )
        proc.note_shared_files()
        assert os.path.exists(mapped) and os.path.exists(other)
        if ending == "stop":
            proc.stop(timeout=5.0)
        else:
            os.kill(proc.pid, 9)  # dies on its own; the launcher kills its group and reaps
            proc.kill()
            proc.reap()
        assert not os.path.exists(mapped)
        assert os.path.exists(other)
    finally:
        proc.stop(timeout=1.0)
        for path in (mapped, other):
            if os.path.exists(path):
                os.unlink(path)


def test_start_failure_names_the_part_and_shows_its_output():
    proc = ManagedProcess(
        "broken", [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    )
    proc.start()
    with pytest.raises(ProcessStartError) as err:
        wait_until(lambda: False, proc=proc, what="health", timeout=30, interval=0.1)
    assert "broken" in str(err.value) and "code 3" in str(err.value)
    assert "no such model" in str(err.value)


def test_port_allocator_skips_busy_ports():
    import socket

    from bana_sglang.launch.procs import PortAllocator

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        alloc = PortAllocator("127.0.0.1", busy)
        got = alloc.take()
        assert got != busy and port_free("127.0.0.1", got)


def test_a_cluster_without_a_secret_makes_a_private_one_and_removes_it(tmp_path):
    import stat

    from bana_sglang.launch import Cluster, ClusterPlan
    from bana_sglang.wire import security

    plan = ClusterPlan("http://127.0.0.1:1", "m", "m", None, (), None, env={})
    with Cluster(plan) as c:
        secret = c.secret_file
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
        assert c.env["BANA_CLUSTER_SECRET_FILE"] == str(secret)
        assert len(security.read_secret(secret)) == 64
    assert not secret.exists() and not secret.parent.exists()
    # a secret the plan names is used as it is, and left in place
    given = security.create_secret_file(tmp_path / "given.secret")
    named = ClusterPlan(
        "http://127.0.0.1:1", "m", "m", None, (), None, env={"BANA_CLUSTER_SECRET_FILE": str(given)}
    )
    with Cluster(named) as c:
        assert c.secret_file == given
    assert given.exists()


def test_a_part_that_exits_is_restarted_and_a_crash_loop_is_given_up_on(tmp_path, monkeypatch):
    from bana_sglang.launch import Cluster, ClusterPlan, Part
    from bana_sglang.launch import cluster as runner

    monkeypatch.setattr(runner, "RESTART_FIRST_BACKOFF_S", 0.05)
    monkeypatch.setattr(runner, "RESTART_MAX_BACKOFF_S", 0.2)
    runs = tmp_path / "runs"
    # exits on its first run, stays up on the second
    once = (
        "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) "
        "if p.exists() else 0; p.write_text(str(n + 1)); print('up', flush=True); "
        "time.sleep(1.5 if n == 0 else 60); sys.exit(3)"
    )
    always = "import sys, time; print('up', flush=True); time.sleep(1.0); sys.exit(4)"
    parts = (
        Part("prefill-0", (sys.executable, "-c", once, str(runs)), ready_line="up"),
        Part("decode-0", (sys.executable, "-c", always), ready_line="up"),
    )
    plan = ClusterPlan("http://127.0.0.1:1", "m", "m", None, parts, None, env=dict(os.environ))
    with Cluster(plan, log_dir=tmp_path / "logs") as c:
        why = None
        deadline = time.monotonic() + 30
        while why is None and time.monotonic() < deadline:
            why = c.check_parts()
            time.sleep(0.05)
        assert why == "no decode worker is left"  # given up on after its crash loop
        assert c.restarts() == {"prefill-0": 1, "decode-0": runner.RESTARTS_PER_WINDOW}
        assert runs.read_text() == "2"
        assert next(p for p in c.procs if p.name == "prefill-0").poll() is None  # up again
    # the log of every run is kept, one after the other
    assert (tmp_path / "logs" / "decode-0.log").read_text().count("up") == 6


# A worker whose /health, like SGLang's, answers only after generating a token: here
# after ``argv[2]`` seconds, on port ``argv[1]``; it notes when its first check came
# (wall clock) in the file ``argv[3]``.
SLOW_HEALTH = (
    "import http.server, pathlib, sys, time\n"
    "seen = pathlib.Path(sys.argv[3])\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        if not seen.exists(): seen.write_text(repr(time.time()))\n"
    "        time.sleep(float(sys.argv[2])); self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def test_workers_are_waited_for_together(tmp_path):
    from bana_sglang.launch import Cluster, ClusterPlan, Part
    from bana_sglang.launch.procs import PortAllocator

    # four workers whose health check takes 1.5 s: waited for one after another, the
    # last would be asked at least 4.5 s after the first; together, all are asked
    # before the first answers
    delay, alloc, parts = 1.5, PortAllocator("127.0.0.1", 42000), []
    for k in range(4):
        port = alloc.take()
        argv = (sys.executable, "-c", SLOW_HEALTH, str(port), str(delay), str(tmp_path / str(k)))
        parts.append(Part(f"prefill-{k}", argv, health_url=f"http://127.0.0.1:{port}/health"))
    plan = ClusterPlan(
        "http://127.0.0.1:1", "m", "m", None, tuple(parts), None, env=dict(os.environ)
    )
    with Cluster(plan, restart=False) as c:
        assert all(p.poll() is None for p in c.procs)
    asked = [float((tmp_path / str(k)).read_text()) for k in range(4)]
    assert max(asked) - min(asked) < 2 * delay, asked


def test_a_worker_that_dies_while_others_start_stops_the_start_at_once():
    from bana_sglang.launch import Cluster, ClusterPlan, Part

    never = "import time; time.sleep(60)"  # never healthy: its wait would last the timeout
    dies = "import time; print('no such model', flush=True); time.sleep(0.5); raise SystemExit(3)"
    parts = (
        Part("prefill-0", (sys.executable, "-c", never), health_url="http://127.0.0.1:1/health"),
        Part("decode-0", (sys.executable, "-c", dies), health_url="http://127.0.0.1:1/health"),
    )
    plan = ClusterPlan("http://127.0.0.1:1", "m", "m", None, parts, None, env=dict(os.environ))
    c = Cluster(plan, startup_timeout=60, restart=False)
    t0 = time.monotonic()
    with pytest.raises(ProcessStartError) as err:
        c.start()
    assert time.monotonic() - t0 < 10
    assert err.value.name == "decode-0" and "no such model" in str(err.value)
    assert all(p.poll() is not None for p in c.procs)  # everything it started is stopped


UP = "import time; print('up', flush=True); "


def test_without_restart_a_dead_part_stays_dead(tmp_path):
    from bana_sglang.launch import Cluster, ClusterPlan, Part

    parts = (
        Part("prefill-0", (sys.executable, "-c", f"{UP}time.sleep(1.5)"), ready_line="up"),
        Part("decode-0", (sys.executable, "-c", f"{UP}time.sleep(60)"), ready_line="up"),
    )
    plan = ClusterPlan("http://127.0.0.1:1", "m", "m", None, parts, None, env=dict(os.environ))
    with Cluster(plan, restart=False) as c:
        deadline = time.monotonic() + 10
        why = None
        while why is None and time.monotonic() < deadline:
            why = c.check_parts()
            time.sleep(0.05)
        assert why == "no prefill worker is left" and c.restarts() == {"prefill-0": 0}


def test_a_users_nccl_port_wins_over_the_planned_one(monkeypatch):
    monkeypatch.setenv("BANA_DEVICE", "cpu")
    plan = launch.plan_cluster(
        launch.LaunchConfig(num_prefill=1, num_decode=1, sglang_args=("--nccl-port", "29001"))
    )
    for part in plan.workers:
        argv = list(part.argv)
        assert argv.count("--nccl-port") == 1 and argv[argv.index("--nccl-port") + 1] == "29001"
