"""The worker's view of the global KV cache: index client + page store, fail-soft.

:class:`GlobalKVCache` is what the SGLang linker publishes through (its loads
go layer by layer through :meth:`PageStore.layerwise` instead) and what the
store's tests drive end to end:

- :meth:`GlobalKVCache.load_prefix`: one index round trip for the longest cached
  prefix, then one batched store read; pages that are listed but missing or
  corrupt are reported to the index (which forgets them and their
  descendants) and the load stops there: the caller recomputes the rest;
- :meth:`GlobalKVCache.publish`: intent -> write the granted range -> commit.

Invariants:
- no method raises because the index or the store is down, slow, restarted or
  inconsistent: the outcome is a shorter (possibly empty) hit, or nothing
  published; the condition is logged once per episode by
  :class:`~client.IndexClient` and :class:`~mooncake_kv.MooncakeKV`;
- a loaded page is always the verified page for this layout (see :mod:`store`);
- store unavailability is not reported as page loss (the pages may come back;
  a store that restarted empty is detected by the index service itself).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bana_sglang.radix_global.client import IndexClient
from bana_sglang.radix_global.keys import KVLayout, PageHash, page_chain
from bana_sglang.radix_global.store import LoadResult, PageStore

logger = logging.getLogger(__name__)

_NOT_LOSS = ("unavailable",)


class PublishResult(NamedTuple):
    """``committed``: pages made visible now; ``written``: pages written to the
    store; ``present``: leading pages that were indexed already; ``total``: pages
    offered; ``note``: why fewer than asked (empty when all were new and written)."""

    committed: int
    written: int
    note: str
    present: int = 0
    total: int = 0

    @property
    def complete(self) -> bool:
        """Every offered page is in the index now."""
        return self.present + self.committed == self.total


class GlobalKVCache:
    def __init__(self, layout: KVLayout, index: IndexClient, store: PageStore, owner: str):
        if store.layout != layout:
            raise ValueError("the page store serves another layout")
        self.layout = layout
        self.index = index
        self.store = store
        self.owner = owner

    def chain(self, token_ids: Sequence[int], salt: str | None = None) -> list[PageHash]:
        return page_chain(token_ids, self.layout, salt)

    def load_prefix(
        self, chain: Sequence[PageHash], out: Sequence[torch.Tensor] | None = None
    ) -> LoadResult:
        """Load the longest cached prefix of ``chain`` (into ``out`` if given)."""
        match = self.index.lookup(chain)
        if match.length == 0:
            return LoadResult((), None)
        res = self.store.get_pages(
            chain[: match.length], None if out is None else out[: match.length]
        )
        if res.miss is not None and res.miss.reason not in _NOT_LOSS:
            logger.info(
                "page %s listed by the index but %s in the store; reporting it",
                res.miss.page,
                res.miss.reason,
            )
            self.index.report_loss([res.miss.page], self.owner)
        return res

    def publish(
        self,
        chain: Sequence[PageHash],
        payloads: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        *,
        parent: PageHash | None = None,
    ) -> PublishResult:
        """Publish ``payloads[i]`` as page ``chain[i]`` (pages already cached are skipped).

        A payload is a page tensor or its parts (see :meth:`PageStore.put_pages`);
        ``parent``: the indexed page the chain continues (None: the chain starts
        at the root)."""
        n = len(chain)
        if n != len(payloads):
            raise ValueError(f"{n} pages but {len(payloads)} payloads")
        if not chain:
            return PublishResult(0, 0, "empty")
        grant = self.index.publish_intent(
            chain, [self.store.footprint] * n, self.owner, parent=parent
        )
        if grant is None:
            return PublishResult(0, 0, "index unavailable", 0, n)
        if grant.start == grant.stop:
            return PublishResult(0, 0, grant.note, grant.start, n)
        put = self.store.put_pages(
            chain[grant.start : grant.stop], payloads[grant.start : grant.stop]
        )
        committed = self.index.commit(grant.intent, put.written)
        note = grant.note or (f"store: {put.failed.reason}" if put.failed else "")
        if committed is None:
            return PublishResult(0, put.written, "commit not acknowledged", grant.start, n)
        return PublishResult(committed, put.written, note, grant.start, n)
