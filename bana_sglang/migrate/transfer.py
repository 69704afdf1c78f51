"""Pieces every side of a migration shares: the Mooncake transfer engine
wrapper and the CRC32 of a tensor (the failure type of a migration step is
:class:`bana_sglang.migrate.errors.TransferError`)."""

from __future__ import annotations

import threading
import zlib

import torch

from bana_sglang.mooncake_env import apply_defaults


class TransferEngine:
    """This agent's Mooncake transfer engine (TCP or RDMA), started on first use."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = ""):
        apply_defaults()  # Mooncake reads its environment when it loads: set it first
        from mooncake.engine import TransferEngine as _TE

        self._te = _TE()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({host!r}, {protocol!r}) returned {rc}"
            )
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> bytes
        self._inflight: dict[int, int] = {}  # destination address -> reads still running
        self._deferred: set[int] = set()  # unregistrations waiting for a late read
        self._lock = threading.Lock()

    def register(self, t: torch.Tensor) -> None:
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            if ptr in self._registered or n == 0:
                return
            rc = self._te.register_memory(ptr, n)
            if rc != 0:
                raise RuntimeError(f"register_memory({n} bytes) returned {rc}")
            self._registered[ptr] = n

    def unregister(self, t: torch.Tensor) -> None:
        ptr = t.data_ptr()
        with self._lock:
            n = self._registered.get(ptr)
            if n is None:
                return
            if any(
                ptr <= p < ptr + n for p in self._inflight
            ):  # a timed-out read may still land here
                self._deferred.add(ptr)
                return
            del self._registered[ptr]
            self._te.unregister_memory(ptr)

    def read(
        self,
        session: str,
        dst: list[torch.Tensor],
        src_addrs: list[int],
        timeout_s: float | None = None,
    ) -> None:
        """Read ``src_addrs`` of the engine at ``session`` into ``dst`` (registered).

        Without ``timeout_s`` this blocks until the engine gives up (Mooncake's
        TCP transport drops a connection after 30 s without progress). With it,
        the read runs on its own thread and :class:`TimeoutError` is raised when
        it has not finished in time (a frozen peer); the late read keeps ``dst``
        alive and registered until it ends, so the caller must not reuse ``dst``."""
        if timeout_s is None:
            self._read(session, dst, src_addrs)
            return
        ptrs = [t.data_ptr() for t in dst]
        done, errors = threading.Event(), []

        def run():
            try:
                self._read(session, dst, src_addrs)
            except Exception as e:  # handed to the waiting caller
                errors.append(e)
            finally:
                with self._lock:
                    for p in ptrs:
                        self._inflight[p] -= 1
                        if not self._inflight[p]:
                            del self._inflight[p]
                    ready = [
                        b
                        for b in self._deferred
                        if not any(b <= p < b + self._registered[b] for p in self._inflight)
                    ]
                    for b in ready:
                        self._deferred.discard(b)
                        del self._registered[b]
                        self._te.unregister_memory(b)
                done.set()

        with self._lock:
            for p in ptrs:
                self._inflight[p] = self._inflight.get(p, 0) + 1
        threading.Thread(target=run, name="bana-te-read", daemon=True).start()
        if not done.wait(timeout_s):
            raise TimeoutError(
                f"no data from the transfer engine at {session} within {timeout_s:.1f}s"
            )
        if errors:
            raise errors[0]

    def _read(self, session: str, dst: list[torch.Tensor], src_addrs: list[int]) -> None:
        lens = [t.numel() * t.element_size() for t in dst]
        rc = self._te.batch_transfer_sync_read(
            session, [t.data_ptr() for t in dst], src_addrs, lens
        )
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read from {session} returned {rc}")


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) & 0xFFFFFFFF
