"""Unit tests of the CPU attention kernels and the attention-state merge (fast, no server).

Every kernel result is checked against the dense float64 reference
(``reference_attention``) over random shapes, prefix offsets, GQA ratios and
KV pools whose slot ids are scattered (as a paged pool hands them out).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bana_sglang.kernels import cpu_attention as ca
from bana_sglang.kernels import merge as mg

ATOL = 2e-5  # float32 SDPA vs float64 reference, unit-variance inputs


def _pool(
    n_slots: int, hkv: int, d: int, dv: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(n_slots, hkv, d, generator=gen)
    v = torch.randn(n_slots, hkv, dv, generator=gen)
    return k, v


def _scattered_slots(n: int, n_slots: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct slot ids in random order (a fragmented paged pool)."""
    return torch.randperm(n_slots, generator=gen)[:n]


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 37), (5, 5), (3, 40), (17, 64), (64, 64)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("need_lse", [False, True])
def test_attend_matches_reference(q_len, kv_len, hq, hkv, need_lse):
    gen = torch.Generator().manual_seed(q_len * 1000 + kv_len * 10 + hq + hkv)
    d, dv = 16, 16
    q = torch.randn(q_len, hq, d, generator=gen)
    k, v = _pool(kv_len, hkv, d, dv, gen)
    scale = 1 / math.sqrt(d)
    res = ca.attend(q, k, v, scale=scale, q_offset=kv_len - q_len, need_lse=need_lse)
    ref = ca.reference_attention(q, k, v, scale=scale, q_offset=kv_len - q_len)
    assert res.output.shape == (q_len, hq, dv)
    torch.testing.assert_close(res.output.double(), ref.output, atol=ATOL, rtol=0)
    if need_lse:
        torch.testing.assert_close(res.lse.double(), ref.lse, atol=ATOL, rtol=0)
    else:
        assert res.lse is None


def test_attend_non_causal_and_empty():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=gen)
    k, v = _pool(9, 2, 8, 8, gen)
    res = ca.attend(q, k, v, scale=0.3, q_offset=None, need_lse=True)
    ref = ca.reference_attention(q, k, v, scale=0.3, q_offset=None)
    torch.testing.assert_close(res.output.double(), ref.output, atol=ATOL, rtol=0)
    empty = ca.attend(q, k[:0], v[:0], scale=0.3, q_offset=None, need_lse=True)
    assert torch.all(empty.output == 0) and torch.all(empty.lse == float("-inf"))


@settings(max_examples=40, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=5),
    gqa=st.sampled_from([(4, 4), (4, 2), (8, 2), (4, 1)]),
    need_lse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_extend_batch_mixing_cached_and_uncached(reqs, gqa, need_lse, seed):
    """A batch of (prefix_len, extend_len) requests over one scattered pool."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = gqa
    d = 8
    n_slots = sum(p + e for p, e in reqs) + 16
    k_cache, v_cache = _pool(n_slots, hkv, d, d, gen)
    perm = torch.randperm(n_slots, generator=gen)
    kv_indices, ext_lens, start = [], [], 0
    for p, e in reqs:
        kv_indices.append(perm[start : start + p + e])
        ext_lens.append(e)
        start += p + e
    q = torch.randn(sum(ext_lens), hq, d, generator=gen)
    res = ca.extend_attention(
        q, k_cache, v_cache, kv_indices, ext_lens, scale=0.35, need_lse=need_lse
    )
    row = 0
    for slots, (p, e) in zip(kv_indices, reqs):
        ref = ca.reference_attention(
            q[row : row + e], k_cache[slots], v_cache[slots], scale=0.35, q_offset=p
        )
        torch.testing.assert_close(
            res.output[row : row + e].double(), ref.output, atol=ATOL, rtol=0
        )
        if need_lse:
            torch.testing.assert_close(res.lse[row : row + e].double(), ref.lse, atol=ATOL, rtol=0)
        row += e


def test_extend_rejects_inconsistent_lengths():
    q = torch.randn(4, 2, 8)
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    with pytest.raises(ValueError):
        ca.extend_attention(q, k, v, [torch.arange(5)], [3], scale=1.0)
    with pytest.raises(ValueError):
        ca.extend_attention(q, k, v, [torch.arange(3)], [4], scale=1.0)


@pytest.mark.parametrize("lens", [[1], [7], [5, 5, 5], [3, 30, 12, 1], [40, 2], [700, 20]])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("need_lse", [False, True])
def test_decode_matches_reference(lens, hq, hkv, need_lse):
    gen = torch.Generator().manual_seed(sum(lens) + hq)
    d = 16
    n_slots = sum(lens) + 8
    k_cache, v_cache = _pool(n_slots, hkv, d, d, gen)
    perm = torch.randperm(n_slots, generator=gen)
    table = torch.zeros(
        len(lens), max(lens) + 3, dtype=torch.long
    )  # wider than needed, padded with slot 0
    start = 0
    for b, n in enumerate(lens):
        table[b, :n] = perm[start : start + n]
        start += n
    q = torch.randn(len(lens), hq, d, generator=gen)
    res = ca.decode_attention(q, k_cache, v_cache, table, lens, scale=0.25, need_lse=need_lse)
    for b, n in enumerate(lens):
        slots = table[b, :n]
        ref = ca.reference_attention(
            q[b : b + 1], k_cache[slots], v_cache[slots], scale=0.25, q_offset=None
        )
        torch.testing.assert_close(res.output[b : b + 1].double(), ref.output, atol=ATOL, rtol=0)
        if need_lse:
            torch.testing.assert_close(res.lse[b : b + 1].double(), ref.lse, atol=ATOL, rtol=0)


def test_decode_path_choice_follows_the_measured_costs():
    """Many short requests: one padded call; mixed or long lengths: one call per request
    (bench/bench_decode_paths.py times both on each of these batches)."""
    assert ca.decode_pads([64] * 32) and ca.decode_pads([128] * 64)
    assert ca.decode_pads([5, 5, 5]) and ca.decode_pads(
        [3, 30, 12, 1]
    )  # the tests above cover both paths
    assert not ca.decode_pads([478, 472, 163, 1466, 1700, 676, 1111])  # the trace's first burst
    assert not ca.decode_pads([128, 128, 256, 256, 384, 512, 1024, 1408])
    assert not ca.decode_pads([700, 20]) and not ca.decode_pads([9])


def test_decode_kv_dtype_cast_and_bf16():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 8, generator=gen).bfloat16()
    k, v = _pool(10, 2, 8, 8, gen)
    table = torch.arange(10).view(2, 5)
    res = ca.decode_attention(q, k, v, table, [5, 5], scale=0.3)
    assert res.output.dtype == torch.bfloat16
    ref = ca.reference_attention(q[:1], k[:5], v[:5], scale=0.3, q_offset=None)
    torch.testing.assert_close(res.output[:1].double(), ref.output, atol=3e-2, rtol=0)


# --- merge -----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    q_len=st.integers(1, 6),
    kv_len=st.integers(1, 30),
    n_parts=st.integers(1, 4),
    hq_hkv=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    seed=st.integers(0, 2**16),
    causal=st.booleans(),
)
def test_merge_of_partitions_equals_whole(q_len, kv_len, n_parts, hq_hkv, seed, causal):
    """Attention over KV split into contiguous partitions, merged, equals attention over all of it."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = hq_hkv
    q = torch.randn(q_len, hq, 8, generator=gen)
    k, v = _pool(kv_len, hkv, 8, 8, gen)
    cuts = sorted(torch.randint(0, kv_len + 1, (n_parts - 1,), generator=gen).tolist())
    bounds = [0, *cuts, kv_len]
    q_offset = max(kv_len - q_len, 0) if causal else None
    outs, lses = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        # Partition [lo, hi): causal offset relative to its start; a negative one (or an empty
        # partition) hides every key from some queries: their lse is -inf.
        off = None if q_offset is None else q_offset - lo
        part = ca.reference_attention(q, k[lo:hi], v[lo:hi], scale=0.4, q_offset=off)
        empty = torch.isneginf(part.lse).unsqueeze(-1)
        outs.append(torch.where(empty, float("nan"), part.output))  # must never be read
        lses.append(part.lse)
    merged = mg.merge_attention_states(outs, lses)
    whole = ca.reference_attention(q, k, v, scale=0.4, q_offset=q_offset)
    torch.testing.assert_close(merged.output, whole.output, atol=1e-10, rtol=0)
    torch.testing.assert_close(merged.lse, whole.lse, atol=1e-10, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    big=st.floats(min_value=1e3, max_value=3e38),
    sign=st.sampled_from([1.0, -1.0]),
    seed=st.integers(0, 2**16),
)
def test_merge_extreme_logits(big, sign, seed):
    gen = torch.Generator().manual_seed(seed)
    o_a, o_b = torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    lse_a = torch.full((3, 2), sign * big)
    lse_b = torch.full((3, 2), sign * big)
    merged = mg.merge_two(o_a, lse_a, o_b, lse_b)
    assert torch.isfinite(merged.output).all()
    torch.testing.assert_close(merged.output, (o_a + o_b) / 2, atol=1e-5, rtol=1e-5)
    # A partition far below the other contributes (numerically) nothing.
    dominated = mg.merge_two(o_a, torch.zeros(3, 2), o_b, torch.full((3, 2), -big))
    torch.testing.assert_close(dominated.output, o_a, atol=1e-6, rtol=0)
    assert torch.isfinite(dominated.lse).all()


def test_merge_empty_partitions():
    o = torch.randn(2, 3, 4)
    nan = torch.full_like(o, float("nan"))
    ninf = torch.full((2, 3), float("-inf"))
    one = mg.merge_two(o, torch.zeros(2, 3), nan, ninf)
    torch.testing.assert_close(one.output, o)
    torch.testing.assert_close(one.lse, torch.zeros(2, 3))
    none = mg.merge_two(nan, ninf, nan, ninf)
    assert torch.all(none.output == 0) and torch.all(none.lse == float("-inf"))


def test_merge_rejects_bad_shapes():
    with pytest.raises(ValueError):
        mg.merge_attention_states([], [])
    with pytest.raises(ValueError):
        mg.merge_attention_states([torch.zeros(2, 3, 4)], [torch.zeros(2, 4)])


# --- selection and registration ----------------------------------------------


@pytest.mark.parametrize(
    "env,expected", [(None, "bana_cpu"), ("bana", "bana_cpu"), ("stock", "torch_native")]
)
def test_cpu_default_backend_and_off_switch(monkeypatch, env, expected):
    from bana_sglang import compat

    monkeypatch.setenv("BANA_DEVICE", "cpu")
    if env is None:
        monkeypatch.delenv("BANA_CPU_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("BANA_CPU_ATTENTION", env)
    args = compat.server_args("null")
    assert args[args.index("--attention-backend") + 1] == expected
    # An explicit flag always wins over the default.
    assert "--attention-backend" not in compat.server_args(
        "null", user_args=["--attention-backend", "x"]
    )


def test_off_switch_rejects_unknown_value(monkeypatch):
    from bana_sglang import compat

    monkeypatch.setenv("BANA_DEVICE", "cpu")
    monkeypatch.setenv("BANA_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="BANA_CPU_ATTENTION"):
        compat.server_args("null")


def test_registered_name_passes_sglang_argparse():
    """After the plugin's registration, SGLang's own CLI parser accepts the name
    and the model runner's registry can build it."""
    import argparse

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ServerArgs

    from bana_sglang.attention import BACKEND_NAME, register_backend

    register_backend()
    assert register_backend() is False  # idempotent
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--attention-backend", BACKEND_NAME])
    assert ns.attention_backend == BACKEND_NAME
    assert BACKEND_NAME in ATTENTION_BACKENDS
