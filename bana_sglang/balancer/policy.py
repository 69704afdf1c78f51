"""Balancer: a pure policy from load snapshots to a migration plan.

Given every worker's ``WorkerLoad`` (the router's snapshot type) and a cost model
of moving bytes, ``plan`` returns a ``Plan``: a tuple of typed actions (layer
migration, KV-block migration, request migration) or nothing. The objective is
BanaServe's: lower the peak device utilisation ``max_g U_g`` while the plan's
migration time (sum of its actions' ``seconds``, as if serialised) stays within
``budget_s``. The search is greedy (hottest donor, coolest peer, the amount that
equalises the pair), which is what a per-tick controller can afford.

Utilisation ``U_g`` (dimensionless, may exceed 1 when a queue builds):
- prefill: ``busy_fraction + prefill_backlog_tokens / (prefill_tokens_per_s * queue_horizon_s)``
  (the queued prompt tokens at the worker's current speed: a donor whose layers
  partly run on a peer drains its queue faster, the peer slower; see
  :func:`split_speeds`)
- decode: ``max(busy_fraction, kv_usage)``; colocated: the max of both.

A layer migration adds compute to its peer and puts the layers' weights in the
peer's KV memory, so its share is sized against the peer's compute part of ``U``
(``compute_utilisation``: a decode worker with much KV in use may still have most
of its compute free), and the prediction takes the larger of the peer's compute
after and its memory after. With ``tpot_slo_s`` set, a decode peer takes only the
share that keeps its step (``WorkerLoad.decode_step_s``) within
``tpot_headroom x tpot_slo_s`` (the guest layers take ``share`` of its time, so its
step becomes ``step / (1 - share)``).

Invariants:
- Pure with respect to its inputs except for its own controller state (streak,
  cool-downs, last plan time); the live balancer and the simulator call the same
  object the same way.
- Hysteresis: no action unless ``max U / mean U > imbalance_threshold`` for
  ``consecutive`` observations in a row; the streak only resets once the ratio
  falls below ``release_threshold``. The streak filters out transient peaks of
  measured busy time; a prefill worker's queued prompt tokens are not transient
  (they will keep it busy for ``queued / prefill_tokens_per_s`` seconds at
  least), so a backlog of ``sustained_backlog_s`` or more counts as sustained at
  once (a long prompt gets its layers split while it is still being computed).
- Rate limit: at most ``max_actions`` actions per plan (0: one per 8 workers, at
  least one, so that a large cluster is not served one pair at a time), at least
  ``min_interval_s`` between non-empty plans, each worker in at most one action
  per ``cooldown_s``, a worker still in a migration (``engaged``) in none, and
  never the reverse of a recent action (no ping-pong).
- Every returned action predicts a lower peak; the plan's ``seconds`` <= budget.

Memory recall (:meth:`Balancer.memory_recalls`): guest layers on a decode peer
hold memory its own requests may come to need (their weights, and on a GPU host
their KV area). Once a host's used KV plus the KV of the requests waiting for its
memory (``WorkerLoad.kv_waiting_tokens``) passes ``recall_kv_usage`` of its
pool (default 1: requests wait for memory it does not have), the balancer names
it, and the caller (the live controller, the simulator) recalls the layers it
hosts at once instead of at the lease's end or after a calm period. It is the
layer counterpart of a KV host reclaiming lent pages when its own pool runs low
(``migrate.kv.host``).
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from bana_sglang.balancer.actions import (
    Action,
    BalancerConfig,
    BalancerError,
    KVBlockMigration,
    LayerMigration,
    MigrationCostModel,
    ModelShape,
    Plan,
    RequestMigration,
    RunningRequest,
)
from bana_sglang.registry import Registry
from bana_sglang.types import MIN_DONOR_BUSY, Tier, WorkerId, WorkerLoad

logger = logging.getLogger(__name__)


def compute_utilisation(w: WorkerLoad, shape: ModelShape, cfg: BalancerConfig) -> float:
    """The compute part of ``U``: busy time, plus the queued prompt work of a worker
    that prefills."""
    if w.tier is Tier.DECODE:
        return w.busy_fraction
    return w.busy_fraction + w.prefill_backlog_tokens / (
        shape.prefill_tokens_per_s * cfg.queue_horizon_s
    )


def utilisation(w: WorkerLoad, shape: ModelShape, cfg: BalancerConfig) -> float:
    compute = compute_utilisation(w, shape, cfg)
    return compute if w.tier is Tier.PREFILL else max(compute, w.kv_usage)


class Balancer(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def plan(
        self,
        loads: Sequence[WorkerLoad],
        now: float,
        running: Mapping[WorkerId, Sequence[RunningRequest]] | None = None,
        engaged: Collection[WorkerId] = (),
    ) -> Plan:
        """``running``: each decode worker's movable requests; ``engaged``: workers
        still taking part in a migration (an agent runs one at a time), never
        picked as donor or peer."""

    def memory_recalls(
        self, loads: Sequence[WorkerLoad], hosts: Collection[WorkerId]
    ) -> list[WorkerId]:
        """Of ``hosts`` (workers now running a donor's guest layers), those that need
        their memory back: the caller recalls every layer migration they host. The
        base policy never asks (a lease ends when its owner says)."""
        return []


class NoneBalancer(Balancer):
    """Static PD (DistServe-like): never migrates."""

    name = "none"

    def __init__(self, **_: object) -> None:
        pass

    def plan(self, loads, now, running=None, engaged=()):
        return Plan(reason="static")


@dataclass
class _State:
    streak: int = 0
    last_plan: float = -math.inf
    busy_until: dict[WorkerId, float] = field(default_factory=dict)
    recent: dict[tuple[WorkerId, WorkerId], float] = field(default_factory=dict)


class BanaBalancer(Balancer):
    """Greedy peak-shaving with hysteresis (see the module docstring)."""

    name = "bana"

    def __init__(
        self, *, shape: ModelShape, cost: MigrationCostModel, config: BalancerConfig | None = None
    ) -> None:
        self.shape, self.cost, self.config = shape, cost, config or BalancerConfig()
        self.state = _State()

    def plan(self, loads, now, running=None, engaged=()):
        cfg, st = self.config, self.state
        if len(loads) < 2:
            return Plan(reason="fewer than two workers")
        u = {w.worker_id: utilisation(w, self.shape, cfg) for w in loads}
        peak, mean = max(u.values()), sum(u.values()) / len(u)
        ratio = peak / mean if mean > 0 else 1.0
        imbalanced = ratio > cfg.imbalance_threshold and peak >= cfg.min_peak
        if imbalanced:
            st.streak += 1
        elif ratio < cfg.release_threshold or peak < cfg.min_peak:
            st.streak = 0
        backlog = (
            max((w.prefill_backlog_tokens for w in loads if w.tier is not Tier.DECODE), default=0)
            / self.shape.prefill_tokens_per_s
        )
        sustained = imbalanced and backlog >= cfg.sustained_backlog_s
        if st.streak < cfg.consecutive and not sustained:
            return Plan(peak_before=peak, peak_after=peak, reason=f"streak {st.streak}")
        if now - st.last_plan < cfg.min_interval_s:
            return Plan(peak_before=peak, peak_after=peak, reason="rate limited")
        by_id = {w.worker_id: w for w in loads}
        engaged = set(engaged)
        free = [
            w
            for w in loads
            if w.worker_id not in engaged and st.busy_until.get(w.worker_id, -math.inf) <= now
        ]
        hot_order = sorted(free, key=lambda w: -u[w.worker_id])
        actions: list[Action] = []
        used: set[WorkerId] = set()
        budget = cfg.budget_s
        max_actions = cfg.actions_per_plan(len(loads))
        for hot in hot_order:
            if len(actions) >= max_actions or u[hot.worker_id] < cfg.min_peak:
                break
            if hot.worker_id in used:
                continue
            colds = sorted(
                (w for w in free if w.worker_id not in used and w.worker_id != hot.worker_id),
                key=lambda w: u[w.worker_id],
            )
            for cold in colds:
                if (
                    st.recent.get((cold.worker_id, hot.worker_id), -math.inf)
                    > now - 2 * cfg.cooldown_s
                ):
                    continue  # would reverse a recent migration
                act = self._pair_action(
                    hot, cold, u, budget, (running or {}).get(hot.worker_id, ())
                )
                if act is not None:
                    actions.append(act)
                    budget -= act.seconds
                    used.update((hot.worker_id, cold.worker_id))
                    u.update(self._predict(act, by_id, u))
                    break
        if not actions:
            return Plan(peak_before=peak, peak_after=peak, reason="no beneficial action")
        st.last_plan = now
        for a in actions:
            st.busy_until[a.src] = st.busy_until[a.dst] = now + cfg.cooldown_s
            st.recent[(a.src, a.dst)] = now
        after = max(u.values())
        reason = "rebalance" if st.streak >= cfg.consecutive else f"prefill backlog {backlog:.1f}s"
        logger.info(
            "balancer plan at %.2fs: %s actions, peak %.3f -> %.3f (%s)",
            now,
            len(actions),
            peak,
            after,
            reason,
        )
        st.streak = 0
        return Plan(tuple(actions), peak_before=peak, peak_after=after, reason=reason)

    def memory_recalls(self, loads, hosts):
        """Decode hosts whose used KV plus the KV of the requests waiting for their
        memory (``WorkerLoad.kv_waiting_tokens``) passes ``recall_kv_usage`` of their
        pool, i.e. requests wait for memory the guest layers hold. ``inflight_tokens``
        is not used: live it counts resident requests too. A prefill host is never
        named: its memory holds no waiting decode batch."""
        limit, hosts = self.config.recall_kv_usage, set(hosts)
        if not limit or not hosts:
            return []
        out = []
        for w in loads:
            if w.worker_id not in hosts or w.tier is Tier.PREFILL or w.kv_waiting_tokens <= 0:
                continue
            need = (w.kv_used_tokens + w.kv_waiting_tokens) / max(1, w.kv_total_tokens)
            if need > limit:
                logger.info(
                    "balancer: %s needs its memory back (used + waiting KV %.2f of its pool > %.2f)",
                    w.worker_id,
                    need,
                    limit,
                )
                out.append(w.worker_id)
        return out

    # -- one donor/peer pair -------------------------------------------------------
    def _pair_action(
        self,
        hot: WorkerLoad,
        cold: WorkerLoad,
        u: dict[WorkerId, float],
        budget: float,
        running: Sequence[RunningRequest],
    ) -> Action | None:
        cfg = self.config
        uh, uc = u[hot.worker_id], u[cold.worker_id]
        if uh <= 0 or uh - uc < 2 * cfg.min_gain:
            return None
        memory_bound = hot.tier is not Tier.PREFILL and hot.kv_usage >= hot.busy_fraction
        if memory_bound:
            if cold.tier is Tier.PREFILL:
                return None  # a prefill peer has no use for a decode batch's KV
            act = self._memory_action(hot, cold, budget, running)
        else:
            act = self._layer_action(hot, cold, uh, uc, budget)
        if act is None:
            return None
        pred = self._predict(act, {hot.worker_id: hot, cold.worker_id: cold}, u)
        if max(pred.values()) > max(uh, uc) - cfg.min_gain:
            return None
        return act

    def _layer_action(self, hot, cold, uh, uc, budget) -> LayerMigration | None:
        shape, cfg = self.shape, self.config
        # the layers add compute to the peer: equalise against its compute, not its KV usage
        uc = compute_utilisation(cold, shape, cfg)
        phi = min((uh - uc) / (2 * uh), cfg.max_layer_fraction, self._tpot_cap(hot, cold))
        k = int(phi * shape.num_layers)
        k = min(k, self.cost.max_bytes(budget) // max(1, shape.layer_weight_bytes))
        # The peer must hold the weights in memory it does not need for KV.
        room = cold.kv_free_tokens * shape.kv_bytes_per_token
        k = min(k, room // max(1, shape.layer_weight_bytes))
        if k < 1:
            return None
        nbytes = k * shape.layer_weight_bytes
        start = shape.num_layers - k  # the tail layers: the donor streams hidden states
        return LayerMigration(
            hot.worker_id,
            cold.worker_id,
            (start, shape.num_layers),
            nbytes,
            self.cost.seconds(nbytes),
        )

    def _tpot_cap(self, hot: WorkerLoad, cold: WorkerLoad) -> float:
        """The largest share of ``hot``'s layers a decode peer may run without its step
        passing ``tpot_headroom x tpot_slo_s`` (1: no guard applies). The guest layers
        take ``share = phi / (1 - phi) x donor busy`` of its time (:func:`split_speeds`),
        so its step becomes ``step / (1 - share)``."""
        slo = self.config.tpot_slo_s
        if not slo or cold.tier is Tier.PREFILL or cold.decode_step_s <= 0:
            return 1.0
        share = 1 - cold.decode_step_s / (self.config.tpot_headroom * slo)
        if share <= 0:
            return 0.0
        busy = max(MIN_DONOR_BUSY, hot.busy_fraction)
        return share / (busy + share)

    def _memory_action(self, hot, cold, budget, running) -> Action | None:
        shape = self.shape
        th, tc = max(1, hot.kv_total_tokens), max(1, cold.kv_total_tokens)
        uh_tok = hot.kv_used_tokens + hot.inflight_tokens
        uc_tok = cold.kv_used_tokens + cold.inflight_tokens
        target = (uh_tok * tc - uc_tok * th) / (th + tc)  # tokens that equalise usage
        cap = self.cost.max_bytes(budget) // shape.kv_bytes_per_token
        target = min(target, cap, cold.kv_free_tokens)
        if target < shape.page_size:
            return None
        fitting = [r for r in running if r.kv_tokens <= target and r.remaining_tokens > 0]
        if fitting:
            r = max(fitting, key=lambda r: (r.kv_tokens, r.remaining_tokens, r.request_id))
            nbytes = r.kv_tokens * shape.kv_bytes_per_token
            return RequestMigration(
                hot.worker_id, cold.worker_id, r.request_id, nbytes, self.cost.seconds(nbytes)
            )
        pages = int(target // shape.page_size)
        nbytes = pages * shape.page_size * shape.kv_bytes_per_token
        return KVBlockMigration(
            hot.worker_id, cold.worker_id, pages, nbytes, self.cost.seconds(nbytes)
        )

    def _predict(
        self, act: Action, by_id: Mapping[WorkerId, WorkerLoad], u: Mapping[WorkerId, float]
    ) -> dict[WorkerId, float]:
        """Utilisations of the pair after ``act`` (first-order model)."""
        uh, uc = u[act.src], u[act.dst]
        if isinstance(act, LayerMigration):
            # two resources on the peer: the donor's share of compute, and the weights in
            # its KV memory (a decode peer's U is the larger of the two)
            phi = act.num_layers / self.shape.num_layers
            cold = by_id[act.dst]
            compute = compute_utilisation(cold, self.shape, self.config) + phi * uh
            if cold.tier is Tier.PREFILL:
                return {act.src: uh * (1 - phi), act.dst: compute}
            memory = cold.kv_usage + act.bytes / self.shape.kv_bytes_per_token / max(
                1, cold.kv_total_tokens
            )
            return {act.src: uh * (1 - phi), act.dst: max(compute, memory)}
        hot, cold = by_id[act.src], by_id[act.dst]
        tokens = act.bytes // self.shape.kv_bytes_per_token
        dh = tokens / max(1, hot.kv_total_tokens)
        dc = tokens / max(1, cold.kv_total_tokens)
        return {
            act.src: max(hot.busy_fraction, hot.kv_usage - dh),
            act.dst: max(uc, cold.kv_usage + dc),
        }


BALANCERS: Registry[Balancer] = Registry(
    "balancer", (BanaBalancer, NoneBalancer), error=BalancerError
)
DEFAULT_BALANCER = "bana"


def get_balancer(name: str = DEFAULT_BALANCER, **kwargs) -> Balancer:
    """A fresh balancer by registry name; unknown names list the valid ones."""
    return BALANCERS.create(name, **kwargs)
