"""The Triton attention-state merge on CUDA (marked ``gpu``: skipped without CUDA).

Checked against the float64 torch reference and against softmax attention
over the concatenated KV, for random shapes (head dims that are not powers of
two), float32/float16/bfloat16, empty partitions (lse -inf, NaN outputs) and
extreme logits. ``bana_sglang/kernels/merge.py`` is loaded by path, so this file runs
where only torch and Triton are installed.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_spec = importlib.util.spec_from_file_location(
    "bana_merge_under_test",
    Path(__file__).resolve().parents[3] / "bana_sglang" / "kernels" / "merge.py",
)
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over (k, v) in float64: (output [T, H, D], lse [T, H]); empty k -> NaN, -inf."""
    if k.shape[0] == 0:
        t, h, _ = q.shape
        return torch.full(
            (t, h, v.shape[-1]), float("nan"), dtype=torch.float64, device=q.device
        ), torch.full((t, h), float("-inf"), dtype=torch.float64, device=q.device)
    logits = torch.einsum("thd,khd->thk", q.double(), k.double()) * scale
    lse = torch.logsumexp(logits, dim=-1)
    return torch.einsum("thk,khd->thd", torch.softmax(logits, dim=-1), v.double()), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "t,h,d,kv,cut",
    [
        (1, 1, 1, 2, 1),
        (7, 4, 80, 50, 13),
        (33, 8, 128, 300, 299),
        (5, 2, 96, 40, 0),
        (64, 32, 64, 17, 17),
    ],
)
def test_merged_halves_equal_attention_over_the_whole_kv(dtype, t, h, d, kv, cut):
    gen = torch.Generator(device="cuda").manual_seed(t * 1000 + kv)
    q, k, v = (torch.randn(n, h, d, device="cuda", generator=gen) for n in (t, kv, kv))
    scale = 1 / math.sqrt(d)
    o_a, l_a = partial(q, k[:cut], v[:cut], scale)
    o_b, l_b = partial(q, k[cut:], v[cut:], scale)
    got = mg.merge_two(o_a.to(dtype), l_a.float(), o_b.to(dtype), l_b.float())
    want_o, want_l = partial(q, k, v, scale)
    assert got.output.dtype == dtype and got.lse.dtype == torch.float32
    torch.testing.assert_close(
        got.output.double(), want_o, atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4
    )
    torch.testing.assert_close(got.lse.double(), want_l, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_the_torch_reference_on_random_states(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for t, h, d in [(1, 1, 16), (129, 5, 72), (1024, 40, 128)]:
        o_a, o_b = (torch.randn(t, h, d, device="cuda", generator=gen).to(dtype) for _ in range(2))
        l_a, l_b = (20 * torch.randn(t, h, device="cuda", generator=gen) for _ in range(2))
        got = mg.merge_two_triton(o_a, l_a, o_b, l_b)
        ref = mg.merge_attention_states(
            [o_a.double().cpu(), o_b.double().cpu()], [l_a.double().cpu(), l_b.double().cpu()]
        )
        torch.testing.assert_close(
            got.output.double().cpu(), ref.output, atol=TOL[dtype], rtol=TOL[dtype]
        )
        torch.testing.assert_close(got.lse.double().cpu(), ref.lse, atol=1e-5, rtol=1e-6)


def test_empty_partitions_and_extreme_logits():
    t, h, d = 6, 3, 40
    o_a = torch.randn(t, h, d, device="cuda")
    o_b = torch.full((t, h, d), float("nan"), device="cuda")  # never read where its lse is -inf
    l_a = torch.tensor([[0.0, 80.0, -80.0]] * t, device="cuda")
    l_b = torch.full((t, h), float("-inf"), device="cuda")
    got = mg.merge_two_triton(o_a, l_a, o_b, l_b)
    assert torch.equal(got.output, o_a) and torch.equal(got.lse, l_a)  # the other part, exactly
    both = mg.merge_two_triton(o_b, l_b, o_b, l_b)
    assert torch.equal(both.output, torch.zeros_like(o_a)) and torch.isneginf(both.lse).all()
    big = torch.full((t, h), 3e38, device="cuda")
    for la, lb in [(big, big - 1), (-big, -big + 2), (big, torch.full_like(big, -3e38))]:
        got = mg.merge_two_triton(o_a, la, -o_a, lb)
        ref = mg.merge_attention_states(
            [o_a.double().cpu(), -o_a.double().cpu()], [la.double().cpu(), lb.double().cpu()]
        )
        assert torch.isfinite(got.output).all() and torch.isfinite(got.lse).all()
        torch.testing.assert_close(got.output.double().cpu(), ref.output, atol=1e-5, rtol=1e-5)


def test_bad_input_is_refused_with_the_reason():
    o = torch.randn(2, 3, 4, device="cuda")
    with pytest.raises(ValueError, match="shape mismatch"):
        mg.merge_two_triton(
            o, torch.zeros(2, 3, device="cuda"), o, torch.zeros(3, 2, device="cuda")
        )
    with pytest.raises(ValueError, match="same CUDA device"):
        mg.merge_two_triton(o, torch.zeros(2, 3, device="cuda"), o.cpu(), torch.zeros(2, 3))
