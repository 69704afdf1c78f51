"""The stored form of a KV page: a fixed header, then the payload.

Every object the global store holds under a page key is :data:`HEADER_SIZE`
bytes of header (magic, format version, header size, layout digest, page hash,
dtype, shape, payload length, payload CRC32, then a CRC32 over all of these)
followed by the payload: the page tensor's bytes, layer-major, so layer ``l``
of a page is one contiguous byte range. :class:`PageFormat` packs the headers
of one :class:`~bana_sglang.radix_global.keys.KVLayout` and verifies what a read
returned; a check that fails is a :class:`Miss` naming what did not match.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from bana_sglang.radix_global.keys import HASH_BYTES, KVLayout, PageHash

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


class PageFormat:
    """Headers of one layout's pages: :meth:`header` packs, :meth:`verify_header`
    and :meth:`verify` check."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.shape = layout.page_shape
        self.payload_bytes = layout.page_nbytes
        self._digest = bytes.fromhex(layout.digest)
        self._dtype_field = layout.dtype.encode("ascii").ljust(16, b"\0")

    @property
    def object_size(self) -> int:
        """Bytes one stored page takes: header and payload."""
        return HEADER_SIZE + self.payload_bytes

    def header(self, page: PageHash, payload_crc: int) -> bytes:
        """The header of ``page`` whose payload has CRC32 ``payload_crc``."""
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        body = _HDR.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            self._digest,
            bytes.fromhex(page),
            self._dtype_field,
            len(self.shape),
            *dims,
            self.payload_bytes,
            payload_crc,
        )
        return body + _HDR_CRC.pack(zlib.crc32(body))

    def verify_header(self, page: PageHash, header: bytes) -> tuple[Miss | None, int]:
        """Every header field but the payload checksum; (miss, stored payload CRC32)."""
        body = header[: _HDR.size]
        (crc,) = _HDR_CRC.unpack_from(header, _HDR.size)
        if zlib.crc32(body) != crc:
            return Miss(page, "bad_header", "header checksum mismatch"), 0
        (magic, version, hsize, digest, phash, dtype, ndim, *rest) = _HDR.unpack(body)
        dims, length, pcrc = rest[:_MAX_DIMS], rest[_MAX_DIMS], rest[_MAX_DIMS + 1]
        if magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_SIZE:
            return Miss(page, "bad_header", f"magic {magic!r} version {version} header {hsize}"), 0
        if digest != self._digest:
            return Miss(page, "layout_mismatch", f"stored layout {digest.hex()}"), 0
        if phash != bytes.fromhex(page):
            return Miss(page, "page_mismatch", f"stored page {phash.hex()}"), 0
        if dtype != self._dtype_field or tuple(dims[:ndim]) != self.shape:
            return Miss(
                page, "shape_mismatch", f"{dtype.rstrip(bytes(1)).decode()} {dims[:ndim]}"
            ), 0
        if length != self.payload_bytes:
            return Miss(
                page, "size_mismatch", f"stored {length} bytes, expected {self.payload_bytes}"
            ), 0
        return None, pcrc

    def verify(self, page: PageHash, header: bytes, payload: memoryview) -> Miss | None:
        """The header and the payload's checksum."""
        miss, pcrc = self.verify_header(page, header)
        if miss is not None:
            return miss
        if len(payload) != self.payload_bytes:
            return Miss(
                page, "size_mismatch", f"read {len(payload)} bytes, expected {self.payload_bytes}"
            )
        if zlib.crc32(payload) != pcrc:
            return Miss(page, "checksum", "payload checksum mismatch")
        return None
