"""Child-process supervision for the launcher: start, watch, log, stop, reap.

Invariants:
- every child runs in its own session (process group), so one ``killpg``
  reaches the processes SGLang spawns under it;
- :meth:`ManagedProcess.stop` snapshots the whole descendant tree *before*
  signalling (a parent that exits first would orphan its children), sends
  SIGTERM, waits, then SIGKILLs whatever is left: nothing outlives ``stop``;
- a child whose launcher dies gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``);
- the ``/dev/shm`` files SGLang leaves behind (:data:`LEFT_SHM_PREFIXES`) that a
  child's tree maps are noted while it runs (:meth:`ManagedProcess.note_shared_files`,
  and at :meth:`~ManagedProcess.terminate`) and removed once it is reaped;
- a child's output is never lost: it is streamed line by line with a name
  prefix (or to a file per process) and the last lines are kept for error
  messages.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import psutil

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

#: ``/dev/shm`` files an SGLang server creates and never removes (its load snapshot
#: slots, ``sglang.srt.managers.load_snapshot``; SGLang's own CI sweeps them): each
#: start of a worker left one of 16 KiB for good.
LEFT_SHM_PREFIXES = ("/dev/shm/sglang_loads_",)


def shared_files(pids: Sequence[int]) -> set[str]:
    """The :data:`LEFT_SHM_PREFIXES` files that processes ``pids`` map now."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    at = line.find("/dev/shm/")
                    if at < 0:
                        continue
                    path = line[at:].rstrip("\n")
                    if path.startswith(LEFT_SHM_PREFIXES) and not path.endswith("(deleted)"):
                        found.add(path)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


class ProcessStartError(RuntimeError):
    """A child failed to become ready; the message says which, why, and its last log lines."""

    def __init__(self, name: str, reason: str, tail: Sequence[str] = ()):
        self.name = name
        self.reason = reason
        self.tail = list(tail)
        text = f"{name}: {reason}"
        if self.tail:
            lines = [t if len(t) <= 300 else t[:300] + " ..." for t in self.tail]
            text += "\n  last output of " + name + ":\n    " + "\n    ".join(lines)
        super().__init__(text)


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class ManagedProcess:
    """One named child process with prefixed log streaming and a reliable stop."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        log_dir: Path | None = None,
        echo: IO[str] | None = None,
        tail_lines: int = 40,
    ):
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log_path = (log_dir / f"{name}.log") if log_dir else None
        self._echo = echo if echo is not None else sys.stdout
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._echo_lock = threading.Lock()
        self._tree: list[psutil.Process] = []
        self._shared_files: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        logger.debug("starting %s: %s", self.name, " ".join(self.argv))
        self._proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,
        )
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return self._proc.poll() if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def tail(self) -> list[str]:
        return list(self._tail)

    def descendants(self) -> list[psutil.Process]:
        if not self._proc:
            return []
        try:
            return psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def note_shared_files(self) -> None:
        """Remember the files of :data:`LEFT_SHM_PREFIXES` the child's tree maps now,
        to remove them once it is reaped (call it when the child is ready: a child
        that dies later can no longer say which were its own)."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._shared_files |= shared_files([self._proc.pid, *(p.pid for p in self.descendants())])

    def terminate(self) -> None:
        """Ask the child to exit (SIGTERM to the leader only, so that it can shut
        its own children down cleanly); remembers its tree for :meth:`kill`."""
        if self._proc is None:
            return
        self.note_shared_files()
        self._tree = self.descendants()
        if self._proc.poll() is None:
            try:
                self._proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def exited(self) -> bool:
        """Leader and every descendant seen at :meth:`terminate` are gone."""
        if self._proc is None:
            return True
        return self._proc.poll() is not None and not any(_is_running(p) for p in self._tree)

    def kill(self) -> None:
        """SIGKILL the group and every remembered or current descendant."""
        if self._proc is None:
            return
        tree = self._tree + self.descendants()
        if self._proc.poll() is None:
            _killpg(self._proc.pid, signal.SIGKILL)
        else:  # leader gone: its group may still hold children
            _killpg(self._proc.pid, signal.SIGKILL)
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass

    def reap(self) -> int | None:
        if self._proc is None:
            return None
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %s) survived SIGKILL", self.name, self._proc.pid)
        if self._reader:
            self._reader.join(timeout=2)
        self.remove_shared_files()
        return self._proc.returncode

    def remove_shared_files(self) -> None:
        """Remove the noted shared files once the child's whole tree is gone."""
        if not self._shared_files or not self.exited():
            return
        for path in sorted(self._shared_files):
            try:
                os.unlink(path)
                logger.debug("%s: removed %s", self.name, path)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("%s: cannot remove %s: %s", self.name, path, e)
        self._shared_files.clear()

    def stop(self, timeout: float = 20.0) -> int | None:
        """Terminate, wait up to ``timeout``, kill what is left, reap. Idempotent."""
        return stop_all([self], timeout)[self.name]

    # ------------------------------------------------------------------ logs
    def _pump(self) -> None:
        assert self._proc and self._proc.stdout
        sink: IO[str] | None = None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            sink = open(self.log_path, "a", encoding="utf-8", errors="replace")
        prefix = f"[{self.name}] "
        try:
            for raw in iter(self._proc.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self._tail.append(line)
                if sink:
                    sink.write(line + "\n")
                    sink.flush()
                else:
                    with self._echo_lock:
                        try:
                            self._echo.write(prefix + line + "\n")
                            self._echo.flush()
                        except (ValueError, OSError):  # echo closed during shutdown
                            pass
        finally:
            if sink:
                sink.close()


def stop_all(procs: Sequence[ManagedProcess], timeout: float = 20.0) -> dict[str, int | None]:
    """Stop several children concurrently: SIGTERM all, one shared grace period,
    then SIGKILL the stragglers' whole trees. Returns exit codes by name."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(p.exited() for p in procs):
        time.sleep(0.1)
    for p in procs:
        if not p.exited():
            logger.warning("%s did not exit within %.0fs of SIGTERM; killing it", p.name, timeout)
            p.kill()
    codes = {p.name: p.reap() for p in procs}
    # SIGKILL is delivered asynchronously: wait until the descendants are gone too.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not all(p.exited() for p in procs):
        time.sleep(0.05)
    for p in procs:
        p.remove_shared_files()
    return codes


def _is_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------- readiness


def wait_until(
    check: Callable[[], bool],
    *,
    proc: ManagedProcess,
    what: str,
    timeout: float,
    interval: float = 0.5,
    stop: threading.Event | None = None,
) -> None:
    """Poll ``check`` until true; fail fast (with the child's last lines) if it exits."""
    deadline = time.monotonic() + timeout
    while True:
        if stop is not None and stop.is_set():
            raise ProcessStartError(proc.name, f"interrupted while waiting for {what}")
        code = proc.poll()
        if code is not None:
            raise ProcessStartError(
                proc.name, f"exited with code {code} before {what}", proc.tail()
            )
        try:
            if check():
                return
        except Exception:  # not up yet
            pass
        if time.monotonic() > deadline:
            raise ProcessStartError(proc.name, f"no {what} within {timeout:.0f}s", proc.tail())
        time.sleep(interval)


def http_ok(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tcp_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


class PortAllocator:
    """Hands out distinct free TCP ports, scanning up from ``start``.

    Ports planned now but bound later (a worker binds its HTTP port only at the
    end of its start-up) must lie below the kernel's ephemeral range: there any
    outgoing connection made meanwhile can take the port first (seen: a prefill
    worker's port taken by a connection during a 1P1D start-up).

    ``spacing`` leaves room above each port, because SGLang derives helper
    ports (NCCL/dist-init) from its ``--port``.
    """

    def __init__(self, host: str, start: int, spacing: int = 1, end: int = 65000):
        self.host = host
        self.next = start
        self.spacing = spacing
        self.end = end
        self.taken: set[int] = set()

    def take_block(self, n: int) -> int:
        """Reserve ``n`` consecutive ports for someone else's allocator; returns the first."""
        first = self.take(spacing=n)
        self.taken.update(range(first, first + n))
        return first

    def take(self, *, spacing: int | None = None) -> int:
        step = spacing or self.spacing
        port = self.next
        while port < self.end:
            if port not in self.taken and port_free(self.host, port):
                self.taken.add(port)
                self.next = port + step
                return port
            port += 1
        raise RuntimeError(f"no free TCP port on {self.host} between the start and {self.end}")
