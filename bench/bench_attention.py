"""Benchmark: SGLang's stock CPU attention (``torch_native``) vs ``bana_cpu``.

Starts one real SGLang server per backend on the same model (default: the
``small`` Llama, 8 layers, GQA 8/4 heads), in the same run, and measures on
each, interleaving the two servers request by request so that load on a
shared machine hits both alike:

- cold prefill of N-token prompts (fresh random ids, nothing cached);
- the same prompt again (fully cached: N-1 tokens hit, 1 new token);
- the prompt plus 100 new tokens (N cached, 100 new);
- decode tokens/s at batch 1 and 8: (t(1 + K new tokens) - t(1 new token))
  over cached prompts, i.e. K decode steps per request, prefill subtracted.

Every time is the client-side wall time of one ``/generate`` call (median of
``--reps``). Prints one table with the ratio ours/stock per row.

Run: ``.venv/bin/python bench/bench_attention.py [--sizes 1024 2048 4096]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bana_sglang import models
from bana_sglang.launch import Cluster, plan_single_server

logger = logging.getLogger("bench_attention")

STOCK = "torch_native"
OURS = "bana_cpu"


def _free_port() -> int:
    # Leave room above: SGLang derives helper ports from --port.
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000:
            return port


def _generate(
    url: str, input_ids: list[int] | list[list[int]], new_tokens: int
) -> tuple[float, list[dict]]:
    """(seconds, answers) of one /generate call, greedy, EOS ignored."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=1200)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    return dt, out if isinstance(out, list) else [out]


class Bench:
    def __init__(self, urls: dict[str, str], vocab: int, reps: int, seed: int = 0):
        self.urls = urls
        self.vocab = vocab
        self.reps = reps
        self.rng = random.Random(seed)
        self.rows: list[tuple[str, dict[str, float], str]] = []  # (label, {backend: value}, unit)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(2, self.vocab) for _ in range(n)]

    def _both(self, label: str, unit: str, measure: Callable[[str], float]) -> None:
        samples: dict[str, list[float]] = {b: [] for b in self.urls}
        for _ in range(self.reps):
            for backend in self.urls:  # interleaved: same load for both
                samples[backend].append(measure(backend))
        vals = {b: statistics.median(s) for b, s in samples.items()}
        self.rows.append((label, vals, unit))
        logger.info("%s: %s", label, {b: round(v, 4) for b, v in vals.items()})

    def prefill(self, n: int) -> None:
        prompts: dict[str, list[int]] = {}

        def cold(b: str) -> float:
            prompts[b] = self.ids(n)  # fresh: nothing cached
            dt, out = _generate(self.urls[b], prompts[b], 1)
            assert out[0]["meta_info"]["cached_tokens"] == 0, out[0]["meta_info"]
            return dt

        def cached(b: str) -> float:
            dt, out = _generate(self.urls[b], prompts[b], 1)
            assert out[0]["meta_info"]["cached_tokens"] >= n - 1, out[0]["meta_info"]
            return dt

        def plus100(b: str) -> float:
            dt, out = _generate(self.urls[b], prompts[b] + self.ids(100), 1)
            assert out[0]["meta_info"]["cached_tokens"] >= n, out[0]["meta_info"]
            return dt

        # Each rep: a cold prompt, then that same prompt cached, then cached + 100 new.
        samples: dict[str, dict[str, list[float]]] = {
            k: {b: [] for b in self.urls} for k in ("cold", "cached", "plus100")
        }
        for _ in range(self.reps):
            for b in self.urls:
                samples["cold"][b].append(cold(b))
                samples["cached"][b].append(cached(b))
                samples["plus100"][b].append(plus100(b))
        for key, label in (
            ("cold", f"cold prefill {n}"),
            ("cached", f"fully cached {n}"),
            ("plus100", f"cached {n} + 100 new"),
        ):
            vals = {b: statistics.median(s) for b, s in samples[key].items()}
            self.rows.append((label, vals, "s"))
            logger.info("%s: %s", label, vals)

    def decode(self, batch: int, prompt_len: int, steps: int) -> None:
        prompts = [self.ids(prompt_len) for _ in range(batch)]
        for url in self.urls.values():  # warm the cache: the timed calls prefill ~1 token each
            _generate(url, prompts, 1)

        def tok_s(b: str) -> float:
            t1, _ = _generate(self.urls[b], prompts, 1)
            tn, out = _generate(self.urls[b], prompts, 1 + steps)
            assert all(len(o["output_ids"]) == 1 + steps for o in out)
            return batch * steps / max(tn - t1, 1e-9)

        self._both(f"decode bs={batch} (ctx {prompt_len})", "tok/s", tok_s)

    def table(self) -> str:
        names = list(self.urls)
        head = (
            f"{'measurement':32s} " + " ".join(f"{n:>14s}" for n in names) + f" {'ours/stock':>11s}"
        )
        lines = [head, "-" * len(head)]
        for label, vals, unit in self.rows:
            cells = " ".join(
                f"{vals[n]:>11.3f} {unit:<2s}" if unit == "s" else f"{vals[n]:>8.1f} {unit}"
                for n in names
            )
            ratio = vals[OURS] / vals[STOCK] if STOCK in vals and OURS in vals else float("nan")
            lines.append(f"{label:32s} {cells} {ratio:>11.3f}")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--model", default="small", help="embedded model name or folder (default: small)"
    )
    ap.add_argument(
        "--sizes", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths"
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median)")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--decode-ctx", type=int, default=512, help="prompt length for decode runs")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument(
        "--backends",
        nargs="+",
        default=[STOCK, OURS],
        help="attention backends to compare (e.g. add flex_attention)",
    )
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: discarded)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    model = models.resolve(args.model)

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    ctx = max(args.sizes) + 200
    plans = [
        plan_single_server(
            str(model),
            port=_free_port(),
            name=b,
            sglang_args=(
                "--attention-backend",
                b,
                "--context-length",
                str(ctx),
                "--chunked-prefill-size",
                str(ctx),
            ),
        )
        for b in args.backends
    ]
    # One Cluster with every server as a worker: they start together, from this thread
    # (children get PR_SET_PDEATHSIG, which fires when the spawning thread exits).
    cluster = Cluster(
        dataclasses.replace(plans[0], workers=tuple(w for p in plans for w in p.workers)),
        log_dir=args.log_dir,
        startup_timeout=900,
    )
    t0 = time.perf_counter()
    with cluster:
        logger.info("servers up in %.0f s", time.perf_counter() - t0)
        bench = Bench({b: p.endpoint for b, p in zip(args.backends, plans)}, vocab, args.reps)
        for url in bench.urls.values():  # warm-up: first-call overheads out of the numbers
            _generate(url, bench.ids(64), 4)
        for n in args.sizes:
            bench.prefill(n)
        for bs in args.decode_batches:
            bench.decode(bs, args.decode_ctx, args.decode_steps)
    print(
        f"model={Path(model).name} reps={args.reps} (median); wall {time.perf_counter() - t0:.0f} s"
    )
    print(bench.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
