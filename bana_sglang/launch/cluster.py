"""Running a :class:`~bana_sglang.launch.plan.ClusterPlan`: start its parts in
order, wait until each is healthy (the router's ``/health`` and one greedy
token through the OpenAI endpoint), supervise them, and stop everything.

Every part gets the cluster secret (``BANA_CLUSTER_SECRET_FILE``, see
:mod:`bana_sglang.wire.security`): the plan's, the one given, or a new one in a
private temporary folder that lives as long as the cluster.

The command line around it is :mod:`bana_sglang.launch.cli`.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from bana_sglang import envs
from bana_sglang.launch.parts import Part
from bana_sglang.launch.plan import ClusterPlan
from bana_sglang.launch.procs import (
    ManagedProcess,
    ProcessStartError,
    http_ok,
    stop_all,
    tcp_open,
    wait_until,
)
from bana_sglang.radix_global.client import IndexClient
from bana_sglang.wire import security

logger = logging.getLogger("bana_sglang.launch")

SECRET_VAR = envs.BANA_CLUSTER_SECRET_FILE.name
READY_MARK = "bana_sglang: cluster ready"
NODE_READY_MARK = "bana_sglang: node ready:"


def smoke_request(
    endpoint: str, model: str, timeout: float = 60.0, api_key: str | None = None
) -> bool:
    """One greedy token through ``/v1/completions``: True when it came back."""
    body = json.dumps(
        {"model": model, "prompt": "ready?", "max_tokens": 1, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        endpoint + "/v1/completions",
        data=body,
        headers={"content-type": "application/json", **auth_headers(api_key)},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200 and bool(json.loads(resp.read()).get("choices"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _RouterHealth:
    """Readiness of the router; while it is not ready, says every 15 s which
    parts its ``/health`` reports missing (on a multi-node cluster: what this
    node is waiting for elsewhere)."""

    def __init__(self, url: str, headers: dict[str, str], note_every: float = 15.0):
        self.url, self.headers, self.note_every = url, headers, note_every
        self.next_note = time.monotonic() + note_every

    def __call__(self) -> bool:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.url, headers=self.headers), timeout=2.0
            ) as r:
                return 200 <= r.status < 300
        except urllib.error.HTTPError as e:
            try:
                missing = json.loads(e.read()).get("missing") or []
            except (ValueError, OSError, AttributeError):
                missing = []
            now = time.monotonic()
            if missing and now >= self.next_note:
                logger.info("router waits for: %s", ", ".join(missing))
                self.next_note = now + self.note_every
            return False
        except (urllib.error.URLError, OSError, ValueError):
            return False


#: a part restarted this often within RESTART_WINDOW_S is in a crash loop and given up on
RESTARTS_PER_WINDOW = 5
RESTART_WINDOW_S = 300.0
RESTART_FIRST_BACKOFF_S = 1.0  # doubling per recent restart
RESTART_MAX_BACKOFF_S = 30.0


@dataclass
class _Restarts:
    times: list[float] = field(default_factory=list)  # when it was restarted
    next_at: float = 0.0
    given_up: bool = False


class Cluster:
    """Runs a :class:`ClusterPlan`: start in order, wait for health, stop everything."""

    def __init__(
        self,
        plan: ClusterPlan,
        *,
        log_dir: Path | None = None,
        startup_timeout: float = 600.0,
        secret_file: Path | None = None,
        restart: bool = True,
    ):
        self.plan = plan
        self._own_secret_dir: str | None = None
        given = secret_file or plan.env.get(SECRET_VAR)
        if given:
            self.secret_file = Path(given)
            security.read_secret(self.secret_file)  # a clear error now, not in every part
        else:
            self._own_secret_dir = tempfile.mkdtemp(prefix="bana-cluster-")
            self.secret_file = security.create_secret_file(
                Path(self._own_secret_dir) / "cluster.secret"
            )
        self.env = {**plan.env, SECRET_VAR: str(self.secret_file)}
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.procs: list[ManagedProcess] = []
        self.stop_event = threading.Event()
        self._reported_dead: set[str] = set()
        self.restart = restart
        self._restarts: dict[str, _Restarts] = {}
        self._parts = {part.name: part for part in plan.parts}
        self._deadline = time.monotonic() + startup_timeout

    def _wait_needs(self, part: Part) -> None:
        """Wait for the parts on other nodes that ``part`` needs (TCP), with backoff,
        saying what it waits for."""
        for name, addr in part.needs:
            host, _, port = addr.rpartition(":")
            t0 = next_note = time.monotonic()
            attempt = 0
            while not tcp_open(host, int(port)):
                now = time.monotonic()
                if now >= next_note:
                    logger.info(
                        "%s waits for %s at %s (%.0fs so far)", part.name, name, addr, now - t0
                    )
                    next_note = now + 10.0
                if now > self._deadline:
                    raise ProcessStartError(part.name, f"{name} at {addr} never came up")
                if self.stop_event.wait(min(2.0, 0.1 * 2**attempt)):
                    raise ProcessStartError(part.name, f"interrupted while waiting for {name}")
                attempt += 1

    def _start(self, part: Part) -> ManagedProcess:
        proc = ManagedProcess(
            part.name, part.argv, {**self.env, **dict(part.env)}, log_dir=self.log_dir
        )
        proc.start()
        return proc

    def _spawn(self, part: Part) -> ManagedProcess:
        self._wait_needs(part)
        proc = self._start(part)
        self.procs.append(proc)
        logger.info("started %s (pid %s)", part.name, proc.pid)
        return proc

    def _wait_ready(self, part: Part, proc: ManagedProcess, deadline: float) -> None:
        h = self.plan.endpoint.split("//", 1)[1].rsplit(":", 1)[0]
        if part.ready_line:
            line = part.ready_line
            check = lambda: any(line in x for x in proc.tail())  # noqa: E731
            what = f"the line {line!r}"
        elif part.health_url and part is self.plan.router:
            check = _RouterHealth(part.health_url, auth_headers(self.plan.api_key))
            what = f"healthy answer at {part.health_url}"
        elif part.health_url:
            check = lambda: http_ok(part.health_url)  # noqa: E731
            what = f"healthy answer at {part.health_url}"
        else:
            host = part.tcp_host or h
            check = lambda: tcp_open(host, part.tcp_port)  # noqa: E731
            what = f"listening socket on {host}:{part.tcp_port}"
        wait_until(
            check,
            proc=proc,
            what=what,
            timeout=max(1.0, deadline - time.monotonic()),
            stop=self.stop_event,
        )
        proc.note_shared_files()
        logger.info("%s is ready", part.name)

    def _wait_all_ready(self, started: list[tuple[Part, ManagedProcess]], deadline: float) -> None:
        """Wait for parts started together, each on its own thread: an SGLang worker's
        ``/health`` generates a token and takes a second even when it is up, so waiting
        for N workers one after another would add N - 1 seconds. The first part that
        fails to come up stops the others' waits and is raised."""
        if not started:
            return
        with ThreadPoolExecutor(len(started), thread_name_prefix="bana-ready") as pool:
            futures = [
                pool.submit(self._wait_ready, part, proc, deadline) for part, proc in started
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                self.stop_event.set()  # the other waits end at their next poll
                raise failed.exception()

    def start(self) -> None:
        """Start every part; raises :class:`ProcessStartError` (after stopping all) on failure."""
        deadline = self._deadline = time.monotonic() + self.startup_timeout
        try:
            if self.plan.master:
                self._wait_ready(self.plan.master, self._spawn(self.plan.master), deadline)
            self._wait_all_ready([(part, self._spawn(part)) for part in self.plan.store], deadline)
            # Workers start together: their start-up is mostly imports and overlaps well.
            self._wait_all_ready(
                [(part, self._spawn(part)) for part in self.plan.workers], deadline
            )
            if self.plan.router:
                router = self._spawn(self.plan.router)
                self._wait_ready(self.plan.router, router, deadline)
                # End to end: one greedy token through router, prefill, KV transfer, decode.
                wait_until(
                    lambda: smoke_request(
                        self.plan.endpoint, self.plan.served_model_name, api_key=self.plan.api_key
                    ),
                    proc=router,
                    what="a first request served end to end",
                    timeout=max(1.0, deadline - time.monotonic()),
                    stop=self.stop_event,
                )
                logger.info("first request served end to end")
            if self.plan.balancer:
                self._wait_ready(self.plan.balancer, self._spawn(self.plan.balancer), deadline)
        except BaseException:
            self.stop()
            raise

    def check_parts(self) -> str | None:
        """Report newly exited parts and restart them; a reason to stop the cluster, or None.

        Any part that exits is restarted after a backoff (1 s, doubling, at most
        ``RESTART_MAX_BACKOFF_S``); the router serves on meanwhile (a worker that is
        down is routed around, the store is off while its master, index or storage
        process is). A part that has crashed ``RESTARTS_PER_WINDOW`` times within
        ``RESTART_WINDOW_S`` is in a crash loop: it is reported and given up on. The
        cluster stops when the router is given up on, or no prefill or no decode
        worker is left; a node of a cluster spec stops when every one of its parts is
        given up on (its workers' peers are elsewhere: the router decides what is left).
        """
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                continue
            st = self._restarts.setdefault(p.name, _Restarts())
            if p.name not in self._reported_dead:
                self._reported_dead.add(p.name)
                logger.error(
                    "%s exited unexpectedly (code %s). Last output:\n    %s",
                    p.name,
                    p.poll(),
                    "\n    ".join(p.tail()[-15:]),
                )
                recent = [t for t in st.times if now - t < RESTART_WINDOW_S]
                part = self._parts.get(p.name)
                if part is None or not self.restart or len(recent) >= RESTARTS_PER_WINDOW:
                    st.given_up = True
                    if part is not None and self.restart:
                        logger.error(
                            "%s crashed %d times within %.0f s: a crash loop; not restarting it",
                            p.name,
                            len(recent) + 1,
                            RESTART_WINDOW_S,
                        )
                else:
                    st.next_at = now + min(
                        RESTART_MAX_BACKOFF_S, RESTART_FIRST_BACKOFF_S * 2.0 ** len(recent)
                    )
                    logger.warning("restarting %s in %.0f s", p.name, st.next_at - now)
            if not st.given_up and now >= st.next_at:
                p.kill()  # what is left of its process group (ports, shared memory)
                p.reap()
                proc = self.procs[i] = self._start(self._parts[p.name])
                st.times.append(now)
                self._reported_dead.discard(p.name)
                logger.info("restarted %s (pid %s, restart %d)", p.name, proc.pid, len(st.times))
        gone = {n for n, st in self._restarts.items() if st.given_up}
        if self.plan.router and self.plan.router.name in gone:
            return f"{self.plan.router.name} exited and is not restarted"
        if self.plan.node is not None:
            names = {p.name for p in self.plan.parts}
            return (
                f"every part of node {self.plan.node} exited" if names and names <= gone else None
            )
        for role in ("prefill", "decode"):
            names = {w.name for w in self.plan.workers if w.name.startswith(role + "-")}
            if names and names <= gone:
                return f"no {role} worker is left"
        return None

    def restarts(self) -> dict[str, int]:
        """How often each part was restarted."""
        return {n: len(st.times) for n, st in self._restarts.items()}

    def worker_headers(self) -> dict[str, str]:
        """What a call to one of this cluster's workers must carry (their API key is
        derived from the cluster's secret; /health and /metrics need none)."""
        key = security.worker_api_key(security.read_secret(self.secret_file))
        return {"Authorization": f"Bearer {key}"}

    def clear_store(self, timeout_s: float = 10.0) -> int | None:
        """Empty the global store (its index and its pages), as the cluster's own parts
        would ask: a benchmark starts each arm and each rate from an empty store. The
        number of pages forgotten; None without a store or when the index did not answer."""
        if not self.plan.index_endpoint:
            return None
        client = IndexClient(
            self.plan.index_endpoint,
            timeout_s=timeout_s,
            name="launcher",
            keys=security.curve_keys(security.read_secret(self.secret_file)),
        )
        try:
            return client.clear()
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the balancer first (it recalls the layers it moved, through the router),
        then the router (no new requests), then everything else together. Idempotent."""
        self.stop_event.set()
        router = self.plan.router.name if self.plan.router else None
        balancer = self.plan.balancer.name if self.plan.balancer else None
        first = [p for p in self.procs if p.name == balancer]
        front = [p for p in self.procs if p.name == router]
        rest = [p for p in self.procs if p.name not in (router, balancer)]
        for group in (first, front, rest):
            for name, code in stop_all(group).items():
                logger.info("stopped %s (exit %s)", name, code)
        if self._own_secret_dir is not None:
            shutil.rmtree(self._own_secret_dir, ignore_errors=True)
            self._own_secret_dir = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI
