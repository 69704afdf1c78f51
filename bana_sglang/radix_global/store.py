"""KV pages in the Mooncake store: framed, verified puts, gets and layer-wise reads.

:class:`PageStore` stores each page of one layout as one object (the
:mod:`~bana_sglang.radix_global.page_format` header, then the payload) through
:class:`~bana_sglang.radix_global.mooncake_kv.MooncakeKV` (the binding: native
codes -> ``StoreError``, outage gate), and verifies every header field and the
page MAC (HMAC-SHA256 under the cluster secret) on load. :class:`LayerwiseRead`
reads ranges of layers of many pages (the SGLang linker's loads).

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
from bana_sglang.radix_global.mooncake_kv import (
    NOT_FOUND,
    RPC_FAIL,
    UNAVAILABLE,
    MooncakeKV,
    StoreConfig,
    describe,
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


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


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
        """Bytes one page takes in the store (what the index accounts)."""
        return self.format.object_size

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
                return PutResult(0, Miss(pages[0], _reason(e), str(e)))
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
                mac.update(_as_bytes_view(t).numpy())
            sizes = [t.numel() * t.element_size() for t in parts]
            return [t.data_ptr() for t in parts], sizes, mac.digest()
        nbytes = self._payload
        stage = self._staging[slot * nbytes : (slot + 1) * nbytes]
        stage_np = stage.numpy()
        # numpy, not torch: a single-threaded memcpy (torch's copy_ of a small
        # tensor cost ~15 ms under CPU contention on the shared 2-core machine)
        pos = 0
        for t in parts:
            view = _as_bytes_view(t.cpu() if t.device.type != "cpu" else t).numpy()
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
                pptr, view = d.data_ptr(), memoryview(_as_bytes_view(d).numpy())
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
                        _as_bytes_view(dest).numpy()[:] = stage.numpy()
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
            return 0, Miss(pages[0], _reason(e), str(e))
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


class LayerwiseRead:
    """Read ranges of layers of many pages into scattered destinations, verifying the
    pages as they land.

    The payload is layer-major (``page_shape`` starts with the layer), so layers
    ``[lo, hi)`` of a page are one contiguous byte range: :meth:`read_regions` reads
    that range of every page in one batched ranged get (Mooncake
    ``batch_get_into_multi_buffer_ranges`` inside a get session). Verification:

    - :meth:`start` opens the session and verifies every header field except the
      MAC (layout, page hash, dtype, shape, length), keeping the leading pages
      whose headers verify: what follows a bad or missing page is not read. Pages
      whose headers were verified before (``macs`` given) only get a session,
      and so do pages whose headers come with the first range of layers
      (``headers_inline``: :meth:`read_regions` with ``lo == 0`` then reads the
      header in front of the layers, the caller hands it to :meth:`check_header`,
      and no separate header round trip is paid);
    - the caller feeds every landed byte to its page's running MAC, in payload
      order (:meth:`feed`; :meth:`read_layer` does both for tensor destinations);
    - :meth:`finish` compares the running MACs with the headers'. A mismatch
      means the bytes already handed to compute were wrong: the caller must
      discard what was computed from them (the SGLang linker fails the load,
      and SGLang drops that request's output).

    Never raises for store trouble: methods return a :class:`Miss`.
    """

    def __init__(
        self,
        store: PageStore,
        pages: Sequence[PageHash],
        macs: Sequence[bytes] | None = None,
        *,
        headers_inline: bool = False,
    ):
        self.store = store
        self.pages = list(pages)
        self._keys = [page_key(p) for p in self.pages]
        if macs is not None and len(macs) != len(self.pages):
            raise ValueError(f"{len(self.pages)} pages but {len(macs)} MACs")
        self._verified = macs is not None
        self.headers_inline = headers_inline and not self._verified
        # stored MAC per page (b"" until its header is checked, when headers come inline)
        self._macs: list[bytes] = (
            list(macs)
            if macs is not None
            else [b""] * len(self.pages)
            if self.headers_inline
            else []
        )
        self._running: list = []  # the MAC computed over what landed, per page
        self._session = False
        layout = store.layout
        self.layer_bytes = store._payload // layout.num_layers

    @property
    def macs(self) -> list[bytes]:
        """The stored MACs of :attr:`pages` (after :meth:`start`)."""
        return list(self._macs)

    def start(self) -> Miss | None:
        """Open the session and verify headers; ``self.pages`` shrinks to the
        verified prefix, and the returned miss says why it stopped (None: all)."""
        st = self.store
        if not self.pages:
            return None
        try:
            codes = st.kv.get_session_start(self._keys)
        except StoreError as e:
            first = self.pages[0]
            self.pages, self._keys, self._macs = [], [], []
            return Miss(first, _reason(e), str(e))
        self._session = True
        miss: Miss | None = None
        keep = len(self.pages)
        for i, rc in enumerate(codes):
            if rc != 0:
                keep = i
                miss = Miss(
                    self.pages[i],
                    "missing" if rc == NOT_FOUND else "store_error",
                    f"session: {describe(rc)}",
                )
                break
        if not self._verified and not self.headers_inline:
            keep, miss = self._read_headers(keep, miss)
        self._truncate(keep)
        return miss

    def check_header(self, i: int, header) -> Miss | None:
        """Verify page i's header (read inline with its first layers) and keep its MAC."""
        bad, mac = self.store.format.verify_header(self.pages[i], bytes(header))
        if bad is None:
            self._macs[i] = mac
        return bad

    def _read_headers(self, keep: int, miss: Miss | None) -> tuple[int, Miss | None]:
        st = self.store
        with st._lock:
            for lo in range(0, keep, st._batch):
                hi = min(keep, lo + st._batch)
                keys = self._keys[lo:hi]
                ptrs = [[st._headers[i * HEADER_SIZE :].data_ptr()] for i in range(hi - lo)]
                try:
                    rcs = st.kv.get_ranges(
                        keys, ptrs, [[HEADER_SIZE]] * len(keys), [[0]] * len(keys)
                    )
                except StoreError as e:
                    return lo, Miss(self.pages[lo], _reason(e), str(e))
                for i, rc in enumerate(rcs):
                    page = self.pages[lo + i]
                    if rc != HEADER_SIZE:
                        bad = Miss(
                            page,
                            "missing" if rc == NOT_FOUND else "store_error",
                            f"header read: {rc}",
                        )
                    else:
                        header = st._headers_np[i * HEADER_SIZE : (i + 1) * HEADER_SIZE].tobytes()
                        bad, mac = st.format.verify_header(page, header)
                    if bad is not None:
                        return lo + i, bad
                    self._macs.append(mac)
        return keep, miss

    def _truncate(self, keep: int) -> None:
        if keep < len(self.pages):
            dropped = self._keys[keep:]
            self.pages, self._keys = self.pages[:keep], self._keys[:keep]
            self._macs = self._macs[:keep]
            if self._session:
                self.store.kv.get_session_end(dropped)
        self._running = [self.store.format.mac(p) for p in self.pages]

    def header_first(self, lo: int) -> bool:
        """Whether a read of layers from ``lo`` carries the pages' headers in front."""
        return self.headers_inline and lo == 0

    def read_regions(
        self, lo: int, hi: int, regions: Sequence[Sequence[tuple[int, int]]], start: int = 0
    ) -> Miss | None:
        """Read layers ``[lo, hi)`` of pages ``start .. start + len(regions) - 1``: page
        ``start + i``'s bytes land in ``regions[i]``, a list of ``(pointer, nbytes)`` in
        registered memory, filled in order (headed by the page's header when
        :meth:`header_first`). The caller feeds the payload to :meth:`feed`."""
        if start < 0 or start + len(regions) > len(self.pages):
            raise ValueError(
                f"pages {start}..{start + len(regions) - 1} of a read of {len(self.pages)}"
            )
        if not regions:
            return None
        head = self.header_first(lo)
        want = (hi - lo) * self.layer_bytes + (HEADER_SIZE if head else 0)
        off = 0 if head else HEADER_SIZE + lo * self.layer_bytes
        ptrs, sizes, offsets = [], [], []
        for parts in regions:
            pos, p_ptrs, p_sizes, p_offs = off, [], [], []
            for ptr, n in parts:
                p_ptrs.append(ptr)
                p_sizes.append(n)
                p_offs.append(pos)
                pos += n
            if pos - off != want:
                raise ValueError(
                    f"destinations hold {pos - off} bytes, layers {lo}:{hi} of a page are {want}"
                )
            ptrs.append(p_ptrs)
            sizes.append(p_sizes)
            offsets.append(p_offs)
        keys = self._keys[start : start + len(regions)]
        try:
            rcs = self.store.kv.get_ranges(keys, ptrs, sizes, offsets)
        except StoreError as e:
            return Miss(self.pages[start], _reason(e), str(e))
        for i, rc in enumerate(rcs):
            if rc != want:
                return Miss(
                    self.pages[start + i],
                    "missing" if rc == NOT_FOUND else "store_error",
                    f"layers {lo}:{hi} read: {rc if rc < 0 else f'{rc} bytes'}",
                )
        return None

    def feed(self, i: int, data) -> None:
        """Extend page i's running MAC with the next landed bytes (a buffer)."""
        self._running[i].update(data)

    def read_layer(self, layer: int, dests: Sequence[Sequence[torch.Tensor]]) -> Miss | None:
        """Read layer ``layer`` of every page into CPU tensors: page i's bytes land in
        ``dests[i]`` (registered, filled in order, ``layer_bytes`` in total) and are
        fed to its MAC (a read with its headers inline takes them elsewhere: use
        :meth:`read_regions`)."""
        if self.headers_inline:
            raise ValueError("read_layer reads payload only; this read wants its headers inline")
        if len(dests) != len(self.pages):
            raise ValueError(f"{len(self.pages)} pages but {len(dests)} destinations")
        regions = [[(t.data_ptr(), t.numel() * t.element_size()) for t in parts] for parts in dests]
        miss = self.read_regions(layer, layer + 1, regions)
        if miss is not None:
            return miss
        for i, parts in enumerate(dests):
            for t in parts:
                self.feed(i, _as_bytes_view(t).numpy())
        return None

    def close(self) -> None:
        """End the read session (idempotent)."""
        if self._session:
            self.store.kv.get_session_end(self._keys)
            self._session = False

    def finish(self) -> Miss | None:
        """Close the session; the first page whose MAC does not match what landed."""
        self.close()
        for page, want, got in zip(self.pages, self._macs, self._running):
            if not want:
                return Miss(page, "bad_header", "its header was never checked")
            if not self.store.format.payload_ok(want, got.digest()):
                return Miss(page, "checksum", "page MAC mismatch after a layer-wise read")
        return None


def _reason(e: StoreError) -> str:
    return "unavailable" if e.code in (UNAVAILABLE, RPC_FAIL) else "store_error"
