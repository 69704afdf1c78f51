"""Partial decode attention over a page list, with its LSE, and the exact merge with a KV
host's part: the GPU half of KV-block migration. On the CPU the torch reference runs,
and the Triton kernel runs through Triton's interpreter; the ``gpu`` tests run the
compiled kernel on CUDA. Every result is held to full attention in float64."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch

from bana_sglang.attention.partial import decode_with_remote
from bana_sglang.kernels import merge
from bana_sglang.kernels import paged_decode as pd

B, HQ, HKV, D = 4, 8, 2, 16
SCALE = 1 / math.sqrt(D)


def setup(seed: int = 0, dtype=torch.float32, device="cpu", slots: int = 512, width: int = 96):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, HKV, D, generator=g).to(dtype).to(device)
    v = torch.randn(slots, HKV, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, HQ, D, generator=g).to(dtype).to(device)
    req_to_token = torch.randperm(slots, generator=g)[: 5 * width].view(5, width).to(device)
    return q, k, v, req_to_token


def full_attention(q, k, v, slots_per_row):
    """float64 attention of each query over its own slots (the reference of everything)."""
    out, lses = [], []
    for i, slots in enumerate(slots_per_row):
        kk = k[slots].double().repeat_interleave(HQ // HKV, dim=1)
        vv = v[slots].double().repeat_interleave(HQ // HKV, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * SCALE
        lses.append(torch.logsumexp(s, 1))
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(s, 1), vv))
    return torch.stack(out), torch.stack(lses)


def test_the_page_list_leaves_each_lent_range_out():
    rtt = torch.arange(40).view(4, 10)
    indptr, indices = pd.page_list(rtt, [3, 1, 0], [10, 0, 7], {0: (2, 6), 2: (0, 4)})
    assert indptr.tolist() == [0, 6, 6, 9]
    assert indices.tolist() == [30, 31, 36, 37, 38, 39, 4, 5, 6]
    indptr, indices = pd.page_list(rtt, [], [])
    assert indptr.tolist() == [0] and indices.numel() == 0


def test_the_reference_is_full_attention_with_a_natural_log_lse():
    q, k, v, rtt = setup()
    rows, lens = [0, 2, 4, 1], [96, 33, 1, 70]
    indptr, indices = pd.page_list(rtt, rows, lens)
    o, lse = pd.decode_attention_reference(q, k, v, indptr, indices, SCALE)
    want_o, want_lse = full_attention(q, k, v, [rtt[r, :n] for r, n in zip(rows, lens)])
    assert torch.allclose(o.double(), want_o, atol=1e-5) and lse.dtype == torch.float32
    assert torch.allclose(lse.double(), want_lse, atol=1e-4)
    # an empty list contributes nothing: zeros and -inf
    indptr, indices = pd.page_list(rtt, [0], [0])
    o, lse = pd.decode_attention_reference(q[:1], k, v, indptr, indices, SCALE)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_a_base_2_lse_must_be_converted_before_the_merge():
    q, k, v, rtt = setup(1)
    a, b = rtt[0, :40], rtt[0, 40:90]
    ia = (torch.tensor([0, 40]), a)
    ib = (torch.tensor([0, 50]), b)
    o_a, lse_a = pd.decode_attention_reference(q[:1], k, v, *ia, SCALE)
    o_b, lse_b = pd.decode_attention_reference(q[:1], k, v, *ib, SCALE)
    want, _ = full_attention(q, k, v, [rtt[0, :90]])
    right = merge.merge_two(o_a, lse_a, o_b, lse_b).output
    assert torch.allclose(right.double(), want[:1], atol=1e-5)
    base2 = lse_b / math.log(2.0)  # what a FlashInfer decode would have returned
    wrong = merge.merge_two(o_a, lse_a, o_b, base2).output
    assert not torch.allclose(wrong.double(), want[:1], atol=1e-3)
    fixed = merge.merge_two(o_a, lse_a, o_b, pd.lse_from_base2(base2)).output
    assert torch.allclose(fixed.double(), want[:1], atol=1e-5)


class _Host:
    """A KV host in-process: holds the lent ranges as segments, answers with the host kernel."""

    def __init__(self, k, v, rtt, rows, remote):
        self.segments = {
            b: torch.stack(
                [k[rtt[rows[b], s.start : s.stop]], v[rtt[rows[b], s.start : s.stop]]], 1
            ).unsqueeze(1)  # [tokens, layers=1, 2, Hkv, D]
            for b, s in remote.items()
        }
        self.failed: set[int] = set()

    def attend_begin(self, layer, q, remote, scale):
        picked = sorted(b for b in remote if b not in self.failed)
        return picked, q[picked], scale

    def attend_end(self, pending):
        picked, q, scale = pending
        o, lse = pd.host_partial_attention(q, [self.segments[b] for b in picked], 0, scale)
        return {b: (o[i], lse[i]) for i, b in enumerate(picked)}


def test_a_decode_step_with_lent_ranges_equals_full_attention():
    q, k, v, rtt = setup(2)
    rows, lens = [1, 3, 0, 2], [96, 80, 64, 17]
    remote = {0: SimpleNamespace(start=16, stop=64), 2: SimpleNamespace(start=0, stop=48)}
    host = _Host(k, v, rtt, rows, remote)
    o = decode_with_remote(q, k, v, rtt, rows, lens, remote, layer=0, scale=SCALE, lender=host)
    want, _ = full_attention(q, k, v, [rtt[r, :n] for r, n in zip(rows, lens)])
    assert torch.allclose(o.double(), want, atol=1e-5)
    # a host that failed a row: that row keeps the local part only (the lender ends it)
    host.failed = {2}
    o = decode_with_remote(q, k, v, rtt, rows, lens, remote, layer=0, scale=SCALE, lender=host)
    local, _ = full_attention(q[2:3], k, v, [rtt[0, 48:64]])
    assert torch.allclose(o[2].double(), local[0], atol=1e-5)
    assert torch.allclose(o[0].double(), want[0], atol=1e-5)


_INTERPRETED = """
import torch
from bana_sglang.kernels import paged_decode as pd
g = torch.Generator().manual_seed(3)
B, HQ, HKV, D = 4, 8, 2, 16
k, v = torch.randn(512, HKV, D, generator=g), torch.randn(512, HKV, D, generator=g)
q = torch.randn(B, HQ, D, generator=g)
rtt = torch.randperm(512, generator=g)[:480].view(5, 96)
indptr, indices = pd.page_list(rtt, [2, 0, 4, 1], [96, 0, 65, 3], {0: (32, 64)})
out, lse = pd._decode_triton(q, k, v, indptr, indices, 0.25)
ref_o, ref_lse = pd.decode_attention_reference(q, k, v, indptr, indices, 0.25)
assert torch.allclose(out, ref_o, atol=1e-5), (out - ref_o).abs().max()
assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))
fin = torch.isfinite(ref_lse)
assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], ref_lse[fin], atol=1e-5)
print("interpreted kernel ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_triton_kernel_in_the_interpreter_equals_the_reference():
    """The kernel's logic on this CPU, through Triton's interpreter (a process of its own:
    TRITON_INTERPRET must be set before Triton loads); the device check compiles it."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "interpreted kernel ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_compiled_kernel_and_the_merge_equal_full_attention(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, rtt = setup(4, dtype, "cuda")
    rows, lens = [1, 3, 0, 2], [96, 80, 64, 17]
    remote = {0: SimpleNamespace(start=16, stop=64), 2: SimpleNamespace(start=0, stop=48)}
    o = decode_with_remote(
        q,
        k,
        v,
        rtt,
        rows,
        lens,
        remote,
        layer=0,
        scale=SCALE,
        lender=_Host(k, v, rtt, rows, remote),
    )
    want, _ = full_attention(
        q.cpu(), k.cpu(), v.cpu(), [rtt[r, :n].cpu() for r, n in zip(rows, lens)]
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (o.double().cpu() - want).norm() / want.norm()
    assert err < tol, err
