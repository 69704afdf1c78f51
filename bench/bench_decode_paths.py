"""The CPU decode kernel's two paths, timed on the same tensors, and the choice between them.

    python -m bench.bench_decode_paths [--steps 40] [--layers 8] [--threads 1]

``bana_sglang.kernels.cpu_attention.decode_attention`` runs a decode batch either as one
padded call (every request's keys gathered to the longest length, a mask for the
shorter ones) or as one call per request. For each batch below (the small
model's heads, a 64k-slot pool in scattered 16-token pages, the lengths growing
by one each step as in a real decode), it times ``--steps`` steps of ``--layers``
layers on each path and on the kernel's own choice. It then fits the cost model
the kernel chooses by (microseconds per layer: the padded call per padded key,
the loop per key and per request) and prints the fitted values next to the ones
in the kernel. Each row's ``choice / best`` is the kernel's choice against the
faster of the two paths in this run; 1.00 means it chose the faster one.
"""

from __future__ import annotations

import argparse
import time

import torch

from bana_sglang.kernels import cpu_attention as ca

HQ, HKV, D = 8, 4, 64  # models.py SPECS['small']
POOL = 65536
PAGE = 16
CASES = {
    "first burst (7, 163-1700)": [478, 472, 163, 1466, 1700, 676, 1111],
    "calibration (8, 128-1408)": [128, 128, 256, 256, 384, 512, 1024, 1408],
    "equal (7 x 866)": [866] * 7,
    "long pair (100, 3000)": [100, 3000],
    "4 x 2000": [2000] * 4,
    "16 x 300": [300] * 16,
    "32 x 64": [64] * 32,
    "32 mixed (32-128)": [32, 64, 96, 128] * 8,
    "64 x 128": [128] * 64,
}


def _table(lens: list[int], extra: int, pages: torch.Tensor) -> torch.Tensor:
    table = torch.zeros(len(lens), max(lens) + extra, dtype=torch.long)
    off = 0
    for b, n in enumerate(lens):
        npg = (n + extra + PAGE - 1) // PAGE
        slots = (pages[off : off + npg].unsqueeze(1) * PAGE + torch.arange(PAGE)).flatten()
        table[b, : n + extra] = slots[: n + extra]
        off += npg
    return table


def _step_ms(lens, mode, k, v, pages, steps, layers) -> float:
    """Mean milliseconds per decode step (``layers`` calls) over ``steps`` growing steps."""
    q = torch.randn(len(lens), HQ, D)
    table = _table(lens, steps, pages)
    costs = (ca.PAD_KEY_US, ca.LOOP_KEY_US, ca.LOOP_REQUEST_US)
    if mode == "pad":
        ca.PAD_KEY_US, ca.LOOP_KEY_US, ca.LOOP_REQUEST_US = 0.0, 1.0, 1.0
    elif mode == "loop":
        ca.PAD_KEY_US = float("inf")
    try:
        cur = [n + 1 for n in lens]
        ca.decode_attention(q, k, v, table, cur, scale=D**-0.5)  # first call: allocations
        t0 = time.perf_counter()
        for i in range(steps):
            cur = [n + i for n in lens]
            for _ in range(layers):
                ca.decode_attention(q, k, v, table, cur, scale=D**-0.5)
        return (time.perf_counter() - t0) / steps * 1e3
    finally:
        ca.PAD_KEY_US, ca.LOOP_KEY_US, ca.LOOP_REQUEST_US = costs


def _fit(rows, layers, steps):
    """Least squares: padded = a * B * max_len; loop = b * sum + c * B (per layer, us)."""

    def mid(lens):
        return [n + steps // 2 for n in lens]

    pad_x = [len(r["lens"]) * max(mid(r["lens"])) for r in rows]
    pad_y = [r["pad"] * 1e3 / layers for r in rows]
    a = sum(x * y for x, y in zip(pad_x, pad_y)) / sum(x * x for x in pad_x)
    X = torch.tensor(
        [[float(sum(mid(r["lens"]))), float(len(r["lens"]))] for r in rows], dtype=torch.float64
    )
    y = torch.tensor([r["loop"] * 1e3 / layers for r in rows], dtype=torch.float64)
    b, c = torch.linalg.lstsq(X, y.unsqueeze(1)).solution.flatten().tolist()
    return a, b, c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--steps", type=int, default=40, help="decode steps per batch (lengths grow by one)"
    )
    ap.add_argument("--layers", type=int, default=8, help="attention calls per step")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (the launcher gives each worker 1)"
    )
    args = ap.parse_args(argv)
    if min(args.steps, args.layers, args.threads) < 1:
        ap.error("--steps, --layers and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    k, v = torch.randn(POOL, HKV, D), torch.randn(POOL, HKV, D)
    pages = torch.randperm(POOL // PAGE)
    rows = []
    print(
        f"{'batch':28} {'padded ms':>10} {'loop ms':>8} {'choice':>7} {'choice ms':>10} {'choice / best':>14}"
    )
    for name, lens in CASES.items():
        r = {
            "lens": lens,
            **{
                m: _step_ms(lens, m, k, v, pages, args.steps, args.layers)
                for m in ("pad", "loop", "auto")
            },
        }
        rows.append(r)
        chose = "padded" if ca.decode_pads([n + args.steps // 2 for n in lens]) else "loop"
        print(
            f"{name:28} {r['pad']:10.1f} {r['loop']:8.1f} {chose:>7} {r['auto']:10.1f} "
            f"{r['auto'] / min(r['pad'], r['loop']):14.2f}"
        )
    a, b, c = _fit(rows, args.layers, args.steps)
    print(
        f"\nfitted (us per layer): padded {a:.3f} per padded key; loop {b:.3f} per key + {c:.1f} per request"
    )
    print(
        f"kernel's:              padded {ca.PAD_KEY_US:.3f} per padded key; loop {ca.LOOP_KEY_US:.3f} per key + "
        f"{ca.LOOP_REQUEST_US:.1f} per request"
    )
    worst = max(r["auto"] / min(r["pad"], r["loop"]) for r in rows)
    print(f"worst choice / best over the batches: {worst:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
