"""The stored page format: header fields, the keyed MAC over fields and payload (pure)."""

from __future__ import annotations

import os

import pytest

from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.radix_global.page_format import HEADER_SIZE, PageFormat

LAYOUT = KVLayout("format-test", "float32", page_size=4, num_kv_heads=2, head_dim=8, num_layers=2)
PAGE = page_chain(range(8), LAYOUT)[0]
OTHER = page_chain(range(8), LAYOUT)[1]


def framed(fmt: PageFormat, payload: bytes, page=PAGE) -> bytes:
    mac = fmt.mac(page)
    mac.update(payload)
    return fmt.header(page, mac.digest())


@pytest.fixture
def payload() -> bytes:
    return os.urandom(LAYOUT.page_nbytes)


def test_a_page_verifies_under_its_key_and_layer_by_layer(payload):
    fmt = PageFormat(LAYOUT, b"k" * 32)
    header = framed(fmt, payload)
    assert len(header) <= HEADER_SIZE and fmt.keyed
    assert fmt.verify(PAGE, header, memoryview(payload)) is None
    # fed in layer-sized pieces, the running MAC is the whole payload's
    miss, stored = fmt.verify_header(PAGE, header)
    running = fmt.mac(PAGE)
    half = len(payload) // LAYOUT.num_layers
    for lo in range(0, len(payload), half):
        running.update(payload[lo : lo + half])
    assert miss is None and fmt.payload_ok(stored, running.digest())


def test_another_key_a_flipped_byte_or_another_page_is_refused(payload):
    fmt = PageFormat(LAYOUT, b"k" * 32)
    forged = framed(PageFormat(LAYOUT, b"x" * 32), payload)
    assert fmt.verify(PAGE, forged, memoryview(payload)).reason == "checksum"
    unkeyed = framed(PageFormat(LAYOUT), payload)
    assert fmt.verify(PAGE, unkeyed, memoryview(payload)).reason == "checksum"
    header = framed(fmt, payload)
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 1
    assert fmt.verify(PAGE, header, memoryview(bytes(bad))).reason == "checksum"
    assert fmt.verify(OTHER, header, memoryview(payload)).reason == "page_mismatch"
    mangled = bytearray(header)
    mangled[9] ^= 1
    assert fmt.verify(PAGE, bytes(mangled), memoryview(payload)).reason == "bad_header"
    other_layout = PageFormat(KVLayout("another", "float32", 4, 2, 8, 2), b"k" * 32)
    assert other_layout.verify(PAGE, header, memoryview(payload)).reason == "layout_mismatch"


def test_the_mac_is_truncated_keyed_blake3_of_fields_and_payload(payload):
    """The MAC is keyed BLAKE3 (the reference implementation's bindings), its key from
    BLAKE3's own key derivation, nothing home-made: recomputed here from its
    definition, it matches what the format stores; unkeyed, it is plain BLAKE3."""
    import blake3

    key = b"k" * 32
    fmt = PageFormat(LAYOUT, key)
    header = framed(fmt, payload)
    _, stored = fmt.verify_header(PAGE, header)
    fields = header[: header.index(stored)]
    mac_key = blake3.blake3(
        key, derive_key_context="bana_sglang 2026-12-07 KV page MAC v4"
    ).digest()
    assert stored == blake3.blake3(fields + payload, key=mac_key).digest(16)
    unkeyed = PageFormat(LAYOUT)
    _, plain = unkeyed.verify_header(PAGE, framed(unkeyed, payload))
    assert plain == blake3.blake3(fields + payload).digest(16)
