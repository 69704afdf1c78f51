"""Page keys: deterministic across processes, chained, namespaced by layout and salt."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bana_sglang.radix_global import keys
from bana_sglang.radix_global.keys import KVLayout, is_page_hash, namespaced, page_chain

L = KVLayout(
    "models/tiny@abc123", "bfloat16", page_size=4, num_kv_heads=2, head_dim=16, num_layers=3
)


def test_full_pages_only_and_chained():
    tokens = list(range(11))
    chain = page_chain(tokens, L)
    assert len(chain) == 2 and all(is_page_hash(h) for h in chain)
    assert page_chain(tokens[:8], L) == chain  # the partial page adds nothing
    assert page_chain(tokens[:4], L) == chain[:1]
    # page 1 depends on page 0: same page-1 tokens after other page-0 tokens differ
    assert page_chain([9, 9, 9, 9] + tokens[4:8], L)[1] != chain[1]
    # continuing a chain from its last hash equals hashing the whole prefix
    assert page_chain(tokens[4:8], L, prior=chain[0]) == chain[1:]
    import torch  # local: the rest of this file needs no torch

    assert page_chain(torch.tensor(tokens), L) == chain  # tensors hash like lists


def test_namespace_separates_models_layouts_ranks_and_salts():
    tokens = list(range(8))
    base = page_chain(tokens, L)
    variants = [
        KVLayout("models/tiny@def456", "bfloat16", 4, 2, 16, 3),
        KVLayout("models/tiny@abc123", "float16", 4, 2, 16, 3),
        KVLayout("models/tiny@abc123", "bfloat16", 4, 1, 16, 3),
        KVLayout("models/tiny@abc123", "bfloat16", 4, 2, 8, 3),
        KVLayout("models/tiny@abc123", "bfloat16", 4, 2, 16, 2),
        KVLayout("models/tiny@abc123", "bfloat16", 4, 2, 16, 3, tp_rank=1, tp_size=2),
    ]
    seen = {base[0]}
    for v in variants:
        assert v.digest != L.digest
        h = page_chain(tokens, v)[0]
        assert h not in seen
        seen.add(h)
    assert page_chain(tokens, L, salt="user-a") != page_chain(tokens, L, salt="user-b")
    assert page_chain(tokens, L, salt="") != base  # an empty salt is still a salt
    assert namespaced("abc", L) != namespaced("abc", variants[0])
    assert namespaced("abc", L) == namespaced("abc", L)


def test_deterministic_across_processes():
    code = (
        "from bana_sglang.radix_global.keys import KVLayout, page_chain;"
        "L = KVLayout('models/tiny@abc123', 'bfloat16', 4, 2, 16, 3);"
        "print(L.digest, *page_chain(range(12), L, salt='s'))"
    )
    outs = {
        tuple(
            subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONHASHSEED": seed},
            ).stdout.split()
        )
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    (out,) = outs
    assert list(out) == [L.digest, *page_chain(range(12), L, salt="s")]


def test_layout_validation():
    assert KVLayout("m", "torch.float32", 1, 1, 1, 1).dtype == "float32"
    assert L.page_shape == (3, 2, 4, 2, 16) and L.page_nbytes == 3 * 2 * 4 * 2 * 16 * 2
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("m", "float12", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="tp_rank"):
        KVLayout("m", "float32", 1, 1, 1, 1, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="page_size"):
        KVLayout("m", "float32", 0, 1, 1, 1)


@pytest.mark.parametrize("salt", [None, "", "tenant-a", b"\x00raw"])
def test_a_chain_is_namespaced_as_each_page_is_alone_and_as_the_hash_of_its_parts(salt):
    """The namespace's hashing is done once per layout and salt, then copied per
    page: the result is the same hash of the length-prefixed parts as before, and
    a cached state is never advanced by a call."""
    layout = KVLayout("m", "float32", page_size=16, num_kv_heads=2, head_dim=8, num_layers=2)
    other = KVLayout("m", "float32", page_size=16, num_kv_heads=2, head_dim=8, num_layers=3)
    foreign = [f"{i:064x}" for i in range(5)]
    want = [
        keys._h(keys._PAGE_TAG, keys.namespace(layout, salt), b"foreign", h.encode()).hex()
        for h in foreign
    ]
    for _ in range(2):  # twice: a second call starts from the same state
        assert keys.namespaced_chain(foreign, layout, salt) == want
        assert [namespaced(h, layout, salt) for h in foreign] == want
    assert keys.namespaced_chain(foreign, other, salt) != want
    assert keys.namespaced_chain([], layout, salt) == []
