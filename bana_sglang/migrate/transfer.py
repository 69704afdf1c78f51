"""Pieces every side of a migration shares: the Mooncake transfer engine
wrapper and the checksums of a tensor's bytes (the failure type of a migration
step is :class:`bana_sglang.migrate.errors.TransferError`).

Two checksums, named on the wire (``TensorDesc.checksum``) so both sides compute
the same one: ``crc32`` (zlib, on the host) for CPU tensors, and ``sum32`` for
device tensors, computed where the tensor lives (on a GPU: GPU kernels, no copy
to the host), which zlib cannot do. ``sum32`` is a Fletcher-style pair of sums
over the bytes as little-endian 32-bit words modulo 2^31 - 1, the second
weighted by position, so a changed, lost or reordered word shows; the same bytes
give the same value on any device. Both catch a transfer that went wrong; neither
authenticates: the expected value travels on the authenticated agent channel,
but whoever can write the transfer engine's memory can craft bytes that match
it (docs/SECURITY.md)."""

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


_P = (1 << 31) - 1  # the modulus of sum32 (a prime: position weights never vanish)
_CHUNK_WORDS = 1 << 26  # words per step: bounds the int64 temporaries (512 MB)


def sum32(t: torch.Tensor) -> int:
    """The ``sum32`` checksum of a tensor's bytes, computed on its own device."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat((b, b.new_zeros(pad)))
    words = b.view(torch.int32)
    s1 = s2 = 0
    for lo in range(0, words.numel(), _CHUNK_WORDS):
        w = words[lo : lo + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        w = w % _P
        pos = torch.arange(lo + 1, lo + 1 + w.numel(), device=w.device, dtype=torch.int64) % _P
        s1 = (s1 + int(w.sum())) % _P
        s2 = (s2 + int(((w * pos) % _P).sum())) % _P  # each term < 2^31: the sum stays exact
    return ((s1 << 1) ^ s2) & 0xFFFFFFFF


CHECKSUMS = {"crc32": crc32, "sum32": sum32}


def checksum_for(t: torch.Tensor) -> str:
    """The checksum a migration uses for ``t``: ``crc32`` on the CPU, ``sum32`` elsewhere."""
    return "crc32" if t.device.type == "cpu" else "sum32"


def checksum(t: torch.Tensor, algo: str) -> int:
    if algo not in CHECKSUMS:
        raise ValueError(f"unknown checksum {algo!r}; known: {', '.join(CHECKSUMS)}")
    return CHECKSUMS[algo](t)
