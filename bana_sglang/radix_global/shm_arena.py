"""Publishing and loading through the storage process: shared-memory arenas and local copies.

A worker's publish thread put its framed pages into the store with Mooncake's
transfer engine: over TCP into the storage process's segment, its calling thread
polling the transfer until the storage process had the bytes (on the 2-core VM
that put was most of the decode worker's publish CPU, and the storage process's
receive the rest). A worker on the storage process's host now frames its pages in
a :class:`SharedArena` (a 0600 file in ``/dev/shm``, mapped by both processes)
and asks the storage process (:mod:`bana_sglang.wire.storage`, on the project's
authenticated transport) to put them: a local copy into its own segment, no
transfer and no poll. The pages still live in the storage process's segment, so
a worker's exit loses nothing (:mod:`.store`'s invariant). Loads are the mirror
image: the load thread's own arena, into which the storage process copies whole
pages (:class:`LocalLoads`); over TCP a load cost a slice per page per layer
group on both processes' CPU.

- :class:`SharedArena`: the worker's side of the memory (the arena interface of
  :class:`~.pool.Arena`); the file is unlinked once the storage process has
  mapped it, so nothing is left in ``/dev/shm`` when either process exits.
- :class:`LocalStorage`: the worker's client of the storage channel (map, put, get).
- :class:`LocalLoads`: the load thread's arena and gets, and what it does when the
  storage process does not answer.
- :class:`ArenaHost`: the storage process's side: maps arenas after checking the
  file (the caller's own 0600 regular file directly in ``/dev/shm``, of the stated
  size; no symlink), one per owner, and puts objects from them and gets objects
  into them; an arena whose worker process is gone (exited or killed) is unmapped
  (:meth:`ArenaHost.reap`).

The publish arena is also registered with the worker's own Mooncake client, so a
put the storage process cannot take (it restarted, it does not answer) falls back
to the direct put from the same bytes; the arena is then replaced before it is
written again, so a put the storage process runs late never reads a reused slot.
A load the storage process does not serve reads over the engine into the load
thread's private arena, and its shared arena is dropped for the same reason.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from bana_sglang.wire import storage as m
from bana_sglang.wire.transport import ChannelError, Client

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "bana-arena-"  # the only file names the storage process maps
# Both sides map an arena with its page tables filled at once: a first touch of each
# 4 KiB page afterwards would fault (seen: a 22.8 MB load's first get into a fresh
# arena took 80 ms, later ones 4 ms).
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
REMAP_AFTER_S = 5.0  # after the storage process did not answer, try a fresh arena this late


class LocalStorageError(RuntimeError):
    """The storage process did not take a request (``reason``: the channel's, or
    ``unavailable`` when no answer came)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"the storage process: {reason}: {detail}")
        self.reason, self.detail = reason, detail


# ------------------------------------------------------------------ the worker's side


class SharedArena:
    """A host arena in a fresh 0600 file of ``directory`` (``/dev/shm``), cut into slots."""

    def __init__(self, nbytes: int, directory: str = SHM_DIR):
        import torch

        if not 0 < nbytes <= m.MAX_ARENA_BYTES:
            raise ValueError(f"an arena holds 1 to {m.MAX_ARENA_BYTES} bytes, not {nbytes}")
        fd, self.path = tempfile.mkstemp(prefix=PREFIX, dir=directory)  # mode 0600
        try:
            # allocated now: a write into a sparse file on a full tmpfs is a SIGBUS,
            # this is an OSError (ENOSPC) the publisher answers with direct puts
            os.posix_fallocate(fd, 0, nbytes)
            self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes, flags=MAP_FLAGS)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.nbytes = nbytes
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.ptr = self.buffer.data_ptr()

    def unlink(self) -> None:
        """Remove the file (the mappings stay): once the storage process has mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def slots(self, slot_bytes: int) -> int:
        return self.nbytes // slot_bytes

    def rows(self, n: int, slot_bytes: int):
        """The first ``n`` slots as a ``[n, slot_bytes]`` byte tensor."""
        return self.buffer[: n * slot_bytes].view(n, slot_bytes)

    def close(self) -> None:
        self.unlink()
        self.buffer = None  # type: ignore[assignment]
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view of it is still alive: the GC unmaps it
                pass
            self._mm = None


class LocalStorage:
    """The worker's client of its host's storage process (see the module docstring)."""

    def __init__(self, endpoint: str, owner: str, *, timeout_s: float = 5.0):
        self.endpoint, self.owner = endpoint, owner
        self._client = Client(endpoint, m.CHANNEL, timeout_s=timeout_s)
        self.arena: int | None = None

    def _call(self, make: Any, **fields: Any) -> Any:
        try:
            reply = self._client.request(make, **fields)
        except ChannelError as e:
            raise LocalStorageError("unavailable", e.detail) from None
        if isinstance(reply, m.Error):
            raise LocalStorageError(reply.reason, reply.detail)
        return reply

    def map(self, arena: SharedArena) -> None:
        """Have the storage process map ``arena`` (its file may be unlinked after)."""
        self.arena = None
        reply = self._call(
            m.MapArena, path=arena.path, nbytes=arena.nbytes, owner=self.owner, pid=os.getpid()
        )
        self.arena = reply.arena

    def put(self, keys: Sequence[str], offsets: Sequence[int], size: int) -> list[int]:
        """Mooncake's code per key for objects ``[offsets[i], offsets[i] + size)`` of the arena."""
        return self._objects(m.PutPages, keys, offsets, size)

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int) -> list[int]:
        """Read the whole objects ``keys`` (``size`` bytes each) into arena bytes
        ``[offsets[i], offsets[i] + size)``; per key the bytes read or Mooncake's code.
        After a :class:`LocalStorageError` the storage process may still write the
        arena: the caller must not read it again."""
        return self._objects(m.GetPages, keys, offsets, size)

    def _objects(self, make: Any, keys: Sequence[str], offsets: Sequence[int], size: int):
        if self.arena is None:
            raise LocalStorageError("unknown_arena", "no arena is mapped")
        reply = self._call(
            make,
            arena=self.arena,
            owner=self.owner,
            keys=list(keys),
            offsets=list(offsets),
            size=size,
        )
        if len(reply.codes) != len(keys):
            raise LocalStorageError("malformed", f"{len(reply.codes)} codes for {len(keys)} keys")
        return list(reply.codes)

    def close(self) -> None:
        self._client.close()


class LocalLoads:
    """The load thread's way through the storage process: a shared arena of its own
    (``owner``: not the publisher's) and whole-page gets into it.

    :meth:`arena` maps one when there is none (again :data:`REMAP_AFTER_S` after a
    failure); :meth:`get` reads pages into it. After a get that failed the storage
    process may still write the arena late, so it is dropped and never read again.
    Not thread-safe: the load thread's alone."""

    def __init__(self, endpoint: str, owner: str, nbytes: int, *, timeout_s: float = 5.0):
        self.nbytes = nbytes
        self._client = LocalStorage(endpoint, owner, timeout_s=timeout_s)
        self._arena: SharedArena | None = None
        self._remap_at = 0.0
        self._off = False  # no shared memory on this host: loads read over the engine

    @property
    def endpoint(self) -> str:
        return self._client.endpoint

    def arena(self) -> SharedArena | None:
        """The mapped arena, or None (none yet, or the storage process does not answer)."""
        if self._arena is not None or self._off or time.monotonic() < self._remap_at:
            return self._arena
        try:
            arena = SharedArena(self.nbytes)
        except OSError as e:
            logger.warning("no shared arena for loads (%s): loads read over the engine", e)
            self._off = True
            return None
        try:
            self._client.map(arena)
        except LocalStorageError as e:
            logger.warning("the storage process did not map the load arena (%s)", e)
            arena.close()
            self._remap_at = time.monotonic() + REMAP_AFTER_S
            return None
        finally:
            arena.unlink()
        logger.info("loading through the storage process at %s", self.endpoint)
        self._arena = arena
        return arena

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int) -> list[int]:
        """:meth:`LocalStorage.get` into :meth:`arena`'s bytes; raises
        :class:`LocalStorageError` (and drops the arena) when the storage process did
        not answer or refused."""
        if self._arena is None:
            raise LocalStorageError("unknown_arena", "no arena is mapped")
        try:
            return self._client.get(keys, offsets, size)
        except LocalStorageError as e:
            logger.warning(
                "the storage process did not serve a load (%s): reading over the engine", e
            )
            self._client.arena = None
            self._arena.close()
            self._arena = None
            # a restarted storage process maps a fresh arena at once; a silent one waits
            self._remap_at = time.monotonic() + (
                0.0 if e.reason == "unknown_arena" else REMAP_AFTER_S
            )
            raise

    def close(self) -> None:
        self._client.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None


# ------------------------------------------------------------------ the storage process's side


class InvalidArena(ValueError):
    pass


def open_arena(path: str, nbytes: int, directory: str = SHM_DIR) -> mmap.mmap:
    """Map ``path`` read-write after checking it is a worker's arena file: named
    ``bana-arena-*`` directly in ``directory`` (opened relative to it, the name not a
    symlink), a regular file with one link, owned by this process's user, mode 0600
    (nobody else reads or writes it), exactly ``nbytes`` long."""
    name = os.path.basename(path)
    if os.path.dirname(path) != directory or not name.startswith(PREFIX) or name in (".", ".."):
        raise InvalidArena(f"{path!r} is not a {PREFIX}* file directly in {directory}")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise InvalidArena(f"cannot open {path!r}: {e.strerror}") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise InvalidArena(f"{path!r} is not a regular file with one link")
        if st.st_uid != os.getuid():
            raise InvalidArena(f"{path!r} belongs to uid {st.st_uid}, not {os.getuid()}")
        if st.st_mode & 0o077:
            raise InvalidArena(f"{path!r} has mode {stat.S_IMODE(st.st_mode):o}, not 600")
        if st.st_size != nbytes:
            raise InvalidArena(f"{path!r} holds {st.st_size} bytes, not {nbytes}")
        return mmap.mmap(fd, nbytes, flags=MAP_FLAGS)
    finally:
        os.close(fd)


def process_start(pid: int) -> float | None:
    """``pid``'s start time, or None when no such process runs: with the pid, it
    names one process (pids are reused)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


@dataclass
class _Mapped:
    owner: str
    mm: mmap.mmap
    anchor: Any  # the ctypes view that gives the address (released before the unmap)
    ptr: int
    nbytes: int
    pid: int = 0  # the worker process that mapped it (0: not known)
    started: float | None = None  # and that process's start time


class ArenaHost:
    """The storage process's arenas and the channel's handlers. ``store``: its
    ``MooncakeDistributedStore`` (``register_buffer``, ``unregister_buffer``,
    ``batch_put_from``, ``batch_get_into``). The handlers run on the channel's serving thread and
    :meth:`reap` on another; a lock keeps an arena from going while it is read."""

    def __init__(self, store: Any, directory: str = SHM_DIR):
        self._store, self._dir = store, directory
        self._arenas: dict[int, _Mapped] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict:
        return {m.MapArena: self.map, m.PutPages: self.put, m.GetPages: self.get}

    def map(self, req: m.MapArena) -> Any:
        try:
            mm = open_arena(req.path, req.nbytes, self._dir)
        except InvalidArena as e:
            return m.Error(id=req.id, reason="invalid", detail=str(e))
        started = process_start(req.pid) if req.pid else None
        pid = req.pid if started is not None else 0  # not seen here (another pid namespace)
        anchor = ctypes.c_char.from_buffer(mm)
        ptr = ctypes.addressof(anchor)
        with self._lock:
            rc = self._store.register_buffer(ptr, req.nbytes)
            if rc != 0:
                del anchor
                mm.close()
                return m.Error(id=req.id, reason="invalid", detail=f"register_buffer returned {rc}")
            for aid in [a for a, x in self._arenas.items() if x.owner == req.owner]:
                self._drop(aid)  # the owner's earlier arena (a restarted or remapping worker)
            aid = secrets.randbits(63)  # never an id a worker holds from an earlier process
            self._arenas[aid] = _Mapped(req.owner, mm, anchor, ptr, req.nbytes, pid, started)
        logger.info(
            "mapped %s's arena %d (%d bytes, pid %s)", req.owner, aid, req.nbytes, pid or "?"
        )
        return m.Mapped(id=req.id, arena=aid)

    def put(self, req: m.PutPages) -> Any:
        with self._lock:
            a = self._objects(req)
            if isinstance(a, m.Error):
                return a
            codes = self._store.batch_put_from(
                list(req.keys), [a.ptr + o for o in req.offsets], [req.size] * len(req.keys)
            )
        return m.Put(id=req.id, codes=[int(c) for c in codes])

    def get(self, req: m.GetPages) -> Any:
        # Mooncake's batch_get_into fills only the last destination of a key that is asked
        # for twice (and reports every one filled): a load of two requests with the same
        # prefix asks so. Each key is read once, then copied to its other destinations.
        first: dict[str, int] = {}
        for k, o in zip(req.keys, req.offsets):
            first.setdefault(k, o)
        with self._lock:
            a = self._objects(req)
            if isinstance(a, m.Error):
                return a
            got = self._store.batch_get_into(
                list(first), [a.ptr + o for o in first.values()], [req.size] * len(first)
            )
            code = {k: int(c) for k, c in zip(first, got)}
            for k, o in zip(req.keys, req.offsets):
                if o != first[k] and code[k] > 0:
                    ctypes.memmove(a.ptr + o, a.ptr + first[k], code[k])
        return m.Got(id=req.id, codes=[code[k] for k in req.keys])

    def _objects(self, req: m.PutPages | m.GetPages) -> _Mapped | m.Error:
        """The arena of a put or get, once its objects are checked to lie inside it."""
        a = self._arenas.get(req.arena)
        if a is None or a.owner != req.owner:
            return m.Error(
                id=req.id, reason="unknown_arena", detail=f"{req.owner} has no arena {req.arena}"
            )
        if len(req.keys) != len(req.offsets):
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"{len(req.keys)} keys but {len(req.offsets)} offsets",
            )
        end = max(req.offsets) + req.size
        if end > a.nbytes:
            return m.Error(
                id=req.id,
                reason="invalid",
                detail=f"an object ends at byte {end}, past the arena's {a.nbytes}",
            )
        return a

    @property
    def arenas(self) -> int:
        return len(self._arenas)

    def reap(self) -> list[str]:
        """Unmap the arenas whose worker process is gone (its pid no longer runs, or
        runs another process); the owners whose arena went. An arena mapped without
        a pid stays until its owner maps another or :meth:`close`."""
        with self._lock:
            gone = [
                aid
                for aid, a in self._arenas.items()
                if a.pid and process_start(a.pid) != a.started
            ]
            owners = []
            for aid in gone:
                owners.append(self._arenas[aid].owner)
                self._drop(aid)
        for owner in owners:
            logger.info("unmapped %s's arena: its process is gone", owner)
        return owners

    def _drop(self, aid: int) -> None:
        a = self._arenas.pop(aid)
        self._store.unregister_buffer(a.ptr)
        a.anchor = None
        try:
            a.mm.close()
        except BufferError:
            pass

    def close(self) -> None:
        with self._lock:
            for aid in list(self._arenas):
                self._drop(aid)
