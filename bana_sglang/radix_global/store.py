"""KV pages in the Mooncake store: framed, verified puts, gets and layer-wise reads.

:class:`PageStore` stores each page of one layout as one object (the
:mod:`~bana_sglang.radix_global.page_format` header, then the payload) through
:class:`~bana_sglang.radix_global.mooncake_kv.MooncakeKV` (the binding: native
codes -> ``StoreError``, outage gate), and verifies every header field and the
page MAC (keyed BLAKE3 under the cluster secret) on load. :class:`~bana_sglang.radix_global.layerwise.LayerwiseRead`
(its own module) reads ranges of layers of many pages (the SGLang linker's loads).

Invariants:
- a load returns the bytes that were stored under that page hash *for this
  layout*, or a :class:`Miss` (missing key, other layout, other page, wrong
  size, bad MAC, store down); never wrong data, never an exception;
- a store failure never raises out of ``put_pages``/``put_objects``/``get_pages``/
  ``get_page``; it is reported in the result (puts) or as a miss (gets);
- workers contribute no memory segment (``global_segment_size=0``): the pages
  live in the dedicated storage process (:mod:`storage_server`), so a worker's
  exit loses nothing.

Data path and its cost: Mooncake's zero-copy multi-buffer calls
(``batch_put_from_multi_buffers``, ``batch_get_into_multi_buffers``,
``batch_get_into_multi_buffer_ranges``) move registered memory. Over TCP each
*slice* (one pointer of one object) costs about as much as 50-75 KB of payload
(measured on the 2-core VM: 87 objects of 16 KB took 11 ms as one slice each and
46 ms as eight), so the linker's data path frames whole pages in a host arena
and moves one slice per page (:meth:`PageStore.put_objects`) and one range per
page per group of layers (:meth:`LayerwiseRead.read_regions`).
:meth:`PageStore.put_pages` and :meth:`PageStore.get_pages` take tensors (a page,
or its parts) and move the header through a registered header arena and the
payload directly when it lies in registered memory, else through a staging
buffer. ``python -m bana_sglang.radix_global.bench_store`` measures them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bana_sglang.radix_global.errors import StoreError
from bana_sglang.radix_global.keys import KVLayout, PageHash
from bana_sglang.radix_global.layerwise import LayerwiseRead, as_bytes_view
from bana_sglang.radix_global.mooncake_kv import (
    NOT_FOUND,
    RPC_FAIL,
    UNAVAILABLE,
    MooncakeKV,
    StoreConfig,
    allocation_size,
    describe,
    miss_reason,
    page_key,
)
from bana_sglang.radix_global.page_format import HEADER_SIZE, MAC_PURPOSE, Miss, PageFormat
from bana_sglang.wire import security

logger = logging.getLogger(__name__)


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


class PageStore:
    """Framed, verified KV pages of one :class:`KVLayout` in the Mooncake store.

    Single-threaded use per instance is expected (calls are serialised by a lock).
    """

    def __init__(self, layout: KVLayout, kv: MooncakeKV, mac_key: bytes | None = None):
        self.layout = layout
        self.kv = kv
        if mac_key is None:  # the cluster's (BANA_CLUSTER_SECRET_FILE), or unkeyed
            secret = security.cluster_secret()
            mac_key = security.derive(secret, MAC_PURPOSE) if secret else b""
        self.format = PageFormat(layout, mac_key)
        self._dtype = getattr(torch, layout.dtype)
        self._shape = self.format.shape
        self._payload = self.format.payload_bytes
        cfg = kv.config
        if self._payload > cfg.staging_bytes:
            raise ValueError(
                f"a page ({self._payload} bytes) is larger than the staging buffer "
                f"({cfg.staging_bytes} bytes); raise BANA_STORE_STAGING_BYTES"
            )
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
        """Bytes of one page object: its header and payload."""
        return self.format.object_size

    @property
    def footprint(self) -> int:
        """Bytes one page takes in the store's segment (what the index accounts):
        the object rounded up to the allocator's size class (:func:`allocation_size`)."""
        return allocation_size(self.format.object_size)

    def register(self, tensor: torch.Tensor) -> None:
        """Register a CPU tensor's memory (e.g. a KV pool) so pages inside it move
        without a staging copy. The tensor must outlive this store."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only contiguous CPU tensors can be registered")
        self.kv.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    # -- puts
    def _check_payload(self, payload: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A page payload as its parts: one tensor of the page shape, or tensors of the
        layout's dtype whose concatenation (in order) is the page's bytes."""
        if isinstance(payload, torch.Tensor):
            if payload.dtype != self._dtype or tuple(payload.shape) != self._shape:
                raise ValueError(
                    f"page tensor must be {self.layout.dtype} {self._shape}, "
                    f"got {payload.dtype} {tuple(payload.shape)}"
                )
            return [payload if payload.is_contiguous() else payload.contiguous()]
        parts = [t if t.is_contiguous() else t.contiguous() for t in payload]
        if any(t.dtype != self._dtype for t in parts):
            raise ValueError(f"page parts must be {self.layout.dtype}")
        total = sum(t.numel() * t.element_size() for t in parts)
        if total != self._payload:
            raise ValueError(f"page parts hold {total} bytes, a page is {self._payload}")
        return parts

    def put_pages(
        self, pages: Sequence[PageHash], payloads: Sequence[torch.Tensor | Sequence[torch.Tensor]]
    ) -> PutResult:
        """Store pages in order; stop at the first failure. Never raises for store
        trouble (a wrong shape/dtype is a caller bug and raises ValueError).

        A payload is a page tensor or a list of parts (see :meth:`_check_payload`);
        parts in registered memory (e.g. KV pool slots) are written without a copy."""
        if len(pages) != len(payloads):
            raise ValueError(f"{len(pages)} pages but {len(payloads)} payloads")
        checked = [self._check_payload(t) for t in payloads]
        written = 0
        with self._lock:
            for lo in range(0, len(pages), self._batch):
                hi = min(len(pages), lo + self._batch)
                n, failed = self._put_batch(pages[lo:hi], checked[lo:hi])
                written += n
                if failed is not None:
                    return PutResult(written, failed)
        return PutResult(written, None)

    def put_objects(self, pages: Sequence[PageHash], ptrs: Sequence[int]) -> PutResult:
        """Store pages already framed in registered memory: ``ptrs[i]`` holds page i's
        header and payload, :attr:`object_size` bytes (one slice per page)."""
        if len(pages) != len(ptrs):
            raise ValueError(f"{len(pages)} pages but {len(ptrs)} objects")
        if not pages:
            return PutResult(0, None)
        with self._lock:
            try:
                rcs = self.kv.put_multi(
                    [page_key(p) for p in pages],
                    [[p] for p in ptrs],
                    [[self.object_size]] * len(pages),
                )
            except StoreError as e:
                return PutResult(0, Miss(pages[0], miss_reason(e), str(e)))
        return self.put_result(pages, rcs)

    @staticmethod
    def put_result(pages: Sequence[PageHash], rcs: Sequence[int]) -> PutResult:
        """A batch put's per-page codes as a :class:`PutResult` (written up to the first failure)."""
        for i, rc in enumerate(rcs):
            if rc != 0:
                return PutResult(i, Miss(pages[i], "store_error", f"put: {describe(rc)}"))
        return PutResult(len(pages), None)

    def _registered(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and self.kv.is_registered(
            t.data_ptr(), t.numel() * t.element_size()
        )

    def _payload_ptrs(
        self, page: PageHash, parts: list[torch.Tensor], slot: int
    ) -> tuple[list[int], list[int], bytes]:
        """(pointers, sizes, the page's MAC) of one page's payload for a native put."""
        mac = self.format.mac(page)
        if all(self._registered(t) for t in parts):
            for t in parts:
                mac.update(as_bytes_view(t).numpy())
            sizes = [t.numel() * t.element_size() for t in parts]
            return [t.data_ptr() for t in parts], sizes, mac.digest()
        nbytes = self._payload
        stage = self._staging[slot * nbytes : (slot + 1) * nbytes]
        stage_np = stage.numpy()
        # numpy, not torch: a single-threaded memcpy (torch's copy_ of a small
        # tensor cost ~15 ms under CPU contention on the shared 2-core machine)
        pos = 0
        for t in parts:
            view = as_bytes_view(t.cpu() if t.device.type != "cpu" else t).numpy()
            stage_np[pos : pos + len(view)] = view
            pos += len(view)
        mac.update(stage_np)
        return [stage.data_ptr()], [nbytes], mac.digest()

    def _put_batch(
        self, pages: Sequence[PageHash], payloads: Sequence[list[torch.Tensor]]
    ) -> tuple[int, Miss | None]:
        keys, ptrs, sizes = [], [], []
        for slot, (page, parts) in enumerate(zip(pages, payloads)):
            pptrs, psizes, mac = self._payload_ptrs(page, parts, slot)
            hdr = self.format.header(page, mac)
            hslot = self._headers[slot * HEADER_SIZE : (slot + 1) * HEADER_SIZE]
            self._headers_np[slot * HEADER_SIZE : slot * HEADER_SIZE + len(hdr)] = memoryview(hdr)
            keys.append(page_key(page))
            ptrs.append([hslot.data_ptr(), *pptrs])
            sizes.append([HEADER_SIZE, *psizes])
        try:
            rcs = self.kv.put_multi(keys, ptrs, sizes)
        except StoreError as e:
            return 0, Miss(
                pages[0],
                "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error",
                str(e),
            )
        for i, rc in enumerate(rcs):
            if rc != 0:
                return i, Miss(pages[i], "store_error", f"put: {describe(rc)}")
        return len(pages), None

    # -- gets
    def get_pages(
        self, pages: Sequence[PageHash], out: Sequence[torch.Tensor] | None = None
    ) -> LoadResult:
        """Load pages in order, stopping at the first miss. With ``out``, page i is
        written into ``out[i]`` (which must match the layout) and returned; a
        miss may leave garbage in the ``out`` tensors from the missing page on."""
        if out is not None and len(out) != len(pages):
            raise ValueError(f"{len(pages)} pages but {len(out)} output tensors")
        dests = [self._check_payload(t)[0] for t in out] if out is not None else None
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

    def _get_batch(
        self, pages: Sequence[PageHash], dests: Sequence[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], Miss | None]:
        keys, ptrs, sizes, views, direct = [], [], [], [], []
        for slot, page in enumerate(pages):
            d = dests[slot] if dests else None
            if (
                d is not None
                and d.device.type == "cpu"
                and self.kv.is_registered(d.data_ptr(), self._payload)
            ):
                pptr, view = d.data_ptr(), memoryview(as_bytes_view(d).numpy())
                direct.append(True)
            else:
                stage = self._staging[slot * self._payload : (slot + 1) * self._payload]
                pptr, view = stage.data_ptr(), memoryview(stage.numpy())
                direct.append(False)
            keys.append(page_key(page))
            ptrs.append([self._headers[slot * HEADER_SIZE :].data_ptr(), pptr])
            sizes.append([HEADER_SIZE, self._payload])
            views.append(view)
        try:
            rcs = self.kv.get_multi(keys, ptrs, sizes)
        except StoreError as e:
            return [], Miss(
                pages[0],
                "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error",
                str(e),
            )
        out: list[torch.Tensor] = []
        for slot, (page, rc) in enumerate(zip(pages, rcs)):
            if rc == NOT_FOUND:
                return out, Miss(page, "missing")
            if rc == RPC_FAIL:
                return out, Miss(page, "unavailable", describe(rc))
            if rc < 0:
                return out, self._diagnose(page, rc)
            if rc != self.object_size:
                return out, Miss(
                    page, "size_mismatch", f"object is {rc} bytes, expected {self.object_size}"
                )
            header = self._headers_np[slot * HEADER_SIZE : (slot + 1) * HEADER_SIZE].tobytes()
            miss = self.format.verify(page, header, views[slot])
            if miss is not None:
                return out, miss
            if direct[slot]:
                out.append(dests[slot])  # type: ignore[index]
            else:
                stage = self._staging[slot * self._payload : (slot + 1) * self._payload]
                if dests is not None:
                    dest = dests[slot]
                    if dest.device.type == "cpu":
                        as_bytes_view(dest).numpy()[:] = stage.numpy()
                    else:
                        dest.copy_(stage.view(self._dtype).reshape(self._shape))
                    out.append(dest)
                else:
                    out.append(
                        torch.from_numpy(stage.numpy().copy())
                        .view(self._dtype)
                        .reshape(self._shape)
                    )
        return out, None

    def _diagnose(self, page: PageHash, rc: int) -> Miss:
        """A failed read: an object of another size fails inside Mooncake
        (-600 or -800 depending on the direction), so ask for its size to say why."""
        try:
            size = self.kv.size_of(page_key(page))
        except StoreError as e:
            return Miss(
                page,
                "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error",
                describe(rc),
            )
        if size != self.object_size:
            return Miss(
                page, "size_mismatch", f"object is {size} bytes, expected {self.object_size}"
            )
        return Miss(page, "store_error", describe(rc))

    def layerwise(
        self,
        pages: Sequence[PageHash],
        macs: Sequence[bytes] | None = None,
        *,
        headers_inline: bool = False,
    ) -> LayerwiseRead:
        """A layer-by-layer read of ``pages`` (see :class:`LayerwiseRead`); ``macs``: their
        stored MACs, when their headers were verified already; ``headers_inline``: read
        each header with the first range of layers instead of in a round trip of its own."""
        return LayerwiseRead(self, pages, macs, headers_inline=headers_inline)

    def present(self, pages: Sequence[PageHash]) -> tuple[int, Miss | None]:
        """How many leading ``pages`` the store holds (one round trip to the master, no
        data read), and why it stopped (None: all)."""
        if not pages:
            return 0, None
        try:
            found = self.kv.exists_many([page_key(p) for p in pages])
        except StoreError as e:
            return 0, Miss(pages[0], miss_reason(e), str(e))
        for i, ok in enumerate(found):
            if not ok:
                return i, Miss(pages[i], "missing", "not in the store")
        return len(pages), None

    # -- housekeeping
    def remove(self, pages: Sequence[PageHash], *, force: bool = False) -> list[int]:
        """Native per-page codes (0 removed, -704 absent, -706 leased); raises
        StoreError when the store is unavailable."""
        return self.kv.remove_many([page_key(p) for p in pages], force=force)

    def exists_many(self, pages: Sequence[PageHash]) -> list[bool]:
        return self.kv.exists_many([page_key(p) for p in pages])
