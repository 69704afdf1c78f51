"""The global store's data path on its own: publish and layer-wise loads against raw Mooncake.

``python -m bench.bench_store_paths`` starts the store's processes (master,
storage, index) on 127.0.0.1, builds a KV pool of an embedded model's shape on
``--device`` (``cpu`` or ``cuda``; no SGLang, no model weights), and measures,
in one run:

- **publish**: ``--pages`` pages through the linker's :class:`Publisher` (intent,
  frame in the arena, one batched put, commit) against a raw batched put of the
  same bytes (Mooncake ``batch_put_from_multi_buffers``, one slice per object);
- **load**, for each ``--modes`` (``staged``, ``direct``, and on a CPU pool
  ``local``: whole pages through the storage process's shared-memory arena): the
  linker's :class:`Loader` reads the pages back into other pool pages while a
  simulated forward (``--layer-ms`` of compute per layer, on the CPU or the CUDA
  current stream) waits for each layer on the linker's :class:`LayerCounter`.
  Reported: load time and GB/s against a raw batched get of the same objects
  over the transfer engine (one slice per object, no verification; for
  ``local`` also the storage process's raw get into the shared arena), the share
  of the load hidden under the forward (``1 - (forward with load - forward
  alone) / load``), and whether every loaded byte equals what was published.

The device check (``scripts/device_check.sh``) runs it on a GPU. ``--json``
writes one record per measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bana_sglang import models
from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.device import Device
from bana_sglang.radix_global.keys import KVLayout, page_chain
from bana_sglang.radix_global.layer_counter import LayerCounter
from bana_sglang.radix_global.loader import Loader
from bana_sglang.radix_global.mooncake_kv import StoreConfig, page_key
from bana_sglang.radix_global.pool import Arena, KVPool
from bana_sglang.radix_global.publisher import Offload, Publisher
from bana_sglang.radix_global.shm_arena import LocalLoads
from bana_sglang.radix_global.store import PageStore
from bench.local_store import local_store

logger = logging.getLogger("bench.store_paths")


def make_pool(spec: models.ModelSpec, pages: int, device: str, dtype: torch.dtype, page: int):
    """A pool of ``2 * pages + 1`` pages of ``spec``'s KV shape, random rows (page 0 unused,
    as in SGLang)."""
    g = torch.Generator().manual_seed(0)
    slots = (2 * pages + 1) * page
    shape = (slots, spec.num_kv_heads, spec.head_dim)
    k = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(spec.num_layers)]
    v = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(spec.num_layers)]
    return KVPool(k, v, page)


class Forward:
    """A stand-in for the model's forward: per layer, wait for the layer on the counter, then
    compute ``layer_s`` (a matmul loop on the current CUDA stream, or on the CPU)."""

    def __init__(self, device: Device, layer_s: float):
        self.device = device
        n = 1024 if device.is_cuda else 128
        self.a = torch.randn(n, n, device=device.device)
        self.reps = 1
        if layer_s > 0:  # calibrate: matmuls per layer (after a warm-up)
            self._time(20)
            t = min(self._time(50) for _ in range(3))
            self.reps = max(1, round(layer_s / (t / 50)))

    def _time(self, reps: int) -> float:
        self._sync()
        t0 = time.perf_counter()
        x = self.a
        for _ in range(reps):
            x = torch.tanh(x @ self.a)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.is_cuda:
            torch.cuda.synchronize(self.device.device)

    def run(self, layers: int, counter: LayerCounter | None) -> float:
        self._sync()
        t0 = time.perf_counter()
        x = self.a
        for layer in range(layers):
            if counter is not None:
                counter.wait_until(layer)
            for _ in range(self.reps):
                x = torch.tanh(x @ self.a)
        self._sync()
        return time.perf_counter() - t0


def run(args) -> list[dict]:
    spec = models.SPECS[args.model]
    device = Device(args.device)
    if not device.is_cuda:  # the simulated forward takes one core, as a CPU worker does
        torch.set_num_threads(args.cpu_threads)
    dtype = getattr(torch, args.dtype)
    page = args.page_size
    layout = KVLayout(
        f"bench-store-paths-{spec.name}",
        args.dtype,
        page,
        spec.num_kv_heads,
        spec.head_dim,
        spec.num_layers,
    )
    pool = make_pool(spec, args.pages, args.device, dtype, page)
    pool.check_layout(layout)
    src_ids = torch.arange(1, args.pages + 1, dtype=torch.int64)
    dst_ids = src_ids + args.pages
    records: list[dict] = []
    obj = None
    with local_store(args.segment_mb << 20, first_port=args.port) as ls:
        cfg = StoreConfig(master_addr=ls.master)
        assert ls.index is not None
        chain = page_chain(range(args.pages * page), layout, salt=f"run-{time.time()}")
        # -- publish through the linker's publisher
        pub = Publisher(
            pool,
            lambda: PageStore.connect(layout, cfg),
            IndexClient(ls.index, name="bench/publish"),
            "bench",
            arena_bytes=args.arena_mb << 20,
            nice=0,
        )
        t0 = time.perf_counter()
        # the pool's rows were written on the current stream: the publish waits for them
        pub.submit(Offload(list(chain), None, src_ids, [device.ready_event()]))
        pub.join()
        publish_s = time.perf_counter() - t0
        ok = pub.results.get_nowait()
        store = PageStore.connect(layout, cfg)
        obj = store.object_size
        arena = Arena(device, args.arena_mb << 20, store.kv)
        total = args.pages * layout.page_nbytes
        # raw put and get of the same bytes: one slice per object, in arena-sized calls
        raw_keys = [f"bench/raw/{i}-{time.time()}" for i in range(args.pages)]
        per = arena.slots(obj)
        t0 = time.perf_counter()
        for lo in range(0, args.pages, per):
            ks = raw_keys[lo : lo + per]
            rcs = store.kv.put_multi(
                ks, [[arena.ptr + j * obj] for j in range(len(ks))], [[obj]] * len(ks)
            )
            assert all(rc == 0 for rc in rcs), rcs[:4]
        raw_put_s = time.perf_counter() - t0
        records.append(
            dict(
                what="publish",
                pages=args.pages,
                mb=total / 1e6,
                ok=ok,
                seconds=publish_s,
                gbps=total / publish_s / 1e9,
                raw_put_gbps=args.pages * obj / raw_put_s / 1e9,
                ratio=raw_put_s / publish_s,
            )
        )
        logger.info("publish: %s", records[-1])
        pub.close()
        pub.index.close()

        def raw_get() -> float:
            t0 = time.perf_counter()
            for lo in range(0, args.pages, per):
                ks = [page_key(p) for p in chain[lo : lo + per]]
                rcs = store.kv.get_multi(
                    ks, [[arena.ptr + j * obj] for j in range(len(ks))], [[obj]] * len(ks)
                )
                assert all(rc == obj for rc in rcs), rcs[:4]
            return time.perf_counter() - t0

        local = None
        if "local" in args.modes:
            local = LocalLoads(ls.storage, "bench/load", args.arena_mb << 20)

        def raw_local_get() -> float:  # the storage process's whole-object get, nothing else
            shared = local.arena()
            assert shared is not None, "the storage process did not map the load arena"
            keys = [page_key(p) for p in chain]
            t0 = time.perf_counter()
            rcs = local.get(keys, [j * obj for j in range(len(keys))], obj)
            assert all(rc == obj for rc in rcs), rcs[:4]
            return time.perf_counter() - t0

        forward = Forward(device, args.layer_ms / 1e3)
        alone = statistics.median(forward.run(spec.num_layers, None) for _ in range(3))
        for mode in args.modes:
            if mode == "direct":
                for buf in pool.buffers():
                    store.kv.register(buf.data_ptr(), buf.numel() * buf.element_size())
            loader = Loader(
                pool,
                "staged" if mode == "local" else mode,
                arena,
                growth=args.growth,
                min_slice_bytes=args.min_slice_kb << 10,
                local=local if mode == "local" else None,
            )
            loader.register_headers(store.kv)
            for trial in range(args.trials):
                raw_s = raw_get()
                raw_local_s = raw_local_get() if mode == "local" else None
                for buf in pool.buffers():  # the destination pages start as garbage
                    Device.pages_view(buf, page)[dst_ids] = 0
                counter = LayerCounter(spec.num_layers, device)
                index = counter.update_producer()
                counter.set_consumer(index)
                result: dict = {}

                # the header check is the lookup's (the linker does it before the load)
                check = store.layerwise(chain)
                assert check.start() is None
                macs = check.macs
                check.close()

                def load(
                    counter=counter, index=index, result=result, loader=loader, macs=macs
                ) -> None:
                    t0 = time.perf_counter()
                    read = store.layerwise(chain, macs)
                    # as the linker: a load through the storage process opens no session
                    miss = read.start(session=not loader.goes_local(len(chain), obj))
                    assert miss is None, miss
                    miss, stats = loader.load(
                        read, dst_ids, lambda layer, ev: counter.complete(index, layer, ev)
                    )
                    counter.complete(index, spec.num_layers - 1, stats.event)
                    result.update(miss=miss, stats=stats, seconds=time.perf_counter() - t0)

                th = threading.Thread(target=load)
                th.start()
                with_load = forward.run(spec.num_layers, counter)
                th.join()
                landed = counter.finish(index)
                equal = all(
                    torch.equal(
                        Device.pages_view(buf, page)[dst_ids], Device.pages_view(buf, page)[src_ids]
                    )
                    for buf in pool.buffers()
                )
                load_s = result["seconds"]
                records.append(
                    dict(
                        what="load",
                        mode=mode,
                        trial=trial,
                        pages=args.pages,
                        mb=total / 1e6,
                        groups=result["stats"].groups,
                        miss=str(result["miss"]) if result["miss"] else None,
                        landed=landed,
                        bytes_equal=equal,
                        load_s=load_s,
                        read_s=result["stats"].read_s,
                        verify_s=result["stats"].verify_s,
                        copy_s=result["stats"].copy_s,
                        gbps=total / load_s / 1e9,
                        raw_get_gbps=args.pages * obj / raw_s / 1e9,
                        ratio_to_raw=raw_s / load_s,
                        raw_local_get_gbps=(
                            args.pages * obj / raw_local_s / 1e9 if raw_local_s else None
                        ),
                        ratio_to_raw_local=raw_local_s / load_s if raw_local_s else None,
                        forward_alone_s=alone,
                        forward_with_load_s=with_load,
                        hidden=max(0.0, min(1.0, 1 - (with_load - alone) / load_s)),
                    )
                )
                logger.info("load: %s", records[-1])
        if local is not None:
            local.close()
        store.kv.remove_many(raw_keys, force=True)
        store.kv.close()
    return records


def table(records: Sequence[dict]) -> str:
    lines = []
    for r in records:
        if r["what"] == "publish":
            lines.append(
                f"publish {r['pages']} pages ({r['mb']:.1f} MB): {r['gbps']:.3f} GB/s, raw put "
                f"{r['raw_put_gbps']:.3f} GB/s (ratio {r['ratio']:.2f}), complete={r['ok']}"
            )
    lines.append(
        "| mode | load ms | GB/s | raw get GB/s | ratio to raw | raw local get GB/s "
        "| ratio to raw local | hidden | bytes equal |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for mode in dict.fromkeys(r["mode"] for r in records if r["what"] == "load"):
        rs = [r for r in records if r.get("mode") == mode]
        med = lambda k, rs=rs: statistics.median(r[k] for r in rs)  # noqa: E731
        local = (
            f"{med('raw_local_get_gbps'):.3f} | {med('ratio_to_raw_local'):.2f}"
            if rs[0]["raw_local_get_gbps"]
            else "- | -"
        )
        lines.append(
            f"| {mode} | {1e3 * med('load_s'):.1f} | {med('gbps'):.3f} | {med('raw_get_gbps'):.3f} | "
            f"{med('ratio_to_raw'):.2f} | {local} | {med('hidden'):.0%} | "
            f"{all(r['bytes_equal'] and r['landed'] for r in rs)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_store_paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="small", choices=sorted(models.SPECS))
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=87, help="pages per load (87: a 1400-token prompt)")
    p.add_argument(
        "--modes",
        default="staged,direct,local",
        help="comma-separated: staged, direct, local (CPU only)",
    )
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--layer-ms", type=float, default=5.0, help="simulated compute per layer")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads of the CPU forward")
    p.add_argument("--growth", type=float, default=2.0, help="layer group growth (see loader)")
    p.add_argument("--min-slice-kb", type=int, default=64, help="see BANA_STORE_MIN_SLICE_BYTES")
    p.add_argument("--arena-mb", type=int, default=64)
    p.add_argument("--segment-mb", type=int, default=1024)
    p.add_argument("--port", type=int, default=33000)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    for mode in args.modes:
        if mode not in ("staged", "direct", "local"):
            p.error(f"unknown mode {mode!r}: choose from staged, direct, local")
    if "local" in args.modes and args.device != "cpu":
        p.error("the local mode loads into a CPU pool: leave it out with --device cuda")
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    records = run(args)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
