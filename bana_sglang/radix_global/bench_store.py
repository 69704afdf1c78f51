"""Smoke bandwidth of PageStore against a running master + storage process.

``python -m bana_sglang.radix_global.bench_store --master HOST:PORT`` puts and
gets pages of 64 KiB .. 4 MiB (framed, verified) through both payload paths
(staging copy and registered zero-copy) in batches, and prints MB/s. Figures on
a shared 2-core machine are noisy (2-5x run to run): compare ratios within one
run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.radix_global.mooncake_kv import StoreConfig
from bana_sglang.radix_global.store import PageStore


def _layout(page_bytes: int) -> KVLayout:
    # float32, 1 layer, K+V, 16 tokens, 8 heads: head_dim sets the size
    head_dim = page_bytes // (4 * 2 * 16 * 8)
    return KVLayout(
        f"bench-{page_bytes}",
        "float32",
        page_size=16,
        num_kv_heads=8,
        head_dim=head_dim,
        num_layers=1,
    )


def run(
    master: str, sizes: Sequence[int], total_bytes: int, batch: int
) -> list[tuple[str, int, float, float]]:
    rows = []
    for page_bytes in sizes:
        layout = _layout(page_bytes)
        cfg = StoreConfig(
            master_addr=master,
            staging_bytes=max(32 << 20, batch * layout.page_nbytes),
            max_batch=batch,
        )
        store = PageStore.connect(layout, cfg)
        n = max(batch, total_bytes // layout.page_nbytes)
        pool = torch.randn((2 * n, *layout.page_shape))
        for path in ("warmup", "staging", "registered"):
            if path == "registered":
                store.register(pool)
            offset = 0 if path != "registered" else n
            chain = page_chain(range(offset * 16, (offset + n) * 16), layout, salt=path)
            src = [pool[i] for i in range(n)]
            t0 = time.perf_counter()
            for lo in range(0, n, batch):
                res = store.put_pages(chain[lo : lo + batch], src[lo : lo + batch])
                assert res.failed is None, res.failed
            put_s = time.perf_counter() - t0
            dst = [pool[n + i] for i in range(n)] if path == "registered" else None
            t0 = time.perf_counter()
            for lo in range(0, n, batch):
                res = store.get_pages(
                    chain[lo : lo + batch], None if dst is None else dst[lo : lo + batch]
                )
                assert res.miss is None, res.miss
            get_s = time.perf_counter() - t0
            mb = n * layout.page_nbytes / 1e6
            if path != "warmup":  # the first pass pays connection setup and first-touch faults
                rows.append((path, layout.page_nbytes, mb / put_s, mb / get_s))
            store.remove(chain, force=True)
        store.kv.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.radix_global.bench_store", description=__doc__
    )
    p.add_argument("--master", required=True)
    p.add_argument("--total-mb", type=int, default=16, help="bytes moved per size and path")
    p.add_argument("--batch", type=int, default=8, help="pages per native batch call")
    a = p.parse_args(argv)
    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    print(f"{'path':<11}{'page':>9}{'put MB/s':>10}{'get MB/s':>10}")
    for path, nbytes, put, get in run(a.master, sizes, a.total_mb << 20, a.batch):
        print(f"{path:<11}{nbytes >> 10:>7}KB{put:>10.0f}{get:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
