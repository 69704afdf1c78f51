"""The router's view of the global KV cache store: how much of a prompt is cached
*anywhere*.

BanaServe's routing cost for a prefill worker is its queued work plus this
request's uncached tokens, where "uncached" comes from the global index: the
same number for every worker, so where a prefix happens to be cached never
attracts traffic; it only makes the router's own in-flight accounting honest
(a fully cached 4k-token prompt is a few pages of loading, not 4k tokens of
prefill).

The router computes SGLang's chained storage hashes of the prompt
(:func:`keys.sglang_page_hashes`), maps them into the workers' namespace
(model weights digest + KV layout, :class:`keys.KVLayout`) and asks the index
service once, without touching LRU state. The lookup runs on one helper thread
(the ZMQ client is not thread-safe) with a short timeout: an index that is
down makes the answer "unknown" (the whole prompt counts as uncached), never
a slow request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import (
    KVLayout,
    model_identity,
    namespaced_chain,
    sglang_page_hashes,
)

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
}


def layout_for(model_path: str | Path, page_size: int, dtype: str | None = None) -> KVLayout:
    """The KV layout a worker of this model has (TP 1, the checkpoint's dtype unless given)."""
    path = Path(model_path)
    cfg = json.loads((path / "config.json").read_text())
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    dt = _DTYPES.get(
        str(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), "float32"
    )
    return KVLayout(
        model=model_identity(str(path)),
        dtype=dt,
        page_size=page_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        num_layers=int(cfg["num_hidden_layers"]),
    )


class GlobalIndexView:
    def __init__(self, endpoint: str, layout: KVLayout, *, timeout_s: float = 0.1, metrics=None):
        self.layout = layout
        self.metrics = metrics  # RouterMetrics: lookups by outcome, cached tokens
        self.page_size = layout.page_size
        self._client = IndexClient(endpoint, timeout_s=timeout_s, name="router")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="global-index")
        logger.info(
            "global index %s for layout %s (digest %s)", endpoint, layout.model, layout.digest[:12]
        )

    def _lookup(self, ids: Sequence[int]) -> int | None:
        try:
            chain = namespaced_chain(sglang_page_hashes(ids, self.page_size), self.layout)
        except ValueError:
            return None
        if not chain:
            return 0
        match = self._client.lookup(chain, touch=False)
        if not match.available:
            return None
        # SGLang always computes the last prompt token
        return max(0, min(match.length * self.page_size, len(ids) - 1))

    async def cached_tokens(self, ids: Sequence[int]) -> int | None:
        """Leading tokens of ``ids`` the store holds; None when the index cannot say."""
        t0 = time.perf_counter()
        if len(ids) < self.page_size:
            cached: int | None = 0
        else:
            cached = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._lookup, list(ids)
            )
        if self.metrics is not None:
            self.metrics.global_lookup_seconds.observe(time.perf_counter() - t0)
            self.metrics.global_lookups.labels(
                "unknown" if cached is None else "hit" if cached else "miss"
            ).inc()
            if cached:
                self.metrics.global_cached_tokens.inc(cached)
        return cached

    def close(self) -> None:
        self._pool.submit(self._client.close).result(timeout=5)
        self._pool.shutdown(wait=True)
