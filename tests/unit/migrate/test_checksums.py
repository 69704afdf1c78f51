"""The checksums of migrated weights: crc32 on the host, sum32 where the tensor lives
(a GPU's tensors never leave it to be checked); both sides name the one they use."""

from __future__ import annotations

import msgspec
import pytest
import torch

from bana_sglang.migrate.transfer import checksum, checksum_for, crc32, sum32
from bana_sglang.wire import agent as m


def test_sum32_sees_a_flipped_bit_a_swapped_pair_and_a_lost_byte():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1000, generator=g)
    base = sum32(t)
    assert base == sum32(t.clone()) and 0 <= base < 2**32
    flipped = t.clone().view(torch.int32)
    flipped[123] ^= 1 << 17
    assert sum32(flipped.view(torch.float32)) != base
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert sum32(swapped) != base
    raw = t.view(torch.uint8)
    assert sum32(raw[:-1]) != sum32(raw)  # a lost trailing byte (padding is not a hiding place)
    # the same bytes give the same value whatever the dtype they are seen as
    assert sum32(t.view(torch.int16)) == base
    # past one chunk of words the sums carry on exactly
    big = torch.randint(0, 2**31 - 1, (3 * 1000 + 7,), generator=g, dtype=torch.int32)
    import bana_sglang.migrate.transfer as tr

    old = tr._CHUNK_WORDS
    try:
        tr._CHUNK_WORDS = 1000
        chunked = sum32(big)
    finally:
        tr._CHUNK_WORDS = old
    assert chunked == sum32(big)


def test_each_device_gets_its_checksum_and_the_wire_names_it():
    t = torch.arange(10, dtype=torch.float32)
    assert checksum_for(t) == "crc32" and checksum(t, "crc32") == crc32(t)
    with pytest.raises(ValueError, match="unknown checksum"):
        checksum(t, "md5")
    desc = m.TensorDesc(
        layer=0,
        name="w",
        dtype="float32",
        shape=[10],
        addr=1,
        nbytes=40,
        crc32=sum32(t),
        checksum="sum32",
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(desc), type=m.TensorDesc)
    assert back.checksum == "sum32" and back.crc32 == sum32(t)
    # a peer that names no checksum sends crc32 (the wire before device checksums)
    old = {k: v for k, v in msgspec.structs.asdict(desc).items() if k != "checksum"}
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=m.TensorDesc).checksum == "crc32"
    )


@pytest.mark.gpu
def test_sum32_is_computed_on_the_gpu_and_equals_the_cpus():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(1)
    t = torch.randn(4096, 257, generator=g).to(torch.bfloat16)
    d = t.cuda()
    assert checksum_for(d) == "sum32"
    assert sum32(d) == sum32(t)
