"""The linker loads SGLang's page hashing at start-up, not in the first request's lookup."""

from __future__ import annotations

from sglang.srt.mem_cache.cpp_utils import native_hash as native

from bana_sglang.radix_global.linker import _warm_page_hashing


def test_warm_page_hashing_loads_sglangs_native_hash() -> None:
    native._load_native_hash_module.cache_clear()
    _warm_page_hashing(16)
    assert native._load_native_hash_module.cache_info().currsize == 1
