"""The discrete-event simulation of a PD (or colocated) cluster.

One heap of timestamped events; arrivals are merged in from the sorted workload.
Policies are resolved by name through the live system's registries
(``bana_sglang.router.policy.get_policy``, ``bana_sglang.balancer.policy.get_balancer``)
and called with the same snapshot types the live router and balancer use.

Request path (PD): arrival -> ``pick_prefill`` on prefill snapshots -> prefix
match (HBM cache of that worker, then the second tier: the global store, or the
worker's own DRAM) -> chunked prefill (``max_prefill_tokens`` per batch, FCFS)
-> first token (TTFT) -> publish pages -> ``pick_decode`` -> wait for KV memory
and a batch slot -> KV transfer (partly overlapped) -> decode batch -> finish.
Colocated: the same worker decodes; a prefill chunk stalls its decode batch,
and one decode step runs between two chunks (SGLang's non-mixed scheduling).

``Simulation`` is assembled from two mixins: ``speeds.SpeedsMixin`` (host
contention and speed factors) and ``leases.BalancingMixin`` (the balancer's ticks,
migrations and leases); the event kinds are in ``events``.

Invariants: every request finishes exactly once or is counted as rejected
(its KV can never fit a worker); ``kv_reserved <= kv_capacity`` on every worker
after every event (checked when ``check=True``); the run is a deterministic
function of (config, workload).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections.abc import Sequence

from bana_sglang.balancer.actions import MigrationCostModel, ModelShape
from bana_sglang.balancer.policy import get_balancer
from bana_sglang.router.policy import RouteRequest, get_policy
from bana_sglang.router.prefix_tree import PagePrefixTree
from bana_sglang.sim.cluster import CacheView, Job, SimError, Worker
from bana_sglang.sim.config import SimConfig
from bana_sglang.sim.events import (
    COLO_STEP,
    DECODE_TICK,
    LEASE_END,
    MIG_DONE,
    PREFILL_DONE,
    PREFILL_TAIL,
    TICK,
    TRANSFER_DONE,
)
from bana_sglang.sim.leases import BalancingMixin, Lease
from bana_sglang.sim.metrics import RequestRecord, SimResult, summarise
from bana_sglang.sim.profiles import load_profile
from bana_sglang.sim.speeds import SpeedsMixin
from bana_sglang.sim.workloads import SimRequest
from bana_sglang.types import Tier, WorkerId

logger = logging.getLogger(__name__)


class Simulation(SpeedsMixin, BalancingMixin):
    def __init__(
        self,
        config: SimConfig,
        requests: Sequence[SimRequest],
        *,
        system: str = "custom",
        check: bool = False,
    ) -> None:
        self.cfg, self.system, self.check = config, system, check
        self.p = p = load_profile(config.profile)
        self.page = page = config.page_tokens
        self.requests = list(requests)
        per_worker_store = (
            int(p.store_capacity_tokens_per_worker * config.store_capacity_scale) // page
        )
        hbm_pages = int(p.kv_capacity_tokens * p.local_cache_fraction) // page
        dram = per_worker_store if config.store == "local" else None
        self.workers: list[Worker] = []
        if config.colocated:
            for i in range(config.num_workers):
                self.workers.append(Worker(WorkerId(f"c{i}"), Tier.COLOCATED, p, hbm_pages, dram))
        else:
            for i in range(config.num_prefill):
                self.workers.append(Worker(WorkerId(f"p{i}"), Tier.PREFILL, p, hbm_pages, dram))
            for i in range(config.num_workers - config.num_prefill):
                self.workers.append(Worker(WorkerId(f"d{i}"), Tier.DECODE, p, 1, None))
        self.by_id = {w.wid: w for w in self.workers}
        self.prefill_workers = [w for w in self.workers if w.tier is not Tier.DECODE]
        self.decode_workers = [w for w in self.workers if w.tier is not Tier.PREFILL]
        self.store = (
            PagePrefixTree(max(1, per_worker_store * config.num_workers))
            if config.store == "global"
            else None
        )
        self.store_bw_scale = config.store_bandwidth_scale
        self.policy = get_policy(
            config.routing,
            seed=config.seed,
            oracle=CacheView(self.by_id, self.store),
            prefill_time=p.prefill_seconds,
            transfer_time=lambda n: p.store_seconds(n) / self.store_bw_scale,
        )
        bcfg = config.balancer_config
        if bcfg.tpot_slo_s is None:  # not set: the balancer guards the run's own TPOT SLO
            bcfg = dataclasses.replace(bcfg, tpot_slo_s=config.slo_tpot_s)
        self.balancer = get_balancer(
            config.balancer,
            shape=ModelShape(
                p.num_layers,
                p.layer_weight_bytes,
                p.kv_bytes_per_token,
                page,
                p.prefill_tokens_per_s,
            ),
            cost=MigrationCostModel(p.net_bytes_per_s * p.net_efficiency, p.transfer_fixed_s),
            config=bcfg,
        )
        self.events: list[tuple] = []
        self._seq = 0
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.rejected: list[int] = []
        self.migrations = 0
        self.migration_bytes = 0
        self.refused = 0
        self._returns: list[Lease] = []
        self._layer_leases: list[Lease] = []  # active, in start order
        self.early_recalls = 0  # layer leases ended by Balancer.memory_recalls
        self._finished_ids: set[int] = set()
        self._contending = self._again = False

    # -- event plumbing ------------------------------------------------------------------
    def _push(self, t: float, kind: int, a=None, b=None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, a, b))

    def run(self) -> SimResult:
        t_wall = time.perf_counter()
        reqs, n, i = self.requests, len(self.requests), 0
        if self.cfg.balancer != "none":
            self._push(self.cfg.balance_tick_s, TICK)
        handlers = {
            PREFILL_DONE: self._on_prefill_done,
            PREFILL_TAIL: self._on_prefill_tail,
            TRANSFER_DONE: self._on_transfer_done,
            DECODE_TICK: self._on_decode_tick,
            COLO_STEP: self._on_colo_step,
            TICK: self._on_tick,
            MIG_DONE: self._on_mig_done,
            LEASE_END: self._on_lease_end,
        }
        ev = self.events
        while i < n or ev:
            if i < n and (not ev or reqs[i].arrival <= ev[0][0]):
                self.now = reqs[i].arrival
                self._on_arrival(reqs[i])
                i += 1
                continue
            t, _, kind, a, b = heapq.heappop(ev)
            self.now = t
            if kind == TICK and i >= n and len(self.records) + len(self.rejected) >= n:
                continue  # nothing left to balance
            handlers[kind](a, b)
            if self.check:
                self._check()
        done = len(self.records) + len(self.rejected)
        if done != n:
            raise SimError(f"{self.system}: {n - done} of {n} requests never finished")
        busy = [w.busy_until(self.now) for w in self.prefill_workers]
        return summarise(
            self.system,
            self.records,
            n,
            busy=busy,
            migrations=self.migrations,
            migration_bytes=self.migration_bytes,
            slo_ttft=self.cfg.slo_ttft_s,
            slo_tpot=self.cfg.slo_tpot_s,
            wall_s=time.perf_counter() - t_wall,
            rejected=len(self.rejected),
            early_recalls=self.early_recalls,
        )

    def _check(self) -> None:
        for w in self.workers:
            if w.kv_reserved > w.kv_capacity or w.kv_reserved < 0:
                raise SimError(f"{w.wid}: KV reserved {w.kv_reserved} > capacity {w.kv_capacity}")

    # -- arrival and prefill -------------------------------------------------------------
    def _on_arrival(self, req: SimRequest) -> None:
        p, now = self.p, self.now
        need = req.input_len + req.output_len
        if need > p.kv_capacity_tokens:
            logger.warning(
                "request %s needs %s KV tokens > capacity %s: rejected",
                req.rid,
                need,
                p.kv_capacity_tokens,
            )
            self.rejected.append(req.rid)
            return
        job = Job(req)
        rr = RouteRequest(job.rid, req.input_len, req.hashes, req.output_len, self.page)
        w = self.by_id[self.policy.pick_prefill(rr, [x.load(now) for x in self.prefill_workers])]
        hbm = w.hbm.match(req.hashes, touch=True)
        if self.store is not None:
            second = self.store.match(req.hashes, touch=True)
        elif w.dram is not None:
            second = w.dram.match(req.hashes, touch=True)
        else:
            second = 0
        job.hbm_tokens = rr.cached_tokens(hbm)
        job.store_tokens = rr.cached_tokens(max(hbm, second)) - job.hbm_tokens
        job.new_tokens = req.input_len - job.cached_tokens
        job.prefill = w
        w.queue.append(job)
        w.queued_tokens += job.new_tokens
        w.dirty()
        self._kick(w)

    def _kick(self, w: Worker) -> None:
        """Start a prefill chunk on ``w`` if it is free to run one."""
        if w.prefilling is not None or w.colo_stepping or not w.queue:
            return
        p, now = self.p, self.now
        colocated = w.tier is Tier.COLOCATED
        budget = p.max_prefill_tokens
        items: list[tuple[Job, int]] = []
        flops = load_t = 0.0
        for job in w.queue:
            if colocated and job.done_tokens == 0 and not job.loaded:
                if w.kv_reserved + job.kv_need > w.kv_capacity:
                    break  # head of line waits for decode to free memory
                w.kv_reserved += job.kv_need
            if not job.loaded:
                load_t += p.store_seconds(job.store_tokens) / self.store_bw_scale
                job.loaded = True
            take = min(budget, job.new_tokens - job.done_tokens)
            before = job.cached_tokens + job.done_tokens
            flops += p.prefill_flops(take, before)
            job.done_tokens += take
            budget -= take
            items.append((job, take))
            if budget <= 0:
                break
        if not items:
            return
        for job, _ in items:
            if job.done_tokens == job.new_tokens and w.queue and w.queue[0] is job:
                w.queue.popleft()
        full = flops / p.flops_per_s
        compute = p.prefill_fixed_s + full * w.prefill_factor  # this worker's busy time
        extra = max(0.0, load_t - compute) if self.cfg.layerwise_load else load_t
        # Layers running on a peer: the worker is free after its own layers (the next
        # chunk pipelines behind), but this chunk's tokens finish after the peer's
        # layers plus the hidden-state hop.
        tail = 0.0
        if w.offload_phi > 0:
            n_tok = sum(t for _, t in items)
            tail = full * w.offload_phi + p.net_seconds(n_tok * p.hidden_size * 2)
        if colocated:
            w.advance(now)  # decode stalls from here until the chunk ends
            w.version += 1  # the pending decode tick is void
        w.prefilling = [j for j, _ in items]
        w.chunk_t, w.chunk_left, w.chunk_arg = now, (compute + extra) * w.cont_p, (items, tail)
        w.chunk_ver += 1
        self._push(now + w.chunk_left, PREFILL_DONE, w, w.chunk_ver)
        self._busy(w, True)
        w.dirty()

    def _on_prefill_done(self, w: Worker, version: int) -> None:
        if version != w.chunk_ver:
            return  # rescheduled since (host contention changed)
        now = self.now
        items, tail = w.chunk_arg
        w.chunk_arg = None
        w.prefilling = None
        w.last_t = now
        done = []
        for job, take in items:
            w.queued_tokens -= take
            if job.done_tokens == job.new_tokens:
                done.append(job)
        if not self.p.prefill_result_lag:
            self._emit(w, done, tail)
            self._after_chunk(w)
            return
        # SGLang's overlap loop: the next batch computes before this one's results go out
        lagged, w.lagged = w.lagged, None
        if lagged is not None:
            self._emit(w, *lagged)
        self._after_chunk(w)
        if w.prefilling is not None:
            w.lagged = (done, tail)
        else:
            self._emit(w, done, tail)

    def _emit(self, w: Worker, done: list[Job], tail: float) -> None:
        if tail > 0:
            self._push(self.now + tail, PREFILL_TAIL, w, done)
        elif done:
            self._complete_prefill(w, done)

    def _on_prefill_tail(self, w: Worker, done: list[Job]) -> None:
        self._complete_prefill(w, done)

    def _complete_prefill(self, w: Worker, done: list[Job]) -> None:
        now = self.now
        for job in done:
            job.first_token = now
            h = job.req.hashes
            if h:
                w.hbm.insert(h)
                if self.store is not None:
                    self.store.insert(h)
                elif w.dram is not None:
                    w.dram.insert(h)
            if job.steps_left == 0:
                self._finish(job, w if w.tier is Tier.COLOCATED else None)
            elif w.tier is Tier.COLOCATED:
                w.join(job, job.steps_left)
            else:
                rr = RouteRequest(job.rid, job.req.input_len, h, job.req.output_len, self.page)
                d = self.by_id[
                    self.policy.pick_decode(rr, [x.load(now) for x in self.decode_workers])
                ]
                d.pending.append(job)
                d.pending_tokens += job.kv_need
                d.dirty()
                self._admit(d)
        w.dirty()

    def _after_chunk(self, w: Worker) -> None:
        now = self.now
        w.dirty()
        if w.tier is Tier.COLOCATED:
            if w.queue and w.batch:
                w.colo_stepping = True
                st = self.p.decode_step_seconds(len(w.batch), w.kv_tokens()) * w.decode_factor
                self._push(now + st, COLO_STEP, w)
                return
            self._kick(w)
            if w.prefilling is None:
                self._reschedule(w)
            return
        self._kick(w)
        if w.prefilling is None:
            self._busy(w, False)

    def _on_colo_step(self, w: Worker, _b) -> None:
        w.colo_stepping = False
        w.S += 1.0
        w.last_t = self.now
        for job in w.pop_finished():
            self._finish(job, w)
        self._kick(w)
        if w.prefilling is None:
            self._reschedule(w)

    # -- decode --------------------------------------------------------------------------
    def _admit(self, d: Worker) -> None:
        p, now = self.p, self.now
        while d.pending:
            job = d.pending[0]
            if (
                len(d.batch) + d.incoming >= p.max_decode_batch
                or d.kv_reserved + job.kv_need > d.kv_capacity
            ):
                break
            d.pending.popleft()
            d.pending_tokens -= job.kv_need
            d.kv_reserved += job.kv_need
            d.incoming += 1
            t = (
                p.net_seconds(job.req.input_len * p.kv_bytes_per_token)
                * (1 - p.pd_transfer_overlap)
                + p.pd_handoff_s
            )
            self._push(now + t, TRANSFER_DONE, d, job)
        d.dirty()

    def _on_transfer_done(self, d: Worker, job: Job) -> None:
        d.incoming -= 1
        d.advance(self.now)
        # admitting it holds the whole batch (a CPU host's cores; 0 on GPUs); one that
        # lands while an earlier join's hold runs is admitted with it, in one batch
        hold = self.p.join_stall_seconds(job.req.input_len, admission=d.stall_until <= self.now)
        if hold > 0:  # longer while the host's other workers compute (shared host)
            if self.cfg.shared_host:
                hold *= self.p.shared_host_factors(
                    sum(1 for x in self.workers if x is not d and x.busy_from is not None)
                )[2]
            d.stall(self.now, hold)
        d.join(job, job.steps_left)
        self._reschedule(d)

    def _reschedule(self, w: Worker) -> None:
        if w.decode_paused or w.colo_stepping:
            return
        now = self.now
        w.version += 1
        w.last_t = now
        if not w.batch:
            w.step_time = None
            if w.prefilling is None:
                self._busy(w, False)
            return
        w.step_time = self.p.decode_step_seconds(len(w.batch), w.kv_tokens()) * w.decode_factor
        w.dirty()  # its snapshot reports the step time
        nxt = w.next_finish()
        if nxt is None:
            raise SimError(f"{w.wid}: batch of {len(w.batch)} without a finish entry")
        held = max(0.0, w.stall_until - now)
        self._push(
            now + held + max(0.0, nxt.finish_step - w.S) * w.step_time, DECODE_TICK, w, w.version
        )
        self._busy(w, True)

    def _on_decode_tick(self, w: Worker, version: int) -> None:
        if version != w.version:
            return
        w.advance(self.now)
        colocated = w.tier is Tier.COLOCATED
        for job in w.pop_finished():
            self._finish(job, w)
        if colocated:
            self._kick(w)
            if w.prefilling is not None:
                return
        else:
            self._admit(w)
        self._reschedule(w)

    def _finish(self, job: Job, holder: Worker | None) -> None:
        now = self.now
        job.finish = now
        if holder is not None:
            holder.kv_reserved -= job.kv_need
            holder.dirty()
        r = job.req
        if r.rid in self._finished_ids:
            raise SimError(f"request {r.rid} finished twice")
        self._finished_ids.add(r.rid)
        self.records.append(
            RequestRecord(
                r.rid,
                r.arrival,
                job.first_token,
                now,
                r.input_len,
                r.output_len,
                job.hbm_tokens,
                job.store_tokens,
                job.prefill.wid if job.prefill else "",
                holder.wid if holder is not None else "",
                self._floor(job),
            )
        )
        self.policy.on_finish(
            RouteRequest(job.rid, r.input_len, r.hashes, r.output_len, self.page),
            job.prefill.wid if job.prefill else WorkerId(""),
        )

    def _floor(self, job: Job) -> float:
        """``job``'s TTFT had it arrived at an idle worker with the same cache hits: its
        chunks back to back, plus what of its store load the first chunk does not hide
        (``_kick``'s accounting, without queueing, contention or migration)."""
        p = self.p
        compute = p.lone_prefill_seconds(job.new_tokens, job.cached_tokens)
        load = p.store_seconds(job.store_tokens) / self.store_bw_scale
        if self.cfg.layerwise_load:
            first = p.prefill_seconds(min(p.max_prefill_tokens, job.new_tokens), job.cached_tokens)
            return compute + max(0.0, load - first)
        return compute + load


def simulate(
    config: SimConfig,
    requests: Sequence[SimRequest],
    *,
    system: str = "custom",
    check: bool = False,
) -> SimResult:
    return Simulation(config, requests, system=system, check=check).run()
