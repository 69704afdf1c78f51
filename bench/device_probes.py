"""Probes of the project's GPU data paths, for ``scripts/device_check.sh`` (no SGLang needed).

``python -m bench.device_probes --out probes.jsonl [--only a,c,d,s]`` runs, each
writing one JSON record per measurement (``probe``, ``ok``, the numbers), and
skipping cleanly (``skipped``: the reason) without CUDA:

- **a, Mooncake with device memory**: a store (master and storage process) on
  127.0.0.1; pages put from GPU memory and from pinned host memory, got back
  into the other, through buffers registered with Mooncake; bytes equal, and
  GB/s against a plain torch copy of the same bytes;
- **c, publish ordering**: a kernel on a "forward" stream writes a page's rows
  long after the page is offered to the linker's :class:`Publisher` with the
  forward's event (SGLang's ``record_offload_ready``); the published page must
  hold the finished rows, never a half-written page, every time;
- **d, partial attention with LSE**: the decode kernel over a page list with a
  lent range left out, and the merge with the rest, on paged decode shapes
  (B 1-256, 32 query heads, 8 KV heads, head dim 128, context 4k-32k, bf16):
  error against float64 full attention, the LSE's base (natural), time per layer;
- **s, weight staging**: a layer's worth of GPU weights read from one Mooncake
  transfer engine into another's GPU memory, checked with the device checksum
  (``sum32``) on both sides and byte for byte; GB/s and the checksum's time.

The store's load paths (probe b of the check) are :mod:`bench.bench_store_paths`
with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("bench.device_probes")


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    torch.cuda.synchronize()


# ---------------------------------------------------------------------- a
def probe_mooncake_device_memory(emit, port: int) -> None:
    from bana_sglang.radix_global.mooncake_kv import MooncakeKV, StoreConfig
    from bench.local_store import local_store

    page, n = 256 << 10, 128  # 128 pages of 256 KB: 32 MB
    with local_store(1 << 30, index=False, first_port=port) as ls:
        kv = MooncakeKV(StoreConfig(master_addr=ls.master))
        assert kv.connect(), "the store did not set up"
        hbm = torch.randint(0, 255, (2, n * page), dtype=torch.uint8, device="cuda")
        pinned = torch.zeros((2, n * page), dtype=torch.uint8).pin_memory()
        for t in (hbm, pinned):
            kv.register(t.data_ptr(), t.numel())
        pinned[0].copy_(hbm[0].cpu())
        for src, dst, name in (
            (hbm, pinned, "gpu->store->host"),
            (pinned, hbm, "host->store->gpu"),
        ):
            keys = [f"probe/{name}/{i}-{time.time()}" for i in range(n)]
            t0 = time.perf_counter()
            rcs = kv.put_multi(
                keys, [[src[0].data_ptr() + i * page] for i in range(n)], [[page]] * n
            )
            put_s = time.perf_counter() - t0
            assert all(rc == 0 for rc in rcs), rcs[:4]
            t0 = time.perf_counter()
            rcs = kv.get_multi(
                keys, [[dst[1].data_ptr() + i * page] for i in range(n)], [[page]] * n
            )
            get_s = time.perf_counter() - t0
            assert all(rc == page for rc in rcs), rcs[:4]
            _sync()
            equal = bool(torch.equal(dst[1].cpu(), src[0].cpu()))
            kv.remove_many(keys, force=True)
            t0 = time.perf_counter()
            dst[1].copy_(src[0], non_blocking=True)
            _sync()
            copy_s = time.perf_counter() - t0
            mb = n * page / 1e6
            emit(
                probe="a",
                what=name,
                ok=equal,
                mb=mb,
                put_gbps=mb / put_s / 1e3,
                get_gbps=mb / get_s / 1e3,
                torch_copy_gbps=mb / copy_s / 1e3,
            )
        kv.close()


# ---------------------------------------------------------------------- c
def probe_publish_ordering(emit, port: int, rounds: int = 20) -> None:
    from bana_sglang.radix_global.client import IndexClient
    from bana_sglang.radix_global.keys import KVLayout, page_chain
    from bana_sglang.radix_global.mooncake_kv import StoreConfig
    from bana_sglang.radix_global.pool import KVPool
    from bana_sglang.radix_global.publisher import Offload, Publisher
    from bana_sglang.radix_global.store import PageStore
    from bench.local_store import local_store

    layers, page, heads, dim = 8, 16, 4, 64
    layout = KVLayout("probe-ordering", "bfloat16", page, heads, dim, layers)
    k = [
        torch.zeros((64 * page, heads, dim), dtype=torch.bfloat16, device="cuda")
        for _ in range(layers)
    ]
    v = [torch.zeros_like(t) for t in k]
    pool = KVPool(k, v, page)
    forward = torch.cuda.Stream()
    big = torch.randn(4096, 4096, device="cuda")
    with local_store(1 << 30, first_port=port) as ls:
        cfg = StoreConfig(master_addr=ls.master)
        pub = Publisher(
            pool,
            lambda: PageStore.connect(layout, cfg),
            IndexClient(ls.index, name="probe"),
            "probe",
            arena_bytes=16 << 20,
            nice=0,
        )
        reader = PageStore.connect(layout, cfg)
        bad = 0
        for r in range(rounds):
            pid = 1 + r % 60
            value = float(r + 1)
            with torch.cuda.stream(forward):
                x = big
                for _ in range(20 + 5 * (r % 4)):  # the forward is busy a while first
                    x = torch.tanh(x @ big)
                for t in k + v:  # then writes the page's rows
                    t[pid * page : (pid + 1) * page] = value + x[0, 0] * 0
                written = torch.cuda.Event()
                written.record(forward)
            chain = page_chain(range(r * 1000, r * 1000 + page), layout)
            pub.submit(Offload(list(chain), None, torch.tensor([pid]), [written]))
            pub.join()
            ok = pub.results.get_nowait()
            got = reader.get_page(chain[0])
            fine = ok and isinstance(got, torch.Tensor) and bool((got.float() == value).all())
            bad += not fine
        emit(probe="c", ok=bad == 0, rounds=rounds, half_written_or_failed=bad)
        pub.close()
        pub.index.close()
        reader.kv.close()


# ---------------------------------------------------------------------- d
def probe_partial_attention(emit) -> None:
    from bana_sglang.kernels import merge
    from bana_sglang.kernels import paged_decode as pd

    hq, hkv, d = 32, 8, 128
    scale = 1 / math.sqrt(d)
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, ctx in ((1, 4096), (16, 4096), (64, 8192), (256, 4096), (16, 32768)):
        slots = b * ctx + 16
        k = torch.randn(slots, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(slots, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
        rtt = torch.arange(b * ctx, device="cuda").view(b, ctx)
        lent = (ctx // 4, ctx // 2)  # page-aligned when ctx is a multiple of 64
        skip = {i: lent for i in range(b)}
        ip, ix = pd.page_list(rtt, range(b), [ctx] * b, skip)
        hp, hx = pd.page_list(rtt, range(b), [lent[1]] * b, {i: (0, lent[0]) for i in range(b)})
        pd.decode_attention(q, k, v, ip, ix, scale)  # compile
        _sync()
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            o_l, lse_l = pd.decode_attention(q, k, v, ip, ix, scale)
        _sync()
        local_ms = (time.perf_counter() - t0) / reps * 1e3
        o_h, lse_h = pd.decode_attention(q, k, v, hp, hx, scale)
        t0 = time.perf_counter()
        for _ in range(reps):
            merged = merge.merge_two(o_l, lse_l, o_h, lse_h)
        _sync()
        merge_ms = (time.perf_counter() - t0) / reps * 1e3
        # float64 reference over every position, for a few rows (big shapes are slow in float64)
        rows = list(range(min(b, 4)))
        err, lse_err = 0.0, 0.0
        for i in rows:
            kk = k[rtt[i]].double().repeat_interleave(hq // hkv, 1)
            vv = v[rtt[i]].double().repeat_interleave(hq // hkv, 1)
            s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale
            want = torch.einsum("hn,nhd->hd", torch.softmax(s, 1), vv)
            err = max(err, float((merged.output[i].double() - want).norm() / want.norm()))
            lse_err = max(
                lse_err, float((merged.lse[i].double() - torch.logsumexp(s, 1)).abs().max())
            )
        emit(
            probe="d",
            ok=err < 2e-2 and lse_err < 5e-2,
            batch=b,
            context=ctx,
            rel_err=err,
            lse_abs_err=lse_err,
            lse_base="natural" if lse_err < 5e-2 else "wrong",
            local_ms_per_layer=local_ms,
            merge_ms_per_layer=merge_ms,
        )
        del k, v


# ---------------------------------------------------------------------- s
def probe_weight_staging(emit) -> None:
    from bana_sglang.migrate.transfer import TransferEngine, checksum_for, sum32

    # one layer of a Llama-3-8B-like model in bf16: ~436 MB
    shapes = [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (14336, 4096),
        (14336, 4096),
        (4096, 14336),
    ]
    owner = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    guest = [torch.zeros_like(t) for t in owner]
    a, b = TransferEngine("127.0.0.1"), TransferEngine("127.0.0.1")
    for t in owner:
        a.register(t)
    for t in guest:
        b.register(t)
    t0 = time.perf_counter()
    want = [sum32(t) for t in owner]
    _sync()
    sum_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    b.read(a.session, guest, [t.data_ptr() for t in owner])
    _sync()
    read_s = time.perf_counter() - t0
    got = [sum32(t) for t in guest]
    equal = all(torch.equal(x, y) for x, y in zip(owner, guest))
    corrupt = guest[0].clone()
    corrupt.view(torch.int16)[12345] ^= 1
    mb = sum(t.numel() * t.element_size() for t in owner) / 1e6
    emit(
        probe="s",
        ok=equal
        and got == want
        and sum32(corrupt) != want[0]
        and checksum_for(owner[0]) == "sum32",
        mb=mb,
        read_gbps=mb / read_s / 1e3,
        checksum_gbps=mb / sum_s / 1e3,
        checksums_equal=got == want,
        bytes_equal=equal,
    )


PROBES: dict[str, Callable] = {
    "a": probe_mooncake_device_memory,
    "c": probe_publish_ordering,
    "d": probe_partial_attention,
    "s": probe_weight_staging,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.device_probes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="JSON lines, one per measurement")
    p.add_argument("--only", default=",".join(PROBES), help="comma-separated probes")
    p.add_argument("--port", type=int, default=34000)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failed = 0
    with args.out.open("a") as f:

        def emit(**record) -> None:
            line = json.dumps(record)
            f.write(line + "\n")
            f.flush()
            print(line, flush=True)

        for name in [x for x in args.only.split(",") if x]:
            if not _cuda():
                emit(probe=name, ok=True, skipped="no CUDA device")
                continue
            t0 = time.perf_counter()
            try:
                if name in ("a", "c"):
                    PROBES[name](emit, args.port + (0 if name == "a" else 50))
                else:
                    PROBES[name](emit)
            except Exception as e:  # one broken probe must not lose the others
                failed += 1
                emit(
                    probe=name,
                    ok=False,
                    error=f"{type(e).__name__}: {e}",
                    trace=traceback.format_exc()[-2000:],
                )
            logger.info("probe %s took %.1fs", name, time.perf_counter() - t0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
