"""The attention-state merge of KV-block migration: the Triton kernel against
the torch reference, on CUDA, at decode-batch shapes (same run, same tensors).

    python bench/bench_merge.py [--rows 1,64,512] [--heads 32] [--head-dim 128]

Each row: one decode step's merge of a batch of ``rows`` requests (``heads``
query heads of ``head-dim``), float32 and bfloat16; median of 50 timed calls
after 10 warm-ups, CUDA events. Loads ``bana_sglang/kernels/merge.py`` by path (needs only
torch and Triton), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "bana_merge_bench", Path(__file__).resolve().parents[1] / "bana_sglang" / "kernels" / "merge.py"
)
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)


def timed(fn, reps: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3)  # microseconds
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rows", default="1,64,512,4096", help="requests per decode step (comma-separated)"
    )
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("| requests | dtype | torch reference us | Triton us | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|")
    for rows in (int(x) for x in args.rows.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            o_a, o_b = (
                torch.randn(rows, args.heads, args.head_dim, device="cuda").to(dtype)
                for _ in range(2)
            )
            l_a, l_b = (5 * torch.randn(rows, args.heads, device="cuda") for _ in range(2))
            ref = lambda: mg.merge_attention_states([o_a, o_b], [l_a, l_b])  # noqa: E731, B023 (called in this iteration)
            tri = lambda: mg.merge_two_triton(o_a, l_a, o_b, l_b)  # noqa: E731, B023
            diff = (ref().output.float() - tri().output.float()).abs().max().item()
            t_ref, t_tri = timed(ref), timed(tri)
            print(
                f"| {rows} | {str(dtype).split('.')[-1]} | {t_ref:.1f} | {t_tri:.1f} | {t_ref / t_tri:.1f}x | "
                f"{diff:.2e} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
