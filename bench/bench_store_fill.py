"""Fill the global store past its capacity, wired as the launcher wires it.

``python -m bench.bench_store_fill`` starts the store's processes (master,
storage, index: :func:`bench.local_store.local_store`, the launcher's command
lines) with a small segment and publishes ``--chains`` chains of
``--pages-per-chain`` pages of an embedded model's page shape through the index
(intent, put, commit: :class:`GlobalKVCache`), each one as a worker's
publisher does; with ``--reads`` every publish is followed by a load of the
chain before it (a reader holds a lease on what it loaded). It prints, for the
end of the run: the pages the index holds against what the segment can hold
(``segment // allocation_size(page)``: Mooncake rounds each allocation up to its
size class), the publishes a put failed in, the indexed pages that are missing
from the store (an index that says "cached" where a load misses), and the
master's allocation failures and own evictions (scraped from its metrics).

No SGLang, no model weights: pages are zeros of the model's shape.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from bana_sglang import _cli, models
from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import KVLayout
from bana_sglang.radix_global.mooncake_kv import StoreConfig
from bana_sglang.radix_global.store import PageStore
from bana_sglang.radix_global.worker_cache import GlobalKVCache
from bench.client import parse_metrics
from bench.local_store import local_store

# the master's counters of puts it found no room for, and of keys it evicted itself
ALLOC_FAILURES = "master_put_start_alloc_failures_total"
EVICTED = "master_evicted_key_count"


def run(args: argparse.Namespace) -> dict:
    spec = models.SPECS[args.model]
    layout = KVLayout(
        f"bench-store-fill-{spec.name}",
        "float32",
        args.page_size,
        spec.num_kv_heads,
        spec.head_dim,
        spec.num_layers,
    )
    n = args.pages_per_chain
    logs = tempfile.TemporaryDirectory(prefix="bench-store-fill-")
    with logs, local_store(args.segment, first_port=args.port, log_dir=Path(logs.name)) as ls:
        assert ls.index is not None
        store = PageStore.connect(layout, StoreConfig(master_addr=ls.master))
        cache = GlobalKVCache(layout, IndexClient(ls.index, timeout_s=5), store, "bench")
        page = torch.zeros(layout.page_shape)
        chains, committed, failed_puts = [], 0, 0
        t0 = time.perf_counter()
        for k in range(args.chains):
            tokens = range(k * 100_000, k * 100_000 + n * args.page_size)
            chain = cache.chain(list(tokens))
            res = cache.publish(chain, [page] * n)
            committed += res.committed
            failed_puts += res.note.startswith("store")
            chains.append(chain)
            if args.reads and k:
                cache.load_prefix(chains[k - 1])
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)
        took = time.perf_counter() - t0
        time.sleep(args.settle_s)  # the index's janitor removes what it evicted
        indexed = [p for ch in chains for p in ch[: cache.index.lookup(ch, touch=False).length]]
        present = store.exists_many(indexed) if indexed else []
        raw = urllib.request.urlopen(f"http://{ls.metrics}/metrics", timeout=10).read()
        master = parse_metrics(raw.decode(), (ALLOC_FAILURES, EVICTED))
        out = {
            "page_bytes": store.object_size,
            "page_footprint": store.footprint,
            "segment_pages": args.segment // store.footprint,
            "offered": args.chains * n,
            "committed": committed,
            "publishes_with_failed_put": failed_puts,
            "indexed": len(indexed),
            "indexed_missing": present.count(False),
            "master_alloc_failures": int(master.get(ALLOC_FAILURES, 0)),
            "master_evicted_keys": int(master.get(EVICTED, 0)),
            "seconds": round(took, 1),
        }
        cache.index.close()
        store.kv.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_store_fill",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="tiny", choices=sorted(models.SPECS), help="page shape")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--segment", type=_cli.segment_size, default=16 << 20, help="segment size")
    p.add_argument("--chains", type=int, default=500)
    p.add_argument("--pages-per-chain", type=int, default=4)
    p.add_argument(
        "--reads",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="load the previous chain after each publish (its pages are leased for a while)",
    )
    p.add_argument("--gap-ms", type=float, default=0.0, help="pause between publishes")
    p.add_argument("--settle-s", type=float, default=3.0, help="wait before counting")
    p.add_argument("--port", type=int, default=33400, help="first port to try")
    args = p.parse_args(argv)
    logging.basicConfig(level="WARNING", format=_cli.LOG_FORMAT)
    out = run(args)
    print(
        f"page {out['page_bytes']} B, {out['page_footprint']} B in the segment; the segment "
        f"holds {out['segment_pages']} pages"
    )
    print(
        f"offered {out['offered']} pages in {out['seconds']} s, committed {out['committed']}, "
        f"publishes with a failed put {out['publishes_with_failed_put']}"
    )
    print(
        f"indexed at the end {out['indexed']} ({out['indexed'] / out['segment_pages']:.2f} of "
        f"the segment), of which missing from the store {out['indexed_missing']}"
    )
    print(
        f"master: allocation failures {out['master_alloc_failures']}, "
        f"keys it evicted itself {out['master_evicted_keys']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
