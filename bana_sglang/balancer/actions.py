"""The balancer's vocabulary: the actions a plan holds (layer, KV-block and
request migration), the plan, the cost model of moving bytes, the model's
shape, the policy's settings, and a running request as the balancer sees it.

Plain frozen data; the policy that produces plans is :mod:`.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bana_sglang.types import RequestId, WorkerId


class BalancerError(ValueError):
    """Unknown balancer name or invalid configuration."""


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class LayerMigration:
    """Coarse: run layers ``[layers[0], layers[1])`` of ``src`` on ``dst``."""

    src: WorkerId
    dst: WorkerId
    layers: tuple[int, int]
    bytes: int
    seconds: float

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True, slots=True)
class KVBlockMigration:
    """Fine: move ``pages`` KV pages of running requests from ``src`` to ``dst``
    (``dst`` computes partial attention over them)."""

    src: WorkerId
    dst: WorkerId
    pages: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RequestMigration:
    """Move one running request (its whole KV) from ``src`` to ``dst``."""

    src: WorkerId
    dst: WorkerId
    request: RequestId
    bytes: int
    seconds: float


Action = LayerMigration | KVBlockMigration | RequestMigration


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...] = ()
    peak_before: float = 0.0
    peak_after: float = 0.0
    reason: str = ""

    @property
    def empty(self) -> bool:
        return not self.actions

    @property
    def seconds(self) -> float:
        return sum(a.seconds for a in self.actions)

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.actions)


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class MigrationCostModel:
    """Seconds to move ``n`` bytes: ``fixed_s + n / bandwidth_bytes_per_s``."""

    bandwidth_bytes_per_s: float
    fixed_s: float = 0.005

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.fixed_s < 0:
            raise BalancerError(f"invalid cost model {self}")

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bandwidth_bytes_per_s

    def max_bytes(self, seconds: float) -> int:
        return max(0, int((seconds - self.fixed_s) * self.bandwidth_bytes_per_s))


@dataclass(frozen=True)
class ModelShape:
    """What the balancer must know of the served model and a worker's speed."""

    num_layers: int
    layer_weight_bytes: int
    kv_bytes_per_token: int
    page_size: int = 512
    prefill_tokens_per_s: float = 10_000.0  # one worker, uncached tokens

    def __post_init__(self) -> None:
        if self.num_layers < 2 or self.page_size < 1 or self.prefill_tokens_per_s <= 0:
            raise BalancerError(f"invalid model shape {self}")


WORKERS_PER_ACTION = 8


@dataclass(frozen=True)
class BalancerConfig:
    imbalance_threshold: float = 1.3  # max U / mean U to start counting
    release_threshold: float = 1.1  # below this the streak resets
    consecutive: int = 3  # observations above threshold before acting
    cooldown_s: float = 20.0  # per worker, after any action touching it
    min_interval_s: float = 2.0  # between non-empty plans
    budget_s: float = 2.0  # total migration seconds per plan
    max_actions: int = 0  # per plan; 0: one per WORKERS_PER_ACTION workers (at least one)
    max_layer_fraction: float = 0.5  # of the donor's layers
    min_gain: float = 0.05  # required drop of the pair's peak U
    min_peak: float = 0.6  # do nothing while every worker is below this
    queue_horizon_s: float = 5.0
    sustained_backlog_s: float = 3.0  # queued prefill work that skips the streak (see above)
    # TPOT guard: a decode peer takes guest layers only while its step, slowed by their
    # time share, stays within tpot_headroom x tpot_slo_s (None: not set, the caller's
    # SLO if it has one; 0: no guard)
    tpot_slo_s: float | None = None
    tpot_headroom: float = 0.8
    # a decode host of guest layers gives them back once its KV usage (resident plus
    # waiting requests) passes this (0: only at the lease's end; see memory_recalls)
    recall_kv_usage: float = 1.0

    def actions_per_plan(self, num_workers: int) -> int:
        return self.max_actions or max(1, num_workers // WORKERS_PER_ACTION)

    def __post_init__(self) -> None:
        if self.release_threshold > self.imbalance_threshold or self.release_threshold < 1:
            raise BalancerError("need 1 <= release_threshold <= imbalance_threshold")
        for name, ok in (
            ("consecutive", self.consecutive >= 1),
            ("max_actions", self.max_actions >= 0),
            ("budget_s", self.budget_s > 0),
            ("sustained_backlog_s", self.sustained_backlog_s > 0),
        ):
            if not ok:
                raise BalancerError(f"invalid balancer config: {name}={getattr(self, name)!r}")
        if not 0 < self.max_layer_fraction < 1:
            raise BalancerError("max_layer_fraction must be in (0, 1)")
        if self.tpot_slo_s is not None and self.tpot_slo_s < 0:
            raise BalancerError(f"tpot_slo_s must be >= 0 (0: no guard), got {self.tpot_slo_s!r}")
        if not 0 < self.tpot_headroom <= 1:
            raise BalancerError(f"tpot_headroom must be in (0, 1], got {self.tpot_headroom!r}")
        if not self.recall_kv_usage >= 0:
            raise BalancerError(
                f"recall_kv_usage must be >= 0 (0: no early recall), got {self.recall_kv_usage!r}"
            )


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A migratable request on a decode worker."""

    request_id: RequestId
    kv_tokens: int
    remaining_tokens: int


# ----------------------------------------------------------------------------- policies
