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
from dataclasses import dataclass

from bana_sglang.balancer.policy import (
    Action,
    KVBlockMigration,
    LayerMigration,
    MigrationCostModel,
    ModelShape,
    RequestMigration,
    get_balancer,
)
from bana_sglang.router.policy import RouteRequest, get_policy
from bana_sglang.router.prefix_tree import PagePrefixTree
from bana_sglang.sim.cluster import CacheView, Job, LazyRunning, SimError, Worker
from bana_sglang.sim.config import SimConfig
from bana_sglang.sim.metrics import RequestRecord, SimResult, summarise
from bana_sglang.sim.profiles import load_profile
from bana_sglang.sim.workloads import SimRequest
from bana_sglang.types import MAX_HOST_SHARE, Tier, WorkerId, split_speeds

logger = logging.getLogger(__name__)

# event kinds
(PREFILL_DONE, PREFILL_TAIL, TRANSFER_DONE, DECODE_TICK, COLO_STEP, TICK, MIG_DONE, LEASE_END) = (
    range(8)
)


@dataclass(eq=False)  # one lease is one migration: compared (and removed) by identity
class _Lease:
    action: Action
    src_prefill: float = 1.0  # multipliers applied at start, divided out at the end
    src_decode: float = 1.0
    dst_mult: float = 1.0
    dst_decode: float = 1.0
    phi: float = 0.0
    tokens: int = 0
    share: float = 0.0


class Simulation:
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
        self._returns: list[_Lease] = []
        self._layer_leases: list[_Lease] = []  # active, in start order
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

    # -- host contention -------------------------------------------------------------------
    def _busy(self, w: Worker, busy: bool) -> None:
        """Mark ``w`` computing or idle; on a shared host, the others' speeds follow."""
        was = w.busy_from is not None
        w.set_busy(self.now, busy)
        if self.cfg.shared_host and was != busy:
            self._contend()

    def _contend(self) -> None:
        """Every worker's slowdown from the others computing on the same cores: a
        running prefill chunk's remaining time and the decode step time are rescaled
        (processor sharing, with the profile's measured factors)."""
        if self._contending:
            self._again = True  # a rescheduled decode batch changed a busy state: go round again
            return
        self._contending = True
        try:
            self._again = True
            while self._again:
                self._again = False
                busy = sum(1 for x in self.workers if x.busy_from is not None)
                for w in self.workers:
                    others = busy - (w.busy_from is not None)
                    p_mult, d_mult, _ = self.p.shared_host_factors(others)
                    if p_mult != w.cont_p:
                        if w.chunk_arg is not None:
                            left = (
                                max(0.0, w.chunk_left - (self.now - w.chunk_t)) * p_mult / w.cont_p
                            )
                            w.chunk_t, w.chunk_left = self.now, left
                            w.chunk_ver += 1
                            self._push(self.now + left, PREFILL_DONE, w, w.chunk_ver)
                        w.cont_p = p_mult
                    if d_mult != w.cont_d:
                        ratio, w.cont_d = d_mult / w.cont_d, d_mult
                        if w.batch:
                            self._set_factors(w, 1.0, ratio)
                        else:  # nothing decoding: no step to reschedule (nor a busy state to touch)
                            w.decode_factor *= ratio
        finally:
            self._contending = False

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

    # -- balancer ------------------------------------------------------------------------
    def _on_tick(self, _a, _b) -> None:
        now, tick = self.now, self.cfg.balance_tick_s
        for w in self.workers:
            b = w.busy_until(now)
            if w.tier is Tier.DECODE:
                # A decode batch is never "idle" while it holds one request; its compute
                # use is the batch-slot occupancy (sampled at the tick).
                w.busy_fraction = min(
                    1.0, (len(w.batch) + w.incoming) / self.p.max_decode_batch + w.lent_share
                )
            else:
                w.busy_fraction = min(1.0, (b - w.window_busy) / tick + w.lent_share)
            w.window_busy = b
            w.dirty()
        for lease in list(self._returns):
            self._try_return(lease)
        if self._layer_leases:
            loads = [w.load(now) for w in self.workers]
            pressed = set(
                self.balancer.memory_recalls(loads, {ls.action.dst for ls in self._layer_leases})
            )
            for lease in [ls for ls in self._layer_leases if ls.action.dst in pressed]:
                logger.debug("t=%.1f recall %s: its host needs the memory", now, lease.action)
                self.early_recalls += 1
                self._on_lease_end(lease, None)
        # (snapshots are cached: only the workers a recall touched are taken again)
        plan = self.balancer.plan(
            [w.load(now) for w in self.workers],
            now,
            LazyRunning(self.by_id),
            engaged=[w.wid for w in self.workers if w.leases],
        )
        for act in plan.actions:
            logger.debug("t=%.1f %s", now, act)
            self._start_action(act)
        self._push(now + tick, TICK)

    def _start_action(self, act: Action) -> None:
        src, dst = self.by_id[act.src], self.by_id[act.dst]
        if src.leases or dst.leases:
            self.refused += 1  # an agent runs one migration at a time
            return
        if isinstance(act, RequestMigration):
            job = src.batch.get(act.request)
            if (
                job is None
                or dst.tier is Tier.PREFILL
                or dst.kv_reserved + job.kv_need > dst.kv_capacity
                or len(dst.batch) + dst.incoming >= self.p.max_decode_batch
            ):
                return
            src.advance(self.now)
            job.steps_left = src.leave(job)
            src.kv_reserved -= job.kv_need
            dst.kv_reserved += job.kv_need
            dst.incoming += 1
            self._push(self.now + act.seconds, TRANSFER_DONE, dst, job)
            self._reschedule(src)
            self._admit(src)
        else:
            src.leases += 1
            dst.leases += 1
            self._push(self.now + act.seconds, MIG_DONE, act)
        self.migrations += 1
        self.migration_bytes += act.bytes

    def _set_factors(self, w: Worker, prefill_mult: float, decode_mult: float) -> None:
        if w.batch and not w.decode_paused and not w.colo_stepping:
            w.advance(self.now)
        w.prefill_factor *= prefill_mult
        w.decode_factor *= decode_mult
        self._reschedule(w)

    def _lease_effects(self, lease: _Lease, sign: int) -> None:
        """Apply (+1) or undo (-1) a lease's speed factors on both workers and the peer's
        time share lent to it."""
        src, dst = self.by_id[lease.action.src], self.by_id[lease.action.dst]
        self._set_factors(src, lease.src_prefill**sign, lease.src_decode**sign)
        self._set_factors(dst, lease.dst_mult**sign, lease.dst_decode**sign)
        dst.lent_share += sign * lease.share

    def _on_mig_done(self, act: Action, _b) -> None:
        src, dst, p = self.by_id[act.src], self.by_id[act.dst], self.p
        lease = _Lease(act)
        if isinstance(act, LayerMigration):
            phi = act.num_layers / p.num_layers
            donor_speed, peer_speed = split_speeds(p.num_layers, act.num_layers, src.busy_fraction)
            lease.phi, lease.share, lease.dst_mult = phi, 1 - peer_speed, 1 / peer_speed
            # Prefill donor: busy (1 - phi) per chunk, the rest pipelines on the peer.
            # Decode donor: a step still runs every layer in sequence, now the peer's
            # share at the peer's (time-shared) speed: no latency gain.
            lease.src_prefill = 1 / donor_speed
            lease.src_decode = (1 - phi) + phi * lease.dst_mult
            # a decode peer's memory-bound steps may hide part of the guest layers' compute
            # (SimConfig.decode_overlap; 0: strict time sharing)
            lease.dst_decode = 1 / (1 - lease.share * (1 - self.cfg.decode_overlap))
            src.offload_phi += phi
            lease.tokens = min(act.bytes // p.kv_bytes_per_token, dst.kv_capacity - dst.kv_reserved)
            dst.kv_capacity -= lease.tokens
            self._lease_effects(lease, +1)
            self._layer_leases.append(lease)
        elif isinstance(act, KVBlockMigration):
            lease.tokens = min(act.pages * self.page, dst.kv_capacity - dst.kv_reserved)
            dst.kv_capacity -= lease.tokens
            src.kv_capacity += lease.tokens
            # Every lender step, the host reads the pages for its partial attention (its
            # time: strict sharing), and each layer of the step waits one round trip.
            step = src.step_time or p.decode_step_seconds(1, 0) * src.decode_factor
            lease.share = min(MAX_HOST_SHARE, p.kv_read_seconds(lease.tokens) / step)
            lease.dst_mult = lease.dst_decode = 1 / (1 - lease.share)
            lease.src_decode = 1 + p.num_layers * p.remote_attention_hop_s / step
            self._lease_effects(lease, +1)
            self._admit(src)
        src.dirty()
        dst.dirty()
        self._push(self.now + self.cfg.lease_s, LEASE_END, lease)

    def _on_lease_end(self, lease: _Lease, _b) -> None:
        act = lease.action
        src, dst = self.by_id[act.src], self.by_id[act.dst]
        if isinstance(act, LayerMigration):
            if lease not in self._layer_leases:  # recalled early; this is its original LEASE_END
                return
            self._layer_leases.remove(lease)
            self._lease_effects(lease, -1)
            src.offload_phi -= lease.phi
            dst.kv_capacity += lease.tokens
            src.leases -= 1
            dst.leases -= 1
            # their snapshots report the speeds and capacity (a worker without a decode
            # batch is not re-snapshotted by _reschedule)
            src.dirty()
            dst.dirty()
            if dst.tier is not Tier.PREFILL:
                self._admit(dst)
        else:
            self._returns.append(lease)
            self._try_return(lease)

    def _try_return(self, lease: _Lease) -> None:
        """Give borrowed KV capacity back once the borrower has room for it."""
        src, dst = self.by_id[lease.action.src], self.by_id[lease.action.dst]
        if src.kv_reserved <= src.kv_capacity - lease.tokens:
            src.kv_capacity -= lease.tokens
            dst.kv_capacity += lease.tokens
            self._lease_effects(lease, -1)
            self._returns.remove(lease)
            src.leases -= 1
            dst.leases -= 1
            self._admit(dst)
            src.dirty()


def simulate(
    config: SimConfig,
    requests: Sequence[SimRequest],
    *,
    system: str = "custom",
    check: bool = False,
) -> SimResult:
    return Simulation(config, requests, system=system, check=check).run()
