"""Balancing inside the simulation: the balancer's ticks, the migrations it plans,
and the leases those migrations open and close (a mixin of ``Simulation``).

A tick samples every worker's busy fraction, returns borrowed KV capacity where
the borrower has room, recalls layer leases whose peer needs the memory
(``Balancer.memory_recalls``), then asks ``Balancer.plan`` for actions. A request
migration moves a decoding request at once; a layer or KV-block migration runs
for ``act.seconds`` (``MIG_DONE``) and then holds a lease for ``SimConfig.lease_s``
(``LEASE_END``) during which both workers' speeds and capacities are changed.

Invariants: an agent runs one migration at a time (a worker with a lease refuses
another); a lease's speed factors are divided out exactly as they were applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bana_sglang.balancer.actions import Action, KVBlockMigration, LayerMigration, RequestMigration
from bana_sglang.sim.cluster import LazyRunning
from bana_sglang.sim.events import LEASE_END, MIG_DONE, TICK, TRANSFER_DONE
from bana_sglang.types import MAX_HOST_SHARE, Tier, split_speeds

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # one lease is one migration: compared (and removed) by identity
class Lease:
    action: Action
    src_prefill: float = 1.0  # multipliers applied at start, divided out at the end
    src_decode: float = 1.0
    dst_mult: float = 1.0
    dst_decode: float = 1.0
    phi: float = 0.0
    tokens: int = 0
    share: float = 0.0


class BalancingMixin:
    """The balancer's half of ``Simulation``: it uses the engine's clock (``now``),
    workers (``workers``, ``by_id``), profile ``p``, config ``cfg``, ``balancer`` and
    lease state (``_returns``, ``_layer_leases``, the counters), and its
    ``_push``, ``_admit``, ``_reschedule`` and ``_set_factors``."""

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

    def _lease_effects(self, lease: Lease, sign: int) -> None:
        """Apply (+1) or undo (-1) a lease's speed factors on both workers and the peer's
        time share lent to it."""
        src, dst = self.by_id[lease.action.src], self.by_id[lease.action.dst]
        self._set_factors(src, lease.src_prefill**sign, lease.src_decode**sign)
        self._set_factors(dst, lease.dst_mult**sign, lease.dst_decode**sign)
        dst.lent_share += sign * lease.share

    def _on_mig_done(self, act: Action, _b) -> None:
        src, dst, p = self.by_id[act.src], self.by_id[act.dst], self.p
        lease = Lease(act)
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

    def _on_lease_end(self, lease: Lease, _b) -> None:
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

    def _try_return(self, lease: Lease) -> None:
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
