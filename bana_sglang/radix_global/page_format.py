"""The stored form of a KV page: a fixed header, then the payload.

Every object the global store holds under a page key is :data:`HEADER_SIZE`
bytes of header (magic, format version, header size, layout digest, page hash,
dtype, shape, payload length, the page's MAC, then a CRC32 over all of these)
followed by the payload: the page tensor's bytes, layer-major, so layer ``l``
of a page is one contiguous byte range. :class:`PageFormat` packs the headers
of one :class:`~bana_sglang.radix_global.keys.KVLayout` and verifies what a read
returned; a check that fails is a :class:`Miss` naming what did not match.

The MAC is keyed BLAKE3 (the ``blake3`` package, the reference
implementation's bindings), truncated to 16 bytes, over the header's fields
and the payload. Its key comes from the cluster secret: ``wire.security.derive``
(purpose ``bana-kv-page``) and then BLAKE3's own key derivation
(:data:`MAC_CONTEXT`): whoever can write to the Mooncake store but does not hold
the secret cannot make a page that verifies. Without a key (no cluster secret)
it is plain BLAKE3, an integrity check only. Keyed BLAKE3 rather than
HMAC-SHA256 or keyed BLAKE2b because every page loaded or published is hashed
once, and a load's MAC checks were its largest part: on the 2-core test VM (SHA
and AVX-512 instructions) over 256 KiB pages BLAKE3 ran at 6.1 GB/s, OpenSSL's
HMAC-SHA256 at 1.6 GB/s, ``hashlib.blake2b`` at 0.7 GB/s. Like HMAC it needs no
nonce and is safe to use for any number of pages under one key. It is computed
incrementally (:meth:`PageFormat.mac` returns the running MAC), so a
layer-by-layer read verifies the whole payload once its last layer has landed.
The header's CRC32 only catches a torn or mangled header early (``bad_header``);
it protects nothing.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import hmac
import struct
import zlib
from typing import NamedTuple

import blake3

from bana_sglang.radix_global.keys import HASH_BYTES, KVLayout, PageHash

MAGIC = b"BKVP"
FORMAT_VERSION = 4  # 1: a payload CRC32; 2: keyed BLAKE2b; 3: HMAC-SHA256
_MAX_DIMS = 8
MAC_BYTES = 16
MAC_PURPOSE = "bana-kv-page"  # the key's purpose (wire.security.derive)
# BLAKE3's key-derivation context: the MAC key is derive_key(MAC_CONTEXT, key material)
MAC_CONTEXT = "bana_sglang 2026-12-07 KV page MAC v4"
# magic, version, header size, layout digest, page hash, dtype name, ndim, 8 dims,
# payload length: the fields the MAC covers; then the MAC, then a CRC32 over all of it.
_FIELDS = struct.Struct(f"<4sHH{HASH_BYTES}s{HASH_BYTES}s16sB{_MAX_DIMS}QQ")
_MAC = struct.Struct(f"<{MAC_BYTES}s")
_HDR_CRC = struct.Struct("<I")
HEADER_SIZE = 192  # fixed; room left for later fields, keeps the payload 64-byte aligned
assert _FIELDS.size + _MAC.size + _HDR_CRC.size <= HEADER_SIZE


class Miss(NamedTuple):
    """A load that found nothing usable. ``reason``: missing, unavailable,
    layout_mismatch, page_mismatch, shape_mismatch, size_mismatch, checksum,
    bad_header, store_error."""

    page: PageHash
    reason: str
    detail: str = ""


class PageMac:
    """A page's running MAC: ``update`` with the payload's bytes in order, then ``digest``
    (:data:`MAC_BYTES` bytes). ``key``: 32 bytes (keyed BLAKE3) or ``None`` (plain)."""

    __slots__ = ("_h",)

    def __init__(self, key: bytes | None, fields: bytes):
        self._h = blake3.blake3(fields, key=key) if key else blake3.blake3(fields)

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest(MAC_BYTES)


def mac_key(material: bytes) -> bytes | None:
    """The 32-byte BLAKE3 key of the pages' MAC from ``material`` (the secret's
    ``bana-kv-page`` key; any length), or None (unkeyed) for ``b""``."""
    if not material:
        return None
    return blake3.blake3(material, derive_key_context=MAC_CONTEXT).digest()


class PageFormat:
    """Headers of one layout's pages: :meth:`mac` starts a page's MAC, :meth:`header`
    packs, :meth:`verify_header` and :meth:`verify` check. ``key``: the MAC's key
    material (:func:`mac_key`; ``b""``: unkeyed)."""

    def __init__(self, layout: KVLayout, key: bytes = b""):
        self.layout = layout
        self._key = mac_key(key)
        self.shape = layout.page_shape
        self.payload_bytes = layout.page_nbytes
        self._digest = bytes.fromhex(layout.digest)
        self._dtype_field = layout.dtype.encode("ascii").ljust(16, b"\0")

    @property
    def object_size(self) -> int:
        """Bytes one stored page takes: header and payload."""
        return HEADER_SIZE + self.payload_bytes

    @property
    def keyed(self) -> bool:
        return bool(self._key)

    def _fields(self, page: PageHash) -> bytes:
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return _FIELDS.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            self._digest,
            bytes.fromhex(page),
            self._dtype_field,
            len(self.shape),
            *dims,
            self.payload_bytes,
        )

    def mac(self, page: PageHash) -> PageMac:
        """``page``'s running MAC, its header's fields already in: ``update`` it with the
        payload's bytes in order (whole, or layer by layer), then :meth:`header` or
        :meth:`payload_ok` with its ``digest()``."""
        return PageMac(self._key, self._fields(page))

    def header(self, page: PageHash, mac: bytes) -> bytes:
        """The header of ``page`` whose payload gave ``mac`` (``self.mac(page)...digest()``)."""
        body = self._fields(page) + _MAC.pack(mac)
        return body + _HDR_CRC.pack(zlib.crc32(body))

    @staticmethod
    def payload_ok(stored_mac: bytes, computed: bytes) -> bool:
        """The stored MAC equals the one computed over what was read (constant time)."""
        return hmac.compare_digest(stored_mac, computed)

    def verify_header(self, page: PageHash, header: bytes) -> tuple[Miss | None, bytes]:
        """Every header field but the MAC; (miss, the stored MAC)."""
        size = _FIELDS.size + _MAC.size
        body = header[:size]
        (crc,) = _HDR_CRC.unpack_from(header, size)
        if zlib.crc32(body) != crc:
            return Miss(page, "bad_header", "header checksum mismatch"), b""
        (magic, version, hsize, digest, phash, dtype, ndim, *rest) = _FIELDS.unpack_from(body)
        dims, length = rest[:_MAX_DIMS], rest[_MAX_DIMS]
        (stored_mac,) = _MAC.unpack_from(body, _FIELDS.size)
        if magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_SIZE:
            return Miss(
                page, "bad_header", f"magic {magic!r} version {version} header {hsize}"
            ), b""
        if digest != self._digest:
            return Miss(page, "layout_mismatch", f"stored layout {digest.hex()}"), b""
        if phash != bytes.fromhex(page):
            return Miss(page, "page_mismatch", f"stored page {phash.hex()}"), b""
        if dtype != self._dtype_field or tuple(dims[:ndim]) != self.shape:
            return Miss(
                page, "shape_mismatch", f"{dtype.rstrip(bytes(1)).decode()} {dims[:ndim]}"
            ), b""
        if length != self.payload_bytes:
            return Miss(
                page, "size_mismatch", f"stored {length} bytes, expected {self.payload_bytes}"
            ), b""
        return None, stored_mac

    def verify(self, page: PageHash, header: bytes, payload: memoryview) -> Miss | None:
        """The header and the page's MAC over header fields and payload."""
        miss, stored = self.verify_header(page, header)
        if miss is not None:
            return miss
        if len(payload) != self.payload_bytes:
            return Miss(
                page, "size_mismatch", f"read {len(payload)} bytes, expected {self.payload_bytes}"
            )
        h = self.mac(page)
        h.update(payload)
        if not self.payload_ok(stored, h.digest()):
            return Miss(page, "checksum", "page MAC mismatch (corrupt, or written without the key)")
        return None
