"""Loading verified pages from the store into a KV pool, group of layers by group.

One load moves the hit pages of every request of a batch. Its layers are read
in *groups* (:func:`layer_groups`: layer 0 alone, since the forward waits for
it, then groups that grow with what is already loaded), each group one batched
ranged get for all pages; every layer is released to the forward as soon as its
group is in the pool, except the last, which the caller releases once every
page's MAC has matched (:meth:`LayerwiseRead.finish`).

Two modes, the same pages and the same checks:

- ``staged`` (any Mooncake build; HiCache's pattern): each group lands in the
  host :class:`~bana_sglang.radix_global.pool.Arena`, one range per page; the
  MAC is fed from the arena, and one indexed copy per layer and K/V moves it
  into the pool. The arena is used in two halves: a reader thread fetches the
  next chunk into one while the load thread verifies and copies the other, so
  the transfer, the MAC and the copy overlap. On CUDA the arena is pinned, the
  copies run on a side stream (one host-to-device copy per chunk, then the
  indexed copies), they start only after the scheduler's work queued before the
  load (``ready``), and each group's layers are released with an event the
  forward waits on GPU-side.
- ``direct`` (``MooncakeDirectLinker``'s pattern): each group is read straight
  into the pool's slots (two ranges per page and layer: K and V live in
  separate buffers), which must be registered with the client. The MAC is fed
  from the pool on CPU, and from a device-to-host copy of the landed rows on
  CUDA (a device checksum cannot authenticate a page; the key never leaves the
  host). On CUDA the load waits on the CPU for ``ready`` before Mooncake writes.

A staged load into a CPU pool on the storage process's host goes through it
when it can (``local``, :class:`~bana_sglang.radix_global.shm_arena.LocalLoads`):
the storage process copies every page, whole, into a shared-memory arena (one
local copy, no transfer), and the load thread checks the headers, then copies
each layer into the pool and releases it, feeding its bytes to the MACs. Over
TCP a slice costs about as much as 64 KiB of payload and both processes' CPU
for the stack; the local copy costs neither, so reading everything at once
beats reading layer groups. A load larger than the arena, or one the storage
process does not serve, is read over the engine as above.

Over TCP the staged mode moves far fewer slices (one per page per group against
two per page per layer), which is why it is the default on CPU too.

No SGLang import.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bana_sglang.radix_global.layer_counter import LoadGate
from bana_sglang.radix_global.layerwise import LayerwiseRead, code_miss
from bana_sglang.radix_global.page_format import HEADER_SIZE, Miss
from bana_sglang.radix_global.pool import Arena, KVPool
from bana_sglang.radix_global.shm_arena import LocalLoads, LocalStorageError

MODES = ("staged", "direct")
DIRECT_CHUNK_PAGES = 256  # pages per native call in direct mode (bounds one call's slices)
# Bytes per staged chunk: small enough that the next chunk's transfer overlaps this
# one's MAC and copy, large enough that a call's fixed cost stays small (the cost of a
# load is per slice: one per page per group however the pages are chunked).
CHUNK_BYTES = 4 << 20

Release = Callable[[int, object], None]  # (layer, event or None)


def layer_groups(
    num_layers: int, growth: float = 2.0, layer_bytes: int = 0, min_slice_bytes: int = 0
) -> list[tuple[int, int]]:
    """``[lo, hi)`` groups covering every layer. Each group has at least enough layers
    that one page's range of it carries ``min_slice_bytes`` (a slice's fixed cost is
    about that much payload over TCP); beyond that, the first group is one layer (the
    forward waits for it) and each later one ``growth - 1`` times the layers loaded
    before it: ``growth`` 2 gives 1, 1, 2, 4, ... layers, 1 one layer per group. A
    model whose pages are small in all gets one group."""
    if num_layers < 1:
        raise ValueError("a model has at least one layer")
    if growth < 1:
        raise ValueError(f"the group growth must be >= 1, got {growth}")
    least = 1
    if min_slice_bytes > 0 and layer_bytes > 0:
        least = max(1, -(-min_slice_bytes // layer_bytes))
    groups: list[tuple[int, int]] = []
    lo = 0
    while lo < num_layers:
        size = max(least, int(lo * (growth - 1) + 1e-9), 1)
        hi = min(num_layers, lo + size)
        if num_layers - hi < least:  # no runt group at the end
            hi = num_layers
        groups.append((lo, hi))
        lo = hi
    return groups


@dataclass
class LoadStats:
    """What one load moved and how long its parts took (seconds)."""

    pages: int = 0
    bytes: int = 0
    read_s: float = 0.0  # in Mooncake ranged gets
    verify_s: float = 0.0  # feeding MACs (and, direct on CUDA, the copy back to the host)
    copy_s: float = 0.0  # queueing copies into the pool (CPU: doing them)
    groups: int = 0
    local_pages: int = 0  # pages the storage process copied (the rest: read over the engine)
    event: object = None  # after the last layer's copies (CUDA staged; else None)


class Loader:
    """Loads :class:`LayerwiseRead` sessions into one :class:`KVPool`."""

    def __init__(
        self,
        pool: KVPool,
        mode: str,
        arena: Arena | None,
        *,
        growth: float = 2.0,
        min_slice_bytes: int = 0,
        local: LocalLoads | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"load mode must be one of {', '.join(MODES)}, got {mode!r}")
        if arena is None and (mode == "staged" or pool.device.is_cuda):
            raise ValueError(f"{mode} loads on {pool.device.device} need a host arena")
        if arena is not None and arena.nbytes < 2 * pool.num_layers * pool.layer_bytes:
            raise ValueError(
                f"the arena ({arena.nbytes} bytes) must hold two pages "
                f"({2 * pool.num_layers * pool.layer_bytes} bytes)"
            )
        if local is not None and (mode != "staged" or pool.device.is_cuda):
            raise ValueError("loads through the storage process are staged loads into a CPU pool")
        self.pool = pool
        self.mode = mode
        self.arena = arena
        self.local = local
        self.groups = layer_groups(pool.num_layers, growth, pool.layer_bytes, min_slice_bytes)
        self._busy: list[object] = [None, None]  # last copy out of each arena half (CUDA)
        # direct mode reads each page's header into this (registered by register_headers)
        self._headers = torch.zeros(DIRECT_CHUNK_PAGES * HEADER_SIZE, dtype=torch.uint8)
        self._reader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="bana-store-read"
        )

    def goes_local(self, pages: int, object_size: int) -> bool:
        """Whether a load of ``pages`` pages goes through the storage process (its read
        then needs no session: :meth:`LayerwiseRead.start` with ``session=False``)."""
        if self.local is None:
            return False
        shared = self.local.arena()
        return shared is not None and pages * object_size <= shared.nbytes

    def register_headers(self, kv) -> None:
        """Register the direct mode's header buffer with the load's Mooncake client."""
        kv.register(self._headers.data_ptr(), self._headers.numel())

    def load(
        self,
        read: LayerwiseRead,
        page_ids: torch.Tensor,
        release: Release,
        ready=None,
        gate: LoadGate | None = None,
    ) -> tuple[Miss | None, LoadStats]:
        """Load every page of the started ``read`` into pool pages ``page_ids`` (CPU int64,
        one per page). Layers ``0..L-2`` are released as they land; the caller releases
        the last one when this returns no miss (the MACs matched: :meth:`LayerwiseRead.finish`
        has run). On a miss the pool pages hold garbage and the read is closed.
        ``gate`` (staged): every copy into the pool passes through it; once it is
        cancelled the load raises :class:`LoadCancelled` and writes nothing more."""
        if len(page_ids) != len(read.pages):
            raise ValueError(f"{len(read.pages)} pages but {len(page_ids)} pool pages")
        stats = LoadStats(pages=len(read.pages), bytes=len(read.pages) * read.layer_bytes)
        stats.bytes *= self.pool.num_layers
        if not read.pages:
            return read.finish(), stats
        run = self._staged if self.mode == "staged" else self._direct
        if self.goes_local(len(read.pages), read.object_size):
            run = functools.partial(self._local, self.local.arena())
        try:
            if gate is not None:
                gate.check()  # given up before it began: read nothing
            miss = run(read, page_ids, release, ready, stats, gate)
        except BaseException:
            read.close()
            raise
        if miss is not None:
            read.close()
            return miss, stats
        return read.finish(), stats

    # -- staged
    def _staged(self, read, page_ids, release, ready, stats: LoadStats, gate) -> Miss | None:
        """Chunks (a group of layers of as many pages as half the arena holds) are read
        into alternating arena halves by the reader thread while this thread verifies
        and copies the chunk before: Mooncake's transfer, the MAC and the copy to the
        pool overlap."""
        pool, dev, arena = self.pool, self.pool.device, self.arena
        assert arena is not None
        n, last, p = len(read.pages), pool.num_layers - 1, pool.page_size
        with dev.copy_stream():
            dev.wait_on_side(ready)
            ids = dev.to_device(page_ids)
        host_ids = None
        if not dev.is_cuda:
            host_ids = page_ids.numpy()
            pool.check_page_ids(host_ids)
        half = arena.nbytes // 2

        def slot_bytes(lo: int, hi: int) -> int:  # one page's range: [header +] layers
            return (hi - lo) * pool.layer_bytes + (HEADER_SIZE if read.header_first(lo) else 0)

        chunks: list[tuple[int, int, int, int]] = []  # (lo, hi, first page, pages)
        for lo, hi in self.groups:
            per = max(1, min(half, CHUNK_BYTES) // slot_bytes(lo, hi))
            chunks += [(lo, hi, s, min(per, n - s)) for s in range(0, n, per)]

        def read_chunk(k: int) -> tuple[Miss | None, float]:
            lo, hi, start, m = chunks[k]
            gb = slot_bytes(lo, hi)
            base = arena.ptr + (k % 2) * half
            t0 = time.perf_counter()
            miss = read.read_regions(lo, hi, [[(base + j * gb, gb)] for j in range(m)], start)
            return miss, time.perf_counter() - t0

        pending = self._reader.submit(read_chunk, 0)
        try:
            for k, (lo, hi, start, m) in enumerate(chunks):
                miss, took = pending.result()
                pending = None
                stats.read_s += took
                if miss is not None:
                    return miss
                if k + 1 < len(chunks):
                    dev.synchronize(self._busy[(k + 1) % 2])  # its last copy out is done
                    pending = self._reader.submit(read_chunk, k + 1)
                t1 = time.perf_counter()
                gb = slot_bytes(lo, hi)
                head = HEADER_SIZE if read.header_first(lo) else 0
                base = (k % 2) * half
                rows = arena.buffer[base : base + m * gb].view(m, gb)
                host = rows.numpy()
                for j in range(m):
                    if head:
                        miss = read.check_header(start + j, host[j, :head])
                        if miss is not None:
                            return miss
                    read.feed(start + j, host[j, head:])
                t2 = time.perf_counter()
                stats.verify_s += t2 - t1
                with gate or contextlib.nullcontext(), dev.copy_stream():
                    if host_ids is not None:  # numpy on this thread (see KVPool.host_pages)
                        chunk_idx, off = host_ids[start : start + m], head
                        for part in pool.host_pages()[2 * lo : 2 * hi]:
                            part[chunk_idx] = host[:, off : off + pool.page_rows_nbytes]
                            off += pool.page_rows_nbytes
                    else:
                        src = dev.to_device(rows)[:, head:].view(pool.dtype)
                        src = src.view(m, hi - lo, 2, p, *pool.row_shape)
                        chunk_ids = ids[start : start + m]
                        for layer in range(lo, hi):
                            dev.scatter_pages(pool.k[layer], chunk_ids, src[:, layer - lo, 0], p)
                            dev.scatter_pages(pool.v[layer], chunk_ids, src[:, layer - lo, 1], p)
                    self._busy[k % 2] = dev.record()
                    if gate is not None:
                        gate.event = self._busy[k % 2]
                stats.copy_s += time.perf_counter() - t2
                if start + m == n:  # the group is in the pool
                    stats.groups += 1
                    event = self._busy[k % 2]
                    stats.event = event
                    for layer in range(lo, hi):
                        if layer < last:
                            release(layer, event)
        finally:
            if pending is not None:  # never leave a read running into a closing session
                pending.result()
        return None

    # -- local
    def _local(self, shared, read, page_ids, release, ready, stats: LoadStats, gate) -> Miss | None:
        """Whole pages through the storage process on this host (``self.local``): one
        local copy of every page into the shared arena, then each layer copied into the
        pool and released in turn, then every page's bytes fed to its MAC. A get the
        storage process does not serve reads over the engine instead (:meth:`_staged`)."""
        pool = self.pool
        n, last, obj = len(read.pages), pool.num_layers - 1, read.object_size
        host_ids = page_ids.numpy()
        pool.check_page_ids(host_ids)
        t0 = time.perf_counter()
        try:
            codes = self.local.get(read.keys, [j * obj for j in range(n)], obj)
        except LocalStorageError:
            stats.read_s += time.perf_counter() - t0
            if gate is not None:
                gate.check()  # given up while the storage process did not answer
            return self._staged(read, page_ids, release, ready, stats, gate)
        t1 = time.perf_counter()
        stats.read_s += t1 - t0
        stats.local_pages = n
        for j, rc in enumerate(codes):
            if rc != obj:
                return code_miss(
                    read.pages[j], rc, f"whole page read: {rc if rc < 0 else f'{rc} bytes'}"
                )
        host = shared.buffer[: n * obj].view(n, obj).numpy()
        if read.header_first(0):
            for j in range(n):
                miss = read.check_header(j, host[j, :HEADER_SIZE])
                if miss is not None:
                    return miss
        stats.verify_s += time.perf_counter() - t1
        t2 = time.perf_counter()
        off = HEADER_SIZE
        for i, part in enumerate(pool.host_pages()):  # the payload's order: K, V by layer
            with gate or contextlib.nullcontext():
                part[host_ids] = host[:, off : off + pool.page_rows_nbytes]
            off += pool.page_rows_nbytes
            layer, is_v = divmod(i, 2)
            if is_v and layer < last:
                release(layer, None)
        t3 = time.perf_counter()
        stats.copy_s += t3 - t2
        # The MACs after every copy (the bytes stay put: the storage process writes the
        # arena only inside a get, and the next get is this thread's next load), so that
        # the forward runs its layers meanwhile and waits only for the last one.
        for j in range(n):
            read.feed(j, host[j, HEADER_SIZE:])
        stats.verify_s += time.perf_counter() - t3
        stats.groups += pool.num_layers
        return None

    # -- direct
    def _direct(self, read, page_ids, release, ready, stats: LoadStats, gate) -> Miss | None:
        # Mooncake writes into the pool itself: no gate can stop a late transfer, so a
        # direct load has no deadline (the linker sets none) and ``gate`` only skips
        # a load given up before it began.
        pool, dev = self.pool, self.pool.device
        n, last, prn = len(read.pages), pool.num_layers - 1, pool.page_rows_nbytes
        dev.synchronize(ready)  # Mooncake writes outside any stream
        pids = page_ids.tolist()
        for lo, hi in self.groups:
            stats.groups += 1
            for start in range(0, n, DIRECT_CHUNK_PAGES):
                chunk = pids[start : start + DIRECT_CHUNK_PAGES]
                head = read.header_first(lo)
                regions = []
                for j, pid in enumerate(chunk):
                    parts = (
                        [(self._headers.data_ptr() + j * HEADER_SIZE, HEADER_SIZE)] if head else []
                    )
                    for layer in range(lo, hi):
                        parts.append((pool.k[layer].data_ptr() + pid * prn, prn))
                        parts.append((pool.v[layer].data_ptr() + pid * prn, prn))
                    regions.append(parts)
                t0 = time.perf_counter()
                miss = read.read_regions(lo, hi, regions, start=start)
                t1 = time.perf_counter()
                stats.read_s += t1 - t0
                if miss is not None:
                    return miss
                if head:
                    hdrs = self._headers.numpy()
                    for j in range(len(chunk)):
                        miss = read.check_header(
                            start + j, hdrs[j * HEADER_SIZE : (j + 1) * HEADER_SIZE]
                        )
                        if miss is not None:
                            return miss
                self._feed_direct(read, start, chunk, lo, hi)
                stats.verify_s += time.perf_counter() - t1
            for layer in range(lo, hi):
                if layer < last:
                    release(layer, None)  # Mooncake's writes are done when the call returns
        return None

    def _feed_direct(self, read: LayerwiseRead, start: int, pids: Sequence[int], lo, hi) -> None:
        pool, p = self.pool, self.pool.page_size
        if not pool.device.is_cuda:
            parts = pool.host_pages()[2 * lo : 2 * hi]  # the payload's order: K, V by layer
            for j, pid in enumerate(pids):
                for part in parts:
                    read.feed(start + j, part[pid])
            return
        # CUDA: gather the landed rows in payload order, copy them to the host, hash there
        arena, dev = self.arena, pool.device
        assert arena is not None
        ids = torch.tensor(pids, dtype=torch.int64, device=pool.device.device)
        gb = (hi - lo) * pool.layer_bytes
        per = max(1, arena.nbytes // gb)
        for s in range(0, len(pids), per):
            sub = ids[s : s + per]
            m = len(sub)
            with dev.copy_stream():
                parts = []
                for layer in range(lo, hi):
                    parts.append(dev.gather_pages(pool.k[layer], sub, p))
                    parts.append(dev.gather_pages(pool.v[layer], sub, p))
                rows = torch.stack(parts, dim=1).view(m, -1).view(torch.uint8)
                host = arena.buffer[: m * gb].view(m, gb)
                host.copy_(rows, non_blocking=True)
                done = dev.record()
            dev.synchronize(done)
            h = host.numpy()
            for j in range(m):
                read.feed(start + s + j, h[j])
