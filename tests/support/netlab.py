"""Hosts on one machine: Linux network namespaces joined by a bridge.

``Netlab(n)`` creates ``n`` namespaces, each with one veth interface on a
common bridge in the root namespace (which also gets an address, so the test
process itself reaches every "host"). ``cut(i)``/``restore(i)`` take host
``i``'s link down and up. ``close()`` kills every process left in the
namespaces and deletes namespaces, veths and the bridge; it runs even when a
test fails (context manager) and at interpreter exit.

Needs root and iproute2 (``ip``); :func:`unavailable` says why not.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    probe = f"bnprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class Netlab:
    def __init__(self, n: int, tag: str | None = None):
        tag = tag or str(os.getpid() % 10000)
        self.tag = tag
        subnet = 200 + os.getpid() % 50
        self.ns = [f"bana{tag}h{i}" for i in range(n)]
        self.veth = [f"bnv{tag}h{i}" for i in range(n)]  # root side (<= 15 chars)
        self.bridge = f"bnb{tag}"
        self.addrs = [f"10.{subnet}.77.{i + 1}" for i in range(n)]
        self.gateway = f"10.{subnet}.77.254"
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, veth, addr in zip(self.ns, self.veth, self.addrs):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def check_reachable(self, timeout: float = 10.0) -> str | None:
        """None when a listener in host 0 is reachable from host 1 and from here."""
        port = 47999
        server = self.popen(
            0,
            [
                "python3",
                "-c",
                "import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,"
                f"socket.SO_REUSEADDR,1);s.bind(('{self.addrs[0]}',{port}));s.listen();"
                "time.sleep(30)",
            ],
        )
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection((self.addrs[0], port), timeout=1).close()
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        return f"root namespace cannot reach {self.addrs[0]}:{port}: {e}"
                    time.sleep(0.2)
            if len(self.ns) > 1:
                r = subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.ns[1],
                        "python3",
                        "-c",
                        f"import socket;socket.create_connection(('{self.addrs[0]}',{port}),"
                        "timeout=3).close()",
                    ],
                    capture_output=True,
                    text=True,
                )
                if r.returncode != 0:
                    return f"namespace {self.ns[1]} cannot reach {self.addrs[0]}: {r.stderr.strip()[-200:]}"
            return None
        finally:
            server.kill()
            server.wait()

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Run ``argv`` inside host ``i`` (``ip netns exec`` execs it: the pid is the program's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[i], *argv], **kw)

    def listeners(self, i: int) -> list[tuple[str, int]]:
        """(address, port) of every TCP listening socket in host ``i``."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns[i], "ss", "-Hltn"],
            capture_output=True,
            text=True,
            check=True,
        )
        out = []
        for line in r.stdout.splitlines():
            cols = line.split()
            if len(cols) >= 4:
                addr, _, port = cols[3].rpartition(":")
                out.append((addr.strip("[]").split("%")[0], int(port)))
        return out

    def cut(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.veth[i], "up")

    def pids(self, i: int) -> list[int]:
        r = _ip("netns", "pids", self.ns[i], check=False)
        return [int(p) for p in r.stdout.split()]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i in range(len(self.ns)):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = self.pids(i)
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + (10 if sig == signal.SIGTERM else 5)
                while self.pids(i) and time.monotonic() < deadline:
                    time.sleep(0.2)
        for ns, veth in zip(self.ns, self.veth):
            _ip("link", "del", veth, check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Netlab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
