"""Pieces every side of a migration shares: the transfer engine wrapper, the
CRC32 of a tensor, and the internal failure type (a reason and a detail)."""

from __future__ import annotations

import os
import threading
import zlib

import torch

from bana_sglang.migrate import messages as m


class TransferEngine:
    """This agent's Mooncake transfer engine (TCP or RDMA), started on first use."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = ""):
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine as _TE

        self._te = _TE()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, {protocol!r}) returned {rc}")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: dict[int, int] = {}
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
        with self._lock:
            if self._registered.pop(t.data_ptr(), None) is not None:
                self._te.unregister_memory(t.data_ptr())

    def read(self, session: str, dst: list[torch.Tensor], src_addrs: list[int]) -> None:
        """Read ``src_addrs`` of the engine at ``session`` into ``dst`` (registered)."""
        lens = [t.numel() * t.element_size() for t in dst]
        rc = self._te.batch_transfer_sync_read(session, [t.data_ptr() for t in dst], src_addrs, lens)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read from {session} returned {rc}")


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy()) & 0xFFFFFFFF


class Fail(Exception):
    """A migration step failed with ``reason`` (a channel reason) and ``detail``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def describe(reply: m.Reply) -> str:
    if isinstance(reply, (m.Failed, m.Error)):
        return f"{reply.reason}: {reply.detail}"
    return type(reply).__name__
