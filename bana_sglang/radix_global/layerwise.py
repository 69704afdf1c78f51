"""Layer-wise reads of many pages from the store, verified as they land.

:class:`LayerwiseRead` is what the SGLang linker's loads use (see
:mod:`bana_sglang.radix_global.loader`); :meth:`PageStore.layerwise
<bana_sglang.radix_global.store.PageStore.layerwise>` opens one. Its contract is
in the class doc; the store module's invariants (a load returns the stored
bytes or a miss, never wrong data, never an exception) hold here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from bana_sglang.radix_global.errors import StoreError
from bana_sglang.radix_global.keys import PageHash
from bana_sglang.radix_global.mooncake_kv import NOT_FOUND, describe, miss_reason, page_key
from bana_sglang.radix_global.page_format import HEADER_SIZE, Miss

if TYPE_CHECKING:
    from bana_sglang.radix_global.store import PageStore


def as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 view (a copy only if it is not contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def code_miss(page: PageHash, rc: int, detail: str) -> Miss:
    """The miss of a Mooncake read that returned ``rc`` for ``page`` (not its size)."""
    return Miss(page, "missing" if rc == NOT_FOUND else "store_error", detail)


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
    def keys(self) -> list[str]:
        """The store keys of :attr:`pages`."""
        return list(self._keys)

    @property
    def object_size(self) -> int:
        """A page's whole object: header and payload."""
        return self.store.object_size

    @property
    def macs(self) -> list[bytes]:
        """The stored MACs of :attr:`pages` (after :meth:`start`)."""
        return list(self._macs)

    def start(self, *, session: bool = True) -> Miss | None:
        """Open the session and verify headers; ``self.pages`` shrinks to the
        verified prefix, and the returned miss says why it stopped (None: all).

        ``session=False`` (a read whose headers come inline or whose MACs are given)
        asks nothing of the store yet: a whole-page read through the storage process
        needs no session, and :meth:`read_regions` opens one when it is first called
        (a missing page is then its miss)."""
        if not self.pages:
            return None
        if not session:
            if not (self._verified or self.headers_inline):
                raise ValueError("a read without a session takes its headers inline or its MACs")
            self._truncate(len(self.pages))
            return None
        keep, miss = self._open_session()
        if not self._session:  # the store did not answer: nothing is kept
            self.pages, self._keys, self._macs = [], [], []
            return miss
        if not self._verified and not self.headers_inline:
            keep, miss = self._read_headers(keep, miss)
        self._truncate(keep)
        return miss

    def _open_session(self) -> tuple[int, Miss | None]:
        """Open the read session over every page: (how many leading pages the store
        holds, the miss of the first it does not). A store that does not answer opens
        no session."""
        try:
            codes = self.store.kv.get_session_start(self._keys)
        except StoreError as e:
            return 0, Miss(self.pages[0], miss_reason(e), str(e))
        self._session = True
        for i, rc in enumerate(codes):
            if rc != 0:
                return i, code_miss(self.pages[i], rc, f"session: {describe(rc)}")
        return len(self.pages), None

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
                    return lo, Miss(self.pages[lo], miss_reason(e), str(e))
                for i, rc in enumerate(rcs):
                    page = self.pages[lo + i]
                    if rc != HEADER_SIZE:
                        bad = code_miss(page, rc, f"header read: {rc}")
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
        if not self._session:
            _, miss = self._open_session()
            if miss is not None:
                return miss
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
            return Miss(self.pages[start], miss_reason(e), str(e))
        for i, rc in enumerate(rcs):
            if rc != want:
                return code_miss(
                    self.pages[start + i],
                    rc,
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
                self.feed(i, as_bytes_view(t).numpy())
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
