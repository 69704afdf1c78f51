"""Simulation configuration and the named systems of the comparison.

A ``SimConfig`` is frozen and validated; ``SYSTEMS`` maps a system name (the
rows of the comparison table) to the settings that define it. Policies are
named, never passed as objects, so every run resolves them through the same
registries as the live system (``bana_sglang.router.policy.get_policy``,
``bana_sglang.balancer.policy.get_balancer``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bana_sglang.balancer.actions import BalancerConfig
from bana_sglang.balancer.policy import BALANCERS
from bana_sglang.router.policy import POLICIES
from bana_sglang.sim.workloads import PAGE


class SimConfigError(ValueError):
    """An invalid simulation configuration (the message names the field)."""


STORES = ("global", "local")


@dataclass(frozen=True)
class SimConfig:
    profile: str = "h100_llama3_8b"
    num_workers: int = 16  # each is ``profile.gpus`` devices
    prefill_fraction: float = 0.5  # PD only: share of workers in the prefill tier
    colocated: bool = False  # every worker does prefill and decode (no PD)
    routing: str = "bana"
    balancer: str = "none"
    store: str = "local"  # second cache tier: one global store, or per-worker DRAM
    layerwise_load: bool = True  # store loads overlap the prefill compute layer by layer
    store_capacity_scale: float = 1.0  # sensitivity knob on the store/DRAM capacity
    store_bandwidth_scale: float = 1.0  # sensitivity knob on the store bandwidth
    balance_tick_s: float = 1.0
    lease_s: float = 30.0  # a migration holds this long, then returns (renewable)
    balancer_config: BalancerConfig = dataclasses.field(default_factory=BalancerConfig)
    slo_ttft_s: float = 10.0
    slo_tpot_s: float = 0.1
    seed: int = 0
    page_tokens: int = PAGE  # tokens per prefix hash of the workload (the trace's block)
    # share of a decode worker's time on a donor's guest layers hidden under its own
    # memory-bound decode steps (0: strict time sharing, the default; a sensitivity knob)
    decode_overlap: float = 0.0
    shared_host: bool = (
        False  # every worker on one host's cores (the profile's contention factors apply)
    )

    def __post_init__(self) -> None:
        if not 0 <= self.decode_overlap < 1:
            raise SimConfigError("decode_overlap must be in [0, 1)")
        if self.page_tokens < 1:
            raise SimConfigError("page_tokens must be >= 1")
        if self.routing not in POLICIES:
            raise SimConfigError(f"routing {self.routing!r}; valid: {', '.join(sorted(POLICIES))}")
        if self.balancer not in BALANCERS:
            raise SimConfigError(
                f"balancer {self.balancer!r}; valid: {', '.join(sorted(BALANCERS))}"
            )
        if self.store not in STORES:
            raise SimConfigError(f"store {self.store!r}; valid: {', '.join(STORES)}")
        if self.num_workers < (1 if self.colocated else 2):
            raise SimConfigError("num_workers: PD needs at least 2 (one per tier)")
        if not self.colocated and not 0 < self.prefill_fraction < 1:
            raise SimConfigError("prefill_fraction must be in (0, 1)")
        if self.colocated and self.balancer != "none":
            raise SimConfigError("balancer: the colocated baseline has no tiers to balance")
        if (
            min(
                self.store_capacity_scale,
                self.store_bandwidth_scale,
                self.balance_tick_s,
                self.lease_s,
            )
            <= 0
        ):
            raise SimConfigError("scales, tick and lease must be positive")

    @property
    def num_prefill(self) -> int:
        if self.colocated:
            return self.num_workers
        return min(self.num_workers - 1, max(1, round(self.num_workers * self.prefill_fraction)))

    def with_(self, **changes) -> SimConfig:
        return dataclasses.replace(self, **changes)


# The comparison's rows. Every PD system has the same workers and P:D split.
SYSTEMS: dict[str, dict] = {
    "bana": dict(routing="bana", store="global", balancer="bana"),
    "bana_no_migration": dict(routing="bana", store="global", balancer="none"),
    "global_cache_aware": dict(routing="global_cache_aware", store="global", balancer="none"),
    "local_cache_aware": dict(routing="local_cache_aware", store="local", balancer="none"),
    "sglang_cache_aware": dict(routing="cache_aware", store="local", balancer="none"),
    "load_only": dict(routing="load_only", store="local", balancer="none"),
    "round_robin": dict(routing="round_robin", store="local", balancer="none"),
    "colocated": dict(routing="load_only", store="local", balancer="none", colocated=True),
}


def system_config(name: str, base: SimConfig | None = None, **overrides) -> SimConfig:
    try:
        settings = SYSTEMS[name]
    except KeyError:
        raise SimConfigError(f"unknown system {name!r}; valid: {', '.join(SYSTEMS)}") from None
    return (base or SimConfig()).with_(**{**settings, **overrides})
