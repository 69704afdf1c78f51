"""Pure routing policies: load snapshots in, a worker id out.

The live HTTP router and the simulator (``bana_sglang.sim``) import the *same*
objects from here; nothing in this module knows about HTTP, asyncio, ZMQ or the
simulator's clock. A policy is a small object with per-instance state (a
round-robin cursor, approximate prefix trees); it never reads global state.

Vocabulary:
- ``WorkerLoad``: one worker's load snapshot (frozen). Token counts are tokens,
  times are seconds, ``busy_fraction`` is in [0, 1].
- ``RouteRequest``: what the router knows about a request before routing: its
  prompt length, its chained page hashes (``page_size`` tokens each; hash i
  determines pages 0..i), its max new tokens, and optionally how many leading
  tokens the *global* index already holds.
- ``CacheOracle``: optional read-only view of cache contents (global index, and
  for the Mooncake-style baseline each worker's local cache).

Invariants:
- ``pick_prefill``/``pick_decode`` return the id of one of the given loads of the
  right tier (``Tier.COLOCATED`` workers serve both) and never mutate the loads.
- Every policy is deterministic given its seed and its inputs.
- ``bana`` never looks at *where* a prefix is cached: the uncached-token term
  comes from the global index and is the same for every worker, so cache
  placement cannot attract traffic (the hotspot BanaServe removes).
"""

from __future__ import annotations

import abc
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from bana_sglang.registry import Registry
from bana_sglang.router.prefix_tree import PagePrefixTree
from bana_sglang.types import RequestId, Tier, WorkerId, WorkerLoad

logger = logging.getLogger(__name__)

PageHash = NewType("PageHash", int)  # chained; the live router folds hex hashes to int

DEFAULT_PAGE_SIZE = 512  # tokens per page hash (the Mooncake traces' block size)


class RoutingError(RuntimeError):
    """Routing failed: unknown policy name, no worker of the needed tier, bad input."""

    def __init__(self, reason: str, *, policy: str | None = None, request: str | None = None):
        self.reason, self.policy, self.request = reason, policy, request
        ctx = ", ".join(f"{k}={v}" for k, v in (("policy", policy), ("request", request)) if v)
        super().__init__(f"{reason}" + (f" ({ctx})" if ctx else ""))


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: RequestId
    num_tokens: int
    page_hashes: tuple[PageHash, ...] = ()
    max_new_tokens: int = 0
    page_size: int = DEFAULT_PAGE_SIZE
    # Leading tokens the global index holds, if the caller already asked it.
    global_cached_tokens: int | None = None

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens a prefill worker computes (all, when the global index was not asked)."""
        return self.num_tokens - (self.global_cached_tokens or 0)

    def cached_tokens(self, pages: int) -> int:
        """Tokens reusable from ``pages`` matched pages; the last prompt token is
        always computed (it yields the first output token)."""
        return max(0, min(pages * self.page_size, self.num_tokens - 1))


class CacheOracle(Protocol):
    """Read-only cache view; the live router backs it with the global index
    service, the simulator with its store model."""

    def global_match(self, page_hashes: Sequence[PageHash]) -> int:
        """Leading pages held anywhere (global store)."""
        ...

    def local_match(self, worker: WorkerId, page_hashes: Sequence[PageHash]) -> int:
        """Leading pages held in ``worker``'s own memory."""
        ...


# Prefill time model used by cost-based policies: (new_tokens, cached_tokens) -> s.
PrefillTime = Callable[[int, int], float]
# Seconds to move ``tokens`` tokens of KV from the global store to a worker.
TransferTime = Callable[[int], float]


def _linear_prefill(new_tokens: int, cached_tokens: int) -> float:
    return float(new_tokens)  # in "tokens"; only the ordering matters


class RoutingPolicy(abc.ABC):
    """Base class. ``name`` is the registry key."""

    name: str = "base"
    #: what the policy reads of a request beyond its size: its page hashes (prefix
    #: affinity), the global index's cached tokens. The live router computes only what
    #: the policy reads: hashing a long prompt and asking the index cost CPU per request.
    reads_page_hashes: bool = False
    reads_global_index: bool = False

    def __init__(
        self,
        *,
        seed: int = 0,
        oracle: CacheOracle | None = None,
        prefill_time: PrefillTime | None = None,
        transfer_time: TransferTime | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.oracle = oracle
        # Time models for cost-based policies (unused by the others).
        self.prefill_time = prefill_time or _linear_prefill
        self.transfer_time = transfer_time or (lambda tokens: 0.0)

    @abc.abstractmethod
    def pick_prefill(self, req: RouteRequest, loads: Sequence[WorkerLoad]) -> WorkerId: ...

    def pick_decode(self, req: RouteRequest, loads: Sequence[WorkerLoad]) -> WorkerId:
        """Default decode choice: the most free KV after this request, then least
        in-flight work; ties go to the first in ``loads`` order."""
        cands = _of_tier(loads, Tier.DECODE, self.name, req)
        need = req.num_tokens + req.max_new_tokens
        fits = [w for w in cands if w.kv_free_tokens >= need] or cands
        best = min(
            fits,
            key=lambda w: (
                (w.kv_used_tokens + w.inflight_tokens + need) / max(1, w.kv_total_tokens),
                w.num_requests,
            ),
        )
        return best.worker_id

    def on_finish(self, req: RouteRequest, worker: WorkerId) -> None:  # noqa: B027
        """Hook: ``req`` finished on ``worker`` (policies with state may use it)."""

    def _global_uncached(self, req: RouteRequest) -> int:
        if req.global_cached_tokens is not None:
            return req.num_tokens - req.global_cached_tokens
        if self.oracle is not None and req.page_hashes:
            return req.num_tokens - req.cached_tokens(self.oracle.global_match(req.page_hashes))
        return req.num_tokens


def _of_tier(
    loads: Sequence[WorkerLoad], tier: Tier, policy: str, req: RouteRequest
) -> list[WorkerLoad]:
    cands = [w for w in loads if w.serves(tier)]
    if not cands:
        raise RoutingError(
            f"no {tier.value} worker among {len(loads)} loads",
            policy=policy,
            request=req.request_id,
        )
    return cands


class BanaPolicy(RoutingPolicy):
    """Load-only: cost = queued prefill work + this request's globally uncached
    tokens (the second term is worker-independent, so placement never matters);
    ties broken by running requests, then busy fraction, then a rotating cursor."""

    reads_global_index = True
    name = "bana"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._cursor = 0

    def pick_prefill(self, req, loads):
        cands = _of_tier(loads, Tier.PREFILL, self.name, req)
        uncached = self._global_uncached(req)
        n = len(cands)
        self._cursor = (self._cursor + 1) % n
        best = min(
            range(n),
            key=lambda i: (
                cands[i].prefill_backlog_tokens + uncached,
                cands[i].running_requests,
                cands[i].busy_fraction,
                (i - self._cursor) % n,
            ),
        )
        return cands[best].worker_id


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._next: dict[Tier, int] = {Tier.PREFILL: 0, Tier.DECODE: 0}

    def _pick(self, tier, req, loads):
        cands = _of_tier(loads, tier, self.name, req)
        i = self._next[tier] % len(cands)
        self._next[tier] = i + 1
        return cands[i].worker_id

    def pick_prefill(self, req, loads):
        return self._pick(Tier.PREFILL, req, loads)

    def pick_decode(self, req, loads):
        return self._pick(Tier.DECODE, req, loads)


class PowerOfTwoPolicy(RoutingPolicy):
    """Two random candidates, the less loaded wins (requests, then tokens)."""

    name = "power_of_two"

    def _pick(self, tier, req, loads, key):
        cands = _of_tier(loads, tier, self.name, req)
        if len(cands) == 1:
            return cands[0].worker_id
        a, b = self.rng.sample(cands, 2)
        return (a if key(a) <= key(b) else b).worker_id

    def pick_prefill(self, req, loads):
        return self._pick(
            Tier.PREFILL, req, loads, lambda w: (w.num_requests, w.queued_prefill_tokens)
        )

    def pick_decode(self, req, loads):
        return self._pick(Tier.DECODE, req, loads, lambda w: (w.kv_usage, w.num_requests))


@dataclass(frozen=True)
class CacheAwareConfig:
    """SGLang router defaults (sgl-router ``cache_aware``)."""

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_pages: int | None = None  # per-worker approximate tree bound

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")


class CacheAwarePolicy(RoutingPolicy):
    """SGLang-router-style cache affinity with an approximate tree per worker.

    If the load (queued + running requests) is imbalanced (max - min > abs AND
    max > rel * min) route to the least loaded; else to the longest prefix match
    if its ratio exceeds ``cache_threshold``; else to the smallest tree. The
    chosen worker's tree gets the request's pages (decode uses the default).
    """

    reads_page_hashes = True
    name = "cache_aware"

    def __init__(self, *, config: CacheAwareConfig | None = None, **kw) -> None:
        super().__init__(**kw)
        self.config = config or CacheAwareConfig()
        self.trees: dict[WorkerId, PagePrefixTree] = {}

    def _tree(self, w: WorkerId) -> PagePrefixTree:
        t = self.trees.get(w)
        if t is None:
            t = self.trees[w] = PagePrefixTree(self.config.max_tree_pages)
        return t

    def pick_prefill(self, req, loads):
        cfg = self.config
        cands = _of_tier(loads, Tier.PREFILL, self.name, req)
        counts = [w.num_requests for w in cands]
        hi, lo = max(counts), min(counts)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            chosen = cands[counts.index(lo)].worker_id
        else:
            n_pages = max(1, len(req.page_hashes))
            matches = [self._tree(w.worker_id).match(req.page_hashes) for w in cands]
            best = max(range(len(cands)), key=lambda i: (matches[i], -counts[i]))
            if req.page_hashes and matches[best] / n_pages > cfg.cache_threshold:
                chosen = cands[best].worker_id
            else:
                chosen = min(
                    cands, key=lambda w: (self._tree(w.worker_id).size, w.num_requests)
                ).worker_id
        if req.page_hashes:
            self._tree(chosen).insert(req.page_hashes)
        return chosen


class GlobalCacheAwarePolicy(RoutingPolicy):
    """Mooncake-conductor-style: for each prefill worker, estimate TTFT as queue
    time + prefill of the uncached part, where the prefix may come from the
    worker's own cache or be fetched from the global store at a transfer cost;
    pick the minimum. ``global_store=False`` gives the local-cache-aware variant."""

    reads_page_hashes = True
    name = "global_cache_aware"

    def __init__(self, *, global_store: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.global_store = global_store

    def pick_prefill(self, req, loads):
        cands = _of_tier(loads, Tier.PREFILL, self.name, req)
        if self.oracle is None or not req.page_hashes:
            return min(cands, key=lambda w: w.prefill_backlog_tokens).worker_id
        n = req.num_tokens
        g_tok = (
            req.cached_tokens(self.oracle.global_match(req.page_hashes)) if self.global_store else 0
        )
        best_w, best_t = cands[0].worker_id, float("inf")
        for w in cands:
            queue = self.prefill_time(round(w.prefill_backlog_tokens), 0)
            l_tok = req.cached_tokens(self.oracle.local_match(w.worker_id, req.page_hashes))
            t = queue + self.prefill_time(n - l_tok, l_tok)
            if g_tok > l_tok:
                t = min(
                    t,
                    queue + self.transfer_time(g_tok - l_tok) + self.prefill_time(n - g_tok, g_tok),
                )
            if t < best_t:
                best_w, best_t = w.worker_id, t
        return best_w


class LocalCacheAwarePolicy(GlobalCacheAwarePolicy):
    """Mooncake's local-cache-aware scheduling: same cost, local caches only."""

    name = "local_cache_aware"

    def __init__(self, **kw) -> None:
        kw["global_store"] = False
        super().__init__(**kw)


class LoadOnlyPolicy(BanaPolicy):
    """Load balancing by queued prefill tokens without any cache information
    (Mooncake's "load-balancing" scheduler; no global store)."""

    name = "load_only"

    def _global_uncached(self, req):
        return req.num_tokens


class RandomPolicy(RoutingPolicy):
    name = "random"

    def pick_prefill(self, req, loads):
        return self.rng.choice(_of_tier(loads, Tier.PREFILL, self.name, req)).worker_id

    def pick_decode(self, req, loads):
        return self.rng.choice(_of_tier(loads, Tier.DECODE, self.name, req)).worker_id


POLICIES: Registry[RoutingPolicy] = Registry(
    "routing policy",
    (
        BanaPolicy,
        RoundRobinPolicy,
        PowerOfTwoPolicy,
        CacheAwarePolicy,
        GlobalCacheAwarePolicy,
        LocalCacheAwarePolicy,
        LoadOnlyPolicy,
        RandomPolicy,
    ),
    error=RoutingError,
    error_kwargs=lambda name: {"policy": name},
)
DEFAULT_POLICY = "bana"
#: Policies the live router can run (the *_cache_aware ones need the simulator's cache oracle).
LIVE_POLICIES = ("bana", "round_robin", "power_of_two", "cache_aware", "load_only", "random")


def get_policy(name: str = DEFAULT_POLICY, **kwargs) -> RoutingPolicy:
    """A fresh policy instance by registry name; unknown names list the valid ones."""
    return POLICIES.create(name, **kwargs)
