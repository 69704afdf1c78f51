"""The worker's view of the global KV cache: index client + page store, fail-soft.

This is what a worker (and later the SGLang linker) calls:

- :meth:`GlobalKVCache.load_prefix`: one index round trip for the longest cached
  prefix, then one batched store read; pages that are listed but missing or
  corrupt are reported to the index (which forgets them and their
  descendants) and the load stops there: the caller recomputes the rest;
- :meth:`GlobalKVCache.publish`: intent -> write the granted range -> commit.

Invariants:
- no method raises because the index or the store is down, slow, restarted or
  inconsistent: the outcome is a shorter (possibly empty) hit, or nothing
  published; the condition is logged once per episode by the clients below;
- a loaded page is always the verified page for this layout (see :mod:`store`);
- store unavailability is not reported as page loss (the pages may come back;
  a store that restarted empty is detected by the index service itself).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from bana_sglang.radix_global.keys import KVLayout, PageHash, page_chain
from bana_sglang.radix_global.service import IndexClient
from bana_sglang.radix_global.store import LoadResult, PageStore

logger = logging.getLogger(__name__)

_NOT_LOSS = ("unavailable",)


class PublishResult(NamedTuple):
    """``committed``: pages made visible now; ``written``: pages written to the
    store; ``note``: why fewer than asked (empty when all were new and written)."""

    committed: int
    written: int
    note: str


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

    def load_prefix(self, chain: Sequence[PageHash], out: Sequence[torch.Tensor] | None = None) -> LoadResult:
        """Load the longest cached prefix of ``chain`` (into ``out`` if given)."""
        match = self.index.lookup(chain)
        if match.length == 0:
            return LoadResult((), None)
        res = self.store.get_pages(chain[:match.length], None if out is None else out[:match.length])
        if res.miss is not None and res.miss.reason not in _NOT_LOSS:
            logger.info("page %s listed by the index but %s in the store; reporting it",
                        res.miss.page, res.miss.reason)
            self.index.report_loss([res.miss.page], self.owner)
        return res

    def publish(self, chain: Sequence[PageHash], tensors: Sequence[torch.Tensor]) -> PublishResult:
        """Publish ``tensors[i]`` as page ``chain[i]`` (pages already cached are skipped)."""
        if len(chain) != len(tensors):
            raise ValueError(f"{len(chain)} pages but {len(tensors)} tensors")
        if not chain:
            return PublishResult(0, 0, "empty")
        grant = self.index.publish_intent(chain, [self.store.object_size] * len(chain), self.owner)
        if grant is None:
            return PublishResult(0, 0, "index unavailable")
        if grant.start == grant.stop:
            return PublishResult(0, 0, grant.note)
        put = self.store.put_pages(chain[grant.start:grant.stop], tensors[grant.start:grant.stop])
        committed = self.index.commit(grant.intent, put.written)
        note = grant.note or (f"store: {put.failed.reason}" if put.failed else "")
        if committed is None:
            return PublishResult(0, put.written, "commit not acknowledged")
        return PublishResult(committed, put.written, note)
