"""The Mooncake binding: the only module that calls ``MooncakeDistributedStore``.

It turns Mooncake's native return codes (negative ints, ``b""`` for missing)
into :class:`~bana_sglang.radix_global.errors.StoreError` carrying the code and
its meaning, and runs the outage gate: after an RPC failure it stops calling
Mooncake (whose calls block ~4.5 s each while the master is down) and fails
fast until a cheap TCP probe finds the master accepting again; it logs once
when an outage starts and once when it ends. Mooncake's client reconnects to a
restarted master by itself, so recovery needs no re-setup.

Invariants:
- every public method either returns a value or raises ``StoreError`` (never
  returns a negative code, except the per-key code lists of batch calls, which
  callers map);
- while the gate is closed, no call reaches Mooncake more often than once per
  ``probe_interval_s`` and only after the master's RPC port accepts a TCP
  connection;
- no torch import here: the storage process and the index service stay light.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bana_sglang import envs
from bana_sglang.mooncake_env import apply_defaults
from bana_sglang.radix_global.errors import StoreError
from bana_sglang.radix_global.keys import PageHash

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- native codes

#: Mooncake store error codes (mooncake-store ``ErrorCode``) seen or documented.
MOONCAKE_CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -200: "NO_AVAILABLE_HANDLE (store full or no segment mounted)",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS (e.g. buffer size differs from the object size)",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE (read recently; removable after the lease TTL)",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (master unreachable)",
}
NOT_FOUND = -704
HAS_LEASE = -706
RPC_FAIL = -900
UNAVAILABLE = "unavailable"  # StoreError.code while an outage gate is closed


def describe(code: int) -> str:
    return MOONCAKE_CODES.get(code, f"unrecognised Mooncake code {code}")


def miss_reason(e: StoreError) -> str:
    """The miss reason a failed store call stands for: ``unavailable`` (the store or
    its master cannot be reached) or ``store_error``."""
    return "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error"


def page_key(page: PageHash) -> str:
    """The Mooncake key of a page. The hash already carries the layout namespace."""
    return f"bana/kv/{page}"


def allocation_size(nbytes: int) -> int:
    """Bytes an object of ``nbytes`` takes in a Mooncake segment.

    Mooncake's offset allocator (``mooncake-store/src/offset_allocator.cpp``, built,
    as by default, without ``OFFSET_ALLOCATOR_NOT_ROUND_UP``) rounds every allocation
    up to its size class, a float with a 3-bit mantissa: classes are an eighth of a
    power of two apart. A 16576-byte page of ``bana-tiny-v1`` (a 16 KiB payload and
    its 192-byte header) takes 18432 bytes, 11% more. The master's own accounting
    (``master_allocated_bytes``, its eviction watermark) counts the requested size,
    so a segment is full before the master says so. This is what the index accounts
    per page, so that its capacity below the segment holds (checked against a real
    master in ``tests/live/test_page_store.py``). The same in bytes for any
    segment size: past 3.75 GiB the allocator counts in units of 2**k bytes, and a
    page of at least 16 units rounds to the same class."""
    if nbytes < 16:
        return max(0, nbytes)
    shift = nbytes.bit_length() - 4  # keep the leading bit and the 3-bit mantissa
    return -(-nbytes >> shift) << shift


# ---------------------------------------------------------------------- config


@dataclass(frozen=True)
class StoreConfig:
    """How to reach the store. ``global_segment_size`` is 0 for workers and the
    index service: only the storage process contributes memory."""

    master_addr: str  # "host:port" of mooncake_master's RPC
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""  # with protocol "rdma", e.g. "mlx5_0"; "": Mooncake picks
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    staging_bytes: int = 32 << 20  # registered staging buffer for unregistered tensors
    max_batch: int = 256  # header-arena slots = pages per native batch call
    probe_interval_s: float = 0.5  # how often a closed outage gate probes the master

    def __post_init__(self) -> None:
        host, _, port = self.master_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master_addr must be host:port, got {self.master_addr!r}")
        if self.staging_bytes <= 0 or self.max_batch <= 0:
            raise ValueError("staging_bytes and max_batch must be positive")

    @classmethod
    def from_env(cls, master_addr: str | None = None, **overrides: object) -> StoreConfig:
        """Read ``BANA_STORE_MASTER``, ``BANA_STORE_HOST``, ``BANA_STORE_PROTOCOL``,
        ``BANA_STORE_RDMA_DEVICES``, ``BANA_STORE_STAGING_BYTES``, ``BANA_STORE_PROBE_INTERVAL_S``
        (explicit arguments win)."""
        kw: dict[str, object] = {
            "master_addr": master_addr or envs.BANA_STORE_MASTER.get(),
            "local_hostname": envs.BANA_STORE_HOST.get(),
            "protocol": envs.BANA_STORE_PROTOCOL.get(),
            "rdma_devices": envs.BANA_STORE_RDMA_DEVICES.get(),
            "staging_bytes": envs.BANA_STORE_STAGING_BYTES.get(),
            "probe_interval_s": envs.BANA_STORE_PROBE_INTERVAL_S.get(),
        }
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]


def tcp_open(addr: str, timeout: float = 0.2) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout``."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------------- binding


class MooncakeKV:
    """The Mooncake binding: native calls, return codes -> :class:`StoreError`,
    outage gate. Thread-safe (one lock; Mooncake calls are serialised)."""

    def __init__(self, config: StoreConfig):
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        apply_defaults()
        from mooncake.store import MooncakeDistributedStore

        self.config = config
        self._store = MooncakeDistributedStore()
        self._lock = threading.RLock()
        self._ready = False
        self._down_since: float | None = None
        self._next_probe = 0.0
        self._registered: list[tuple[int, int]] = []
        self._closed = False

    # -- lifecycle
    def connect(self) -> bool:
        """Set up the client if not done yet. False (logged) when the master is
        unreachable; calls then fail fast and retry setup after the probe interval."""
        with self._lock:
            if self._ready:
                return True
            if not tcp_open(self.config.master_addr):
                self._enter_outage("setup", "master not accepting connections")
                return False
            c = self.config
            rc = self._store.setup(
                c.local_hostname,
                c.metadata_server,
                c.global_segment_size,
                c.local_buffer_size,
                c.protocol,
                c.rdma_devices,
                c.master_addr,
            )
            if rc != 0:
                self._enter_outage("setup", f"setup returned {rc}")
                return False
            self._ready = True
            for ptr, size in self._registered:  # regions registered before setup
                self._register_native(ptr, size)
            self._leave_outage()
            return True

    def close(self) -> None:
        with self._lock:
            if self._ready and not self._closed:
                self._store.close()
            self._closed = True
            self._ready = False

    @property
    def available(self) -> bool:
        """False while an outage is in progress (calls fail fast)."""
        return self._ready and self._down_since is None

    # -- registration
    def register(self, ptr: int, size: int) -> None:
        with self._lock:
            self._registered.append((ptr, size))
            if self._ready:
                self._register_native(ptr, size)

    def unregister(self, ptr: int) -> None:
        """Forget the region registered at ``ptr`` (before its memory is freed)."""
        with self._lock:
            self._registered = [(p, n) for p, n in self._registered if p != ptr]
            if self._ready:
                self._store.unregister_buffer(ptr)

    def _register_native(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise StoreError(
                "register_buffer", describe(rc), target=f"{size} bytes at {ptr:#x}", code=rc
            )

    def is_registered(self, ptr: int, size: int) -> bool:
        return any(p <= ptr and ptr + size <= p + n for p, n in self._registered)

    # -- outage gate
    def _gate(self, op: str) -> None:
        if self._closed:
            raise StoreError(op, "store client closed", code=UNAVAILABLE)
        if self._ready and self._down_since is None:
            return
        now = time.monotonic()
        if now < self._next_probe:
            raise StoreError(op, "store unavailable (outage in progress)", code=UNAVAILABLE)
        self._next_probe = now + self.config.probe_interval_s
        if not self._ready:
            if not self.connect():
                raise StoreError(op, "store unavailable (setup failed)", code=UNAVAILABLE)
            return
        if not tcp_open(self.config.master_addr):
            raise StoreError(
                op, "store unavailable (master not accepting connections)", code=UNAVAILABLE
            )
        # master is accepting again: let this call through as the probe

    def _enter_outage(self, op: str, why: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "Mooncake store at %s unavailable (%s: %s); loads are misses and "
                "publishing is skipped until it returns",
                self.config.master_addr,
                op,
                why,
            )
        self._next_probe = time.monotonic() + self.config.probe_interval_s

    def _leave_outage(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "Mooncake store at %s reachable again after %.1fs",
                self.config.master_addr,
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    def _check(self, op: str, target: str, rc: int) -> int:
        """Map one native return code: >= 0 passes through, RPC failure opens the
        gate, every negative code raises."""
        if rc >= 0:
            self._leave_outage()
            return rc
        if rc == RPC_FAIL:
            self._enter_outage(op, describe(rc))
        else:
            self._leave_outage()  # the master answered
        raise StoreError(op, describe(rc), target=target, code=rc)

    def _codes(self, op: str, rcs: Sequence[int]) -> list[int]:
        """Batch variant: returns the codes; an RPC failure anywhere opens the gate."""
        if any(rc == RPC_FAIL for rc in rcs):
            self._enter_outage(op, describe(RPC_FAIL))
        elif rcs:
            self._leave_outage()
        return list(rcs)

    # -- operations (each raises StoreError on failure)
    def put_bytes(self, key: str, value: bytes) -> None:
        with self._lock:
            self._gate("put")
            self._check("put", key, self._store.put(key, value))

    def get_bytes(self, key: str) -> bytes | None:
        """The value, or None when the key is absent; raises StoreError when the key
        exists but its bytes cannot be read (Mooncake's ``get`` answers a failed read,
        e.g. of a replica on a stopped storage process, with empty bytes: that is not
        an absent key). Values are never empty here."""
        with self._lock:
            self._gate("get")
            rc = self._store.is_exist(key)
            if rc == 0:
                self._leave_outage()
                return None
            self._check("is_exist", key, rc)
            data = self._store.get(key)
            if not data:
                raise StoreError(
                    "get", "the key exists but its bytes could not be read", target=key
                )
            return bytes(data)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._gate("batch_is_exist")
            rcs = self._codes("batch_is_exist", self._store.batch_is_exist(list(keys)))
        for key, rc in zip(keys, rcs):
            if rc < 0:
                raise StoreError("batch_is_exist", describe(rc), target=key, code=rc)
        return [rc == 1 for rc in rcs]

    def size_of(self, key: str) -> int:
        with self._lock:
            self._gate("get_size")
            return self._check("get_size", key, self._store.get_size(key))

    def remove_matching(self, regex: str) -> int:
        """Force-remove every key matching ``regex``; the number removed."""
        with self._lock:
            self._gate("remove_by_regex")
            return self._check("remove_by_regex", regex, self._store.remove_by_regex(regex, True))

    def remove_many(self, keys: Sequence[str], *, force: bool = False) -> list[int]:
        """Per-key native codes (0 removed, -704 absent, -706 leased, ...)."""
        with self._lock:
            self._gate("batch_remove")
            return self._codes("batch_remove", self._store.batch_remove(list(keys), force))

    def put_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Zero-copy batch put of objects scattered over registered buffers; per-key codes."""
        with self._lock:
            self._gate("batch_put_from_multi_buffers")
            rcs = self._store.batch_put_from_multi_buffers(
                list(keys), [list(p) for p in ptrs], [list(s) for s in sizes]
            )
            return self._codes("batch_put_from_multi_buffers", rcs)

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Zero-copy batch get into registered buffers; per-key bytes read or code."""
        with self._lock:
            self._gate("batch_get_into_multi_buffers")
            rcs = self._store.batch_get_into_multi_buffers(
                list(keys), [list(p) for p in ptrs], [list(s) for s in sizes]
            )
            return self._codes("batch_get_into_multi_buffers", rcs)

    # -- ranged reads (layer-wise loading)
    def get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Open a read session over ``keys`` (needed by :meth:`get_ranges`); per-key codes."""
        with self._lock:
            self._gate("batch_get_session_start")
            return self._codes(
                "batch_get_session_start", self._store.batch_get_session_start(list(keys))
            )

    def get_ranges(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Zero-copy ranged read: object ``keys[i]`` from byte ``offsets[i][j]``, ``sizes[i][j]``
        bytes, into ``ptrs[i][j]`` (registered memory). Per-key bytes read or code."""
        with self._lock:
            self._gate("batch_get_into_multi_buffer_ranges")
            rcs = self._store.batch_get_into_multi_buffer_ranges(
                list(keys),
                [list(p) for p in ptrs],
                [list(s) for s in sizes],
                [list(o) for o in offsets],
            )
            if isinstance(rcs, int):  # a whole-call failure
                rcs = [rcs] * len(keys)
            return self._codes("batch_get_into_multi_buffer_ranges", rcs)

    def get_session_end(self, keys: Sequence[str]) -> None:
        """Close a read session; best effort (a store that went away has no session left)."""
        with self._lock:
            if self._closed or not self._ready:
                return
            try:
                self._store.batch_get_session_end(list(keys))
            except Exception as e:  # noqa: BLE001  (cleanup never fails a load that landed)
                logger.debug("batch_get_session_end: %s", e)
