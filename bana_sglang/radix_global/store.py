"""KV pages in the Mooncake Store: framing, verification, and the native binding.

Built on :class:`~bana_sglang.radix_global.mooncake_kv.MooncakeKV` (the binding:
native codes -> ``StoreError``, outage gate). :class:`PageStore` frames KV pages: every stored object is a fixed
  :data:`HEADER_SIZE`-byte header (magic, format version, layout digest, page
  hash, dtype, shape, payload length, payload CRC32, header CRC32) followed by
  the payload. Loads verify every header field and the payload checksum.

Invariants:
- a load returns the bytes that were stored under that page hash *for this
  layout*, or a :class:`Miss` (missing key, other layout, other page, wrong
  size, bad checksum, store down); never wrong data, never an exception;
- a store failure never raises out of ``put_pages``/``get_pages``/``get_page``;
  it is reported in the result (puts) or as a miss (gets);
- workers contribute no memory segment (``global_segment_size=0``): the pages
  live in the dedicated storage process (:mod:`storage_server`), so a worker's
  exit loses nothing.

Data path: the zero-copy multi-buffer APIs (``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers``) work over TCP on CPU once buffers are
registered (an unregistered buffer fails with TRANSFER_FAIL; a buffer larger or
smaller than the object fails with INVALID_PARAMS/TRANSFER_FAIL, hence the
size diagnosis on failed reads). The header always goes through a registered
header arena. The payload goes directly from/to the caller's tensor when it
lies in a region registered with :meth:`PageStore.register` (e.g. a KV pool),
else through a registered staging buffer (one memcpy each way, done with numpy:
torch's ``copy_``/``clone`` of a 64 KB tensor took ~15 ms under CPU contention).
``python -m bana_sglang.radix_global.bench_store`` measures both paths; on the
shared 2-core machine (load ~15) both gave ~20 MB/s at 64 KB pages and
~100-200 MB/s at 1-4 MB pages, batches of 8.
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bana_sglang.radix_global.errors import StoreError
from bana_sglang.radix_global.keys import HASH_BYTES, KVLayout, PageHash
from bana_sglang.radix_global.mooncake_kv import (  # noqa: F401  (re-exported)
    HAS_LEASE, NOT_FOUND, RPC_FAIL, UNAVAILABLE, MooncakeKV, StoreConfig, describe, page_key,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------- page framing

MAGIC = b"BKVP"
FORMAT_VERSION = 1
_MAX_DIMS = 8
# magic, version, header size, layout digest, page hash, dtype name, ndim, 8 dims,
# payload length, payload crc32, then header crc32 over all of the above.
_HDR = struct.Struct(f"<4sHH{HASH_BYTES}s{HASH_BYTES}s16sB{_MAX_DIMS}QQI")
_HDR_CRC = struct.Struct("<I")
HEADER_SIZE = 192  # fixed; room left for later fields, keeps the payload 64-byte aligned
assert _HDR.size + _HDR_CRC.size <= HEADER_SIZE


class Miss(NamedTuple):
    """A load that found nothing usable. ``reason``: missing, unavailable,
    layout_mismatch, page_mismatch, shape_mismatch, size_mismatch, checksum,
    bad_header, store_error."""

    page: PageHash
    reason: str
    detail: str = ""


class PutResult(NamedTuple):
    """``written``: leading pages stored (commit exactly these); ``failed``: the
    first failing page and why (None when all were written)."""

    written: int
    failed: Miss | None


class LoadResult(NamedTuple):
    """``tensors``: the leading pages that loaded and verified, in order;
    ``miss``: why loading stopped early (None when every page loaded)."""

    tensors: tuple[torch.Tensor, ...]
    miss: Miss | None


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class PageStore:
    """Framed, verified KV pages of one :class:`KVLayout` in the Mooncake store.

    Single-threaded use per instance is expected (calls are serialised by a lock).
    """

    def __init__(self, layout: KVLayout, kv: MooncakeKV):
        self.layout = layout
        self.kv = kv
        self._digest = bytes.fromhex(layout.digest)
        self._dtype = getattr(torch, layout.dtype)
        self._dtype_field = layout.dtype.encode("ascii").ljust(16, b"\0")
        self._shape = layout.page_shape
        self._payload = layout.page_nbytes
        cfg = kv.config
        if self._payload > cfg.staging_bytes:
            raise ValueError(f"a page ({self._payload} bytes) is larger than the staging buffer "
                             f"({cfg.staging_bytes} bytes); raise BANA_STORE_STAGING_BYTES")
        self._batch = max(1, min(cfg.max_batch, cfg.staging_bytes // self._payload))
        self._headers = torch.zeros(self._batch * HEADER_SIZE, dtype=torch.uint8)
        self._staging = torch.empty(self._batch * self._payload, dtype=torch.uint8)
        self._headers_np = self._headers.numpy()
        kv.register(self._headers.data_ptr(), self._headers.numel())
        kv.register(self._staging.data_ptr(), self._staging.numel())
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, layout: KVLayout, config: StoreConfig) -> PageStore:
        kv = MooncakeKV(config)
        kv.connect()  # a master that is down now is retried later, not an error
        return cls(layout, kv)

    @property
    def object_size(self) -> int:
        """Bytes one page takes in the store (what the index accounts)."""
        return HEADER_SIZE + self._payload

    def register(self, tensor: torch.Tensor) -> None:
        """Register a CPU tensor's memory (e.g. a KV pool) so pages inside it move
        without a staging copy. The tensor must outlive this store."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only contiguous CPU tensors can be registered")
        self.kv.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    # -- header
    def _header(self, page: PageHash, payload: memoryview) -> bytes:
        dims = list(self._shape) + [0] * (_MAX_DIMS - len(self._shape))
        body = _HDR.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self._digest, bytes.fromhex(page),
                         self._dtype_field, len(self._shape), *dims, len(payload),
                         zlib.crc32(payload))
        return body + _HDR_CRC.pack(zlib.crc32(body))

    def _verify(self, page: PageHash, header: bytes, payload: memoryview) -> Miss | None:
        body = header[:_HDR.size]
        (crc,) = _HDR_CRC.unpack_from(header, _HDR.size)
        if zlib.crc32(body) != crc:
            return Miss(page, "bad_header", "header checksum mismatch")
        (magic, version, hsize, digest, phash, dtype, ndim, *rest) = _HDR.unpack(body)
        dims, length, pcrc = rest[:_MAX_DIMS], rest[_MAX_DIMS], rest[_MAX_DIMS + 1]
        if magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_SIZE:
            return Miss(page, "bad_header", f"magic {magic!r} version {version} header {hsize}")
        if digest != self._digest:
            return Miss(page, "layout_mismatch", f"stored layout {digest.hex()}")
        if phash != bytes.fromhex(page):
            return Miss(page, "page_mismatch", f"stored page {phash.hex()}")
        if dtype != self._dtype_field or tuple(dims[:ndim]) != self._shape:
            return Miss(page, "shape_mismatch", f"{dtype.rstrip(bytes(1)).decode()} {dims[:ndim]}")
        if length != len(payload):
            return Miss(page, "size_mismatch", f"stored {length} bytes, expected {len(payload)}")
        if zlib.crc32(payload) != pcrc:
            return Miss(page, "checksum", "payload checksum mismatch")
        return None

    def _check_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != self._dtype or tuple(t.shape) != self._shape:
            raise ValueError(f"page tensor must be {self.layout.dtype} {self._shape}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        return t if t.is_contiguous() else t.contiguous()

    # -- puts
    def put_pages(self, pages: Sequence[PageHash], tensors: Sequence[torch.Tensor]) -> PutResult:
        """Store pages in order; stop at the first failure. Never raises for store
        trouble (a wrong tensor shape/dtype is a caller bug and raises ValueError)."""
        if len(pages) != len(tensors):
            raise ValueError(f"{len(pages)} pages but {len(tensors)} tensors")
        checked = [self._check_tensor(t) for t in tensors]
        written = 0
        with self._lock:
            for lo in range(0, len(pages), self._batch):
                hi = min(len(pages), lo + self._batch)
                n, failed = self._put_batch(pages[lo:hi], checked[lo:hi])
                written += n
                if failed is not None:
                    return PutResult(written, failed)
        return PutResult(written, None)

    def put_page(self, page: PageHash, tensor: torch.Tensor) -> bool:
        return self.put_pages([page], [tensor]).written == 1

    def _payload_ptr(self, t: torch.Tensor, slot: int, *, copy_in: bool) -> tuple[int, memoryview]:
        """Where slot's payload lives for the native call, and a view for checksums."""
        nbytes = self._payload
        if t.device.type == "cpu" and self.kv.is_registered(t.data_ptr(), nbytes):
            return t.data_ptr(), memoryview(_as_bytes_view(t).numpy())
        stage = self._staging[slot * nbytes:(slot + 1) * nbytes]
        stage_np = stage.numpy()
        if copy_in:
            # numpy, not torch: a single-threaded memcpy (torch's copy_ of a small
            # tensor cost ~15 ms under CPU contention on the shared 2-core machine)
            stage_np[:] = _as_bytes_view(t.cpu() if t.device.type != "cpu" else t).numpy()
        return stage.data_ptr(), memoryview(stage_np)

    def _put_batch(self, pages: Sequence[PageHash], tensors: Sequence[torch.Tensor]) -> tuple[int, Miss | None]:
        keys, ptrs, sizes = [], [], []
        for slot, (page, t) in enumerate(zip(pages, tensors)):
            pptr, view = self._payload_ptr(t, slot, copy_in=True)
            hdr = self._header(page, view)
            hslot = self._headers[slot * HEADER_SIZE:(slot + 1) * HEADER_SIZE]
            self._headers_np[slot * HEADER_SIZE:slot * HEADER_SIZE + len(hdr)] = memoryview(hdr)
            keys.append(page_key(page))
            ptrs.append([hslot.data_ptr(), pptr])
            sizes.append([HEADER_SIZE, self._payload])
        try:
            rcs = self.kv.put_multi(keys, ptrs, sizes)
        except StoreError as e:
            return 0, Miss(pages[0], "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error", str(e))
        for i, rc in enumerate(rcs):
            if rc != 0:
                return i, Miss(pages[i], "store_error", f"put: {describe(rc)}")
        return len(pages), None

    # -- gets
    def get_pages(self, pages: Sequence[PageHash], out: Sequence[torch.Tensor] | None = None) -> LoadResult:
        """Load pages in order, stopping at the first miss. With ``out``, page i is
        written into ``out[i]`` (which must match the layout) and returned; a
        miss may leave garbage in the ``out`` tensors from the missing page on."""
        if out is not None and len(out) != len(pages):
            raise ValueError(f"{len(pages)} pages but {len(out)} output tensors")
        dests = [self._check_tensor(t) for t in out] if out is not None else None
        loaded: list[torch.Tensor] = []
        with self._lock:
            for lo in range(0, len(pages), self._batch):
                hi = min(len(pages), lo + self._batch)
                got, miss = self._get_batch(pages[lo:hi], dests[lo:hi] if dests else None)
                loaded.extend(got)
                if miss is not None:
                    return LoadResult(tuple(loaded), miss)
        return LoadResult(tuple(loaded), None)

    def get_page(self, page: PageHash, out: torch.Tensor | None = None) -> torch.Tensor | Miss:
        """The verified page tensor, or a :class:`Miss` saying why not."""
        res = self.get_pages([page], None if out is None else [out])
        return res.tensors[0] if res.tensors else res.miss  # type: ignore[return-value]

    def _get_batch(self, pages: Sequence[PageHash], dests: Sequence[torch.Tensor] | None
                   ) -> tuple[list[torch.Tensor], Miss | None]:
        keys, ptrs, sizes, views, direct = [], [], [], [], []
        for slot, page in enumerate(pages):
            d = dests[slot] if dests else None
            if d is not None and d.device.type == "cpu" and self.kv.is_registered(d.data_ptr(), self._payload):
                pptr, view = d.data_ptr(), memoryview(_as_bytes_view(d).numpy())
                direct.append(True)
            else:
                stage = self._staging[slot * self._payload:(slot + 1) * self._payload]
                pptr, view = stage.data_ptr(), memoryview(stage.numpy())
                direct.append(False)
            keys.append(page_key(page))
            ptrs.append([self._headers[slot * HEADER_SIZE:].data_ptr(), pptr])
            sizes.append([HEADER_SIZE, self._payload])
            views.append(view)
        try:
            rcs = self.kv.get_multi(keys, ptrs, sizes)
        except StoreError as e:
            return [], Miss(pages[0], "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error", str(e))
        out: list[torch.Tensor] = []
        for slot, (page, rc) in enumerate(zip(pages, rcs)):
            if rc == NOT_FOUND:
                return out, Miss(page, "missing")
            if rc == RPC_FAIL:
                return out, Miss(page, "unavailable", describe(rc))
            if rc < 0:
                return out, self._diagnose(page, rc)
            if rc != self.object_size:
                return out, Miss(page, "size_mismatch", f"object is {rc} bytes, expected {self.object_size}")
            header = self._headers_np[slot * HEADER_SIZE:(slot + 1) * HEADER_SIZE].tobytes()
            miss = self._verify(page, header, views[slot])
            if miss is not None:
                return out, miss
            if direct[slot]:
                out.append(dests[slot])  # type: ignore[index]
            else:
                stage = self._staging[slot * self._payload:(slot + 1) * self._payload]
                if dests is not None:
                    dest = dests[slot]
                    if dest.device.type == "cpu":
                        _as_bytes_view(dest).numpy()[:] = stage.numpy()
                    else:
                        dest.copy_(stage.view(self._dtype).reshape(self._shape))
                    out.append(dest)
                else:
                    out.append(torch.from_numpy(stage.numpy().copy()).view(self._dtype).reshape(self._shape))
        return out, None

    def _diagnose(self, page: PageHash, rc: int) -> Miss:
        """A failed read: an object of another size fails inside Mooncake
        (-600 or -800 depending on the direction), so ask for its size to say why."""
        try:
            size = self.kv.size_of(page_key(page))
        except StoreError as e:
            return Miss(page, "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error",
                        describe(rc))
        if size != self.object_size:
            return Miss(page, "size_mismatch", f"object is {size} bytes, expected {self.object_size}")
        return Miss(page, "store_error", describe(rc))

    # -- housekeeping
    def remove(self, pages: Sequence[PageHash], *, force: bool = False) -> list[int]:
        """Native per-page codes (0 removed, -704 absent, -706 leased); raises
        StoreError when the store is unavailable."""
        return self.kv.remove_many([page_key(p) for p in pages], force=force)

    def exists_many(self, pages: Sequence[PageHash]) -> list[bool]:
        return self.kv.exists_many([page_key(p) for p in pages])

