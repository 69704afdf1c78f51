"""An in-process stand-in for :class:`bana_sglang.radix_global.mooncake_kv.MooncakeKV`
and for the index client, for fast unit tests of the store's data path.

:class:`FakeKV` keeps objects as bytes and really copies them from and to the
pointers it is given (``ctypes``), with Mooncake's return conventions (bytes
read per key, ``-704`` for a missing key); it counts native calls and slices,
so a test can hold the data path to its slice budget. The live tests run the
same code against a real ``mooncake_master`` and storage process.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from bana_sglang.radix_global.mooncake_kv import NOT_FOUND, StoreConfig
from bana_sglang.wire import index as m


class FakeKV:
    def __init__(self, config: StoreConfig | None = None):
        self.config = config or StoreConfig(master_addr="127.0.0.1:1", staging_bytes=1 << 20)
        self.objects: dict[str, bytes] = {}
        self.registered: list[tuple[int, int]] = []
        self.calls: dict[str, int] = {}
        self.slices: dict[str, int] = {}
        self.sessions = 0

    def _count(self, op: str, slices: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.slices[op] = self.slices.get(op, 0) + slices

    def _check(self, ptr: int, size: int) -> None:
        if not self.is_registered(ptr, size):
            raise AssertionError(f"{size} bytes at {ptr:#x} are not registered")

    # -- MooncakeKV's interface
    def connect(self) -> bool:
        return True

    def close(self) -> None:
        pass

    @property
    def available(self) -> bool:
        return True

    def register(self, ptr: int, size: int) -> None:
        self.registered.append((ptr, size))

    def unregister(self, ptr: int) -> None:
        self.registered = [(p, n) for p, n in self.registered if p != ptr]

    def is_registered(self, ptr: int, size: int) -> bool:
        return any(p <= ptr and ptr + size <= p + n for p, n in self.registered)

    def put_multi(self, keys, ptrs, sizes) -> list[int]:
        self._count("put", sum(len(p) for p in ptrs))
        for key, ps, ss in zip(keys, ptrs, sizes):
            for p, s in zip(ps, ss):
                self._check(p, s)
            self.objects[key] = b"".join(ctypes.string_at(p, s) for p, s in zip(ps, ss))
        return [0] * len(keys)

    def get_multi(self, keys, ptrs, sizes) -> list[int]:
        self._count("get", sum(len(p) for p in ptrs))
        out = []
        for key, ps, ss in zip(keys, ptrs, sizes):
            data = self.objects.get(key)
            if data is None:
                out.append(NOT_FOUND)
                continue
            pos = 0
            for p, s in zip(ps, ss):
                self._check(p, s)
                ctypes.memmove(p, data[pos : pos + s], min(s, len(data) - pos))
                pos += s
            out.append(min(pos, len(data)))
        return out

    def get_session_start(self, keys) -> list[int]:
        self._count("session", 0)
        self.sessions += 1
        return [0 if k in self.objects else NOT_FOUND for k in keys]

    def get_session_end(self, keys) -> None:
        self.sessions -= 1

    def get_ranges(self, keys, ptrs, sizes, offsets) -> list[int]:
        self._count("ranges", sum(len(p) for p in ptrs))
        out = []
        for key, ps, ss, os_ in zip(keys, ptrs, sizes, offsets):
            data = self.objects.get(key)
            if data is None:
                out.append(NOT_FOUND)
                continue
            n = 0
            for p, s, o in zip(ps, ss, os_):
                self._check(p, s)
                chunk = data[o : o + s]
                ctypes.memmove(p, chunk, len(chunk))
                n += len(chunk)
            out.append(n)
        return out

    def exists_many(self, keys) -> list[bool]:
        self._count("exists", 0)
        return [k in self.objects for k in keys]

    def remove_many(self, keys, *, force: bool = False) -> list[int]:
        return [0 if self.objects.pop(k, None) is not None else NOT_FOUND for k in keys]

    def put_bytes(self, key: str, value: bytes) -> None:
        self.objects[key] = bytes(value)

    def get_bytes(self, key: str) -> bytes | None:
        return self.objects.get(key)

    def size_of(self, key: str) -> int:
        return len(self.objects[key]) if key in self.objects else NOT_FOUND


@dataclass
class _Grant:
    intent: int
    start: int
    stop: int
    note: str = ""


class FakeIndex:
    """The index client's publishing calls over a plain set (every page is granted
    unless present; ``commit`` makes the written ones present)."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.intents: dict[int, list[str]] = {}
        self.calls: list[str] = []
        self.available = True

    def publish_intent(self, chain: Sequence[str], sizes, owner: str, *, parent=None):
        self.calls.append("intent")
        if not self.available:
            return None
        start = 0
        while start < len(chain) and chain[start] in self.present:
            start += 1
        intent = len(self.intents) + 1
        self.intents[intent] = list(chain[start:])
        return _Grant(intent, start, len(chain))

    def commit(self, intent: int, written: int) -> int | None:
        self.calls.append("commit")
        pages = self.intents.pop(intent)[:written]
        self.present.update(pages)
        return len(pages)

    def lookup(self, chain, **kw) -> m.Match:  # pragma: no cover - not used by these tests
        raise NotImplementedError

    def close(self) -> None:
        pass
