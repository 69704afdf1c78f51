"""Cluster state for the simulator: jobs, workers, cache tiers.

A worker is a prefill, decode or colocated SGLang instance. Decode progress is
analytic, not per step: each decode worker keeps a step counter ``S`` that
advances at ``1 / step_time`` while its batch is unchanged; a request that joined
at ``S0`` needing ``k`` steps finishes at ``S0 + k``. The KV it holds at step
``S`` is ``input + (S - S0)``, so the batch's KV is ``base + B * S`` with
``base = sum(input_i - S0_i)``. Step time is re-evaluated whenever the batch
changes (join, finish, migration), using the KV at that moment.

Invariants (checked by tests):
- ``kv_reserved <= kv_capacity`` at all times: a request reserves
  ``input + output`` tokens on admission (what SGLang must be able to hold
  without retraction) and releases them when it finishes or leaves.
- Prefix closure in every cache tier (``PagePrefixTree``).
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Iterator, Mapping

from bana_sglang.balancer.actions import RunningRequest
from bana_sglang.router.prefix_tree import PagePrefixTree
from bana_sglang.sim.profiles import Profile
from bana_sglang.sim.workloads import SimRequest
from bana_sglang.types import RequestId, Tier, WorkerId, WorkerLoad

logger = logging.getLogger(__name__)

EPS = 1e-9


class SimError(RuntimeError):
    """An internal invariant of the simulation broke (a bug, not an input error)."""


class Job:
    """Runtime state of one request."""

    __slots__ = (
        "req",
        "rid",
        "prefill",
        "decode",
        "hbm_tokens",
        "store_tokens",
        "new_tokens",
        "done_tokens",
        "loaded",
        "first_token",
        "join_s",
        "steps_left",
        "finish_step",
        "finish",
        "gen",
    )

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.rid = RequestId(str(req.rid))
        self.prefill: Worker | None = None
        self.decode: Worker | None = None
        self.hbm_tokens = 0  # prefix reused from the worker's own HBM cache
        self.store_tokens = 0  # prefix loaded from the second tier
        self.new_tokens = req.input_len  # tokens to compute
        self.done_tokens = 0  # of new_tokens, computed so far (chunked prefill)
        self.loaded = False
        self.first_token = -1.0
        self.join_s = 0.0
        self.steps_left = max(0, req.output_len - 1)  # the first token comes from prefill
        self.finish_step = 0.0
        self.finish = -1.0
        self.gen = 0  # bumps when the job leaves a decode batch (lazy heap deletion)

    @property
    def kv_need(self) -> int:
        return self.req.input_len + self.req.output_len

    @property
    def cached_tokens(self) -> int:
        return self.hbm_tokens + self.store_tokens


class Worker:
    __slots__ = (
        "wid",
        "tier",
        "profile",
        "hbm",
        "dram",
        "queue",
        "queued_tokens",
        "prefilling",
        "busy_total",
        "busy_from",
        "window_busy",
        "busy_fraction",
        "S",
        "last_t",
        "step_time",
        "batch",
        "heap",
        "base_kv",
        "kv_reserved",
        "kv_capacity",
        "kv_base_capacity",
        "pending",
        "pending_tokens",
        "incoming",
        "version",
        "prefill_factor",
        "decode_factor",
        "offload_phi",
        "colo_stepping",
        "lent_share",
        "leases",
        "cont_p",
        "cont_d",
        "chunk_t",
        "chunk_left",
        "chunk_ver",
        "chunk_arg",
        "lagged",
        "stall_until",
        "_snap",
    )

    def __init__(
        self, wid: WorkerId, tier: Tier, profile: Profile, hbm_pages: int, dram_pages: int | None
    ) -> None:
        self.wid, self.tier, self.profile = wid, tier, profile
        self.hbm = PagePrefixTree(max(1, hbm_pages))
        self.dram = PagePrefixTree(max(1, dram_pages)) if dram_pages else None
        # prefill side
        self.queue: deque[Job] = deque()
        self.queued_tokens = 0  # new tokens not yet computed, queued or in the running chunk
        self.prefilling: list[Job] | None = None
        # busy accounting (seconds)
        self.busy_total = 0.0
        self.busy_from: float | None = None
        self.window_busy = 0.0
        self.busy_fraction = 0.0
        # decode side
        self.S = 0.0
        self.last_t = 0.0
        self.step_time: float | None = None
        self.batch: dict[RequestId, Job] = {}
        self.heap: list[tuple[float, int, int, Job]] = []
        self.base_kv = 0.0
        self.kv_reserved = 0
        self.kv_capacity = profile.kv_capacity_tokens
        self.kv_base_capacity = self.kv_capacity
        self.pending: deque[Job] = deque()  # waiting for KV memory / a batch slot
        self.pending_tokens = 0  # their KV need (the live router counts it in-flight)
        self.incoming = 0  # admitted, KV in transfer
        self.version = 0
        self.stall_until = 0.0  # the batch makes no progress before this (a request joining it)
        self.prefill_factor = 1.0  # multiplies prefill compute time (layer migration)
        self.decode_factor = 1.0  # multiplies decode step time
        self.offload_phi = 0.0  # share of this worker's layers running on a peer
        self.colo_stepping = False
        self.lent_share = 0.0  # time share spent on a donor's migrated layers
        self.leases = 0  # active migrations touching this worker (one at a time)
        # host contention (SimConfig.shared_host): current slowdowns, and the running
        # prefill chunk (last update, wall seconds left, event version, event payload)
        self.cont_p = 1.0
        self.cont_d = 1.0
        self.chunk_t = 0.0
        self.chunk_left = 0.0
        self.chunk_ver = 0
        self.chunk_arg: tuple | None = None
        self.lagged: tuple | None = (
            None  # (done jobs, tail) of the chunk before (profile.prefill_result_lag)
        )
        self._snap: WorkerLoad | None = None

    # -- busy accounting ----------------------------------------------------------------
    def set_busy(self, now: float, busy: bool) -> None:
        if busy and self.busy_from is None:
            self.busy_from = now
        elif not busy and self.busy_from is not None:
            self.busy_total += now - self.busy_from
            self.busy_from = None

    def busy_until(self, now: float) -> float:
        return self.busy_total + (now - self.busy_from if self.busy_from is not None else 0.0)

    # -- decode counter -------------------------------------------------------------------
    @property
    def decode_paused(self) -> bool:
        return self.prefilling is not None  # colocated: prefill stalls decode

    def advance(self, now: float) -> None:
        if self.batch and self.step_time and not self.decode_paused and not self.colo_stepping:
            self.S += max(0.0, now - max(self.last_t, self.stall_until)) / self.step_time
        self.last_t = now

    def stall(self, now: float, seconds: float) -> None:
        """Hold the decode batch for ``seconds`` more (after any hold already running);
        call after :meth:`advance`."""
        self.stall_until = max(now, self.stall_until) + seconds

    def kv_tokens(self) -> float:
        return self.base_kv + len(self.batch) * self.S

    def join(self, job: Job, steps: int) -> None:
        job.join_s = self.S
        job.finish_step = self.S + steps
        job.decode = self
        self.batch[job.rid] = job
        self.base_kv += job.req.input_len + (job.req.output_len - 1 - steps) - self.S
        heapq.heappush(self.heap, (job.finish_step, job.req.rid, job.gen, job))
        self._snap = None

    def leave(self, job: Job) -> int:
        """Remove ``job`` from the batch; returns its remaining steps."""
        del self.batch[job.rid]
        self.base_kv -= (
            job.req.input_len
            + (job.req.output_len - 1 - (job.finish_step - job.join_s))
            - job.join_s
        )
        job.gen += 1
        self._snap = None
        return max(0, round(job.finish_step - self.S))

    def next_finish(self) -> Job | None:
        h = self.heap
        while h and (h[0][3].gen != h[0][2] or self.batch.get(h[0][3].rid) is not h[0][3]):
            heapq.heappop(h)  # stale: the job left (finished or migrated) since the push
        return h[0][3] if h else None

    def pop_finished(self) -> list[Job]:
        out = []
        while True:
            j = self.next_finish()
            if j is None or j.finish_step > self.S + 1e-6:
                return out
            heapq.heappop(self.heap)
            self.leave(j)
            out.append(j)

    # -- snapshots ------------------------------------------------------------------------
    def load(self, now: float) -> WorkerLoad:
        s = self._snap
        if s is None:
            running = len(self.prefilling) if self.prefilling else 0
            s = self._snap = WorkerLoad(
                worker_id=self.wid,
                tier=self.tier,
                queued_requests=len(self.queue) + len(self.pending),
                running_requests=running + len(self.batch) + self.incoming,
                queued_prefill_tokens=self.queued_tokens,
                inflight_tokens=self.pending_tokens,
                kv_used_tokens=self.kv_reserved,
                kv_total_tokens=self.kv_capacity,
                busy_fraction=self.busy_fraction,
                timestamp=now,
                prefill_speed=1 / self.prefill_factor,
                decode_step_s=self.step_time if self.batch and self.step_time else 0.0,
                kv_waiting_tokens=self.pending_tokens,
            )
        return s

    def dirty(self) -> None:
        self._snap = None

    def running_requests(self) -> list[RunningRequest]:
        return [
            RunningRequest(
                j.rid, int(j.req.input_len + self.S - j.join_s), int(j.finish_step - self.S)
            )
            for j in self.batch.values()
        ]


class LazyRunning(Mapping):
    """Per-worker running lists built only for the workers the balancer asks about."""

    def __init__(self, workers: Mapping[WorkerId, Worker]) -> None:
        self._w = workers

    def __getitem__(self, wid: WorkerId) -> list[RunningRequest]:
        return self._w[wid].running_requests()

    def __iter__(self) -> Iterator[WorkerId]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


class CacheView:
    """The ``CacheOracle`` the cache-aware policies query: the global store, or
    (local mode) the union of nothing; plus each worker's own tiers."""

    def __init__(self, workers: Mapping[WorkerId, Worker], store: PagePrefixTree | None) -> None:
        self.workers, self.store = workers, store

    def global_match(self, page_hashes) -> int:
        return self.store.match(page_hashes) if self.store is not None else 0

    def local_match(self, worker: WorkerId, page_hashes) -> int:
        w = self.workers[worker]
        n = w.hbm.match(page_hashes)
        if w.dram is not None:
            n = max(n, w.dram.match(page_hashes))
        return n
