"""The shared vocabulary of routing, balancing and simulation (torch-free, no I/O).

The router, the balancer and the simulator all speak of workers, their tiers
and their load snapshots; the types live here so that none of them has to
import another to name them.

- ``WorkerLoad``: one worker's load snapshot (frozen). Token counts are tokens,
  times are seconds, ``busy_fraction`` is in [0, 1].
- :func:`split_speeds`: the prefill speeds of a donor and its peer while some of
  the donor's layers run on the peer; the router derives them from the agents'
  placements and the simulator applies them, so both read the same numbers.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import NewType

WorkerId = NewType("WorkerId", str)
RequestId = NewType("RequestId", str)


class Tier(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # one worker does both (the non-PD baseline)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's load at ``timestamp`` (seconds, the caller's clock)."""

    worker_id: WorkerId
    tier: Tier
    queued_requests: int = 0
    running_requests: int = 0
    queued_prefill_tokens: int = 0  # uncached prompt tokens waiting for prefill
    inflight_tokens: int = 0  # KV tokens committed but not yet resident (reservations)
    kv_used_tokens: int = 0
    kv_total_tokens: int = 1
    busy_fraction: float = 0.0
    timestamp: float = 0.0
    # prefill rate relative to this worker alone: > 1 while a peer executes some of its
    # layers (it computes only the rest), < 1 while it executes a donor's layers
    # (``migrate.balancer.split_speeds``); 1 without a layer migration
    prefill_speed: float = 1.0
    # seconds per decode step of its running batch (the inter-token time it gives its
    # requests now); 0: unknown or nothing decoding
    decode_step_s: float = 0.0
    # KV tokens of requests waiting on this worker for memory it has not allocated them
    # (live: SGLang's decode prealloc and retracted queues, from /v1/loads; simulated:
    # the requests queued for a decode worker's memory). Unlike ``inflight_tokens``
    # (live: every routed, unfinished request's tokens) it never counts resident KV.
    kv_waiting_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prefill_speed > 0:
            raise ValueError(
                f"WorkerLoad.prefill_speed must be positive, got {self.prefill_speed!r}"
            )
        if not self.decode_step_s >= 0:
            raise ValueError(f"WorkerLoad.decode_step_s must be >= 0, got {self.decode_step_s!r}")
        if self.kv_waiting_tokens < 0:
            raise ValueError(
                f"WorkerLoad.kv_waiting_tokens must be >= 0, got {self.kv_waiting_tokens!r}"
            )

    @property
    def prefill_backlog_tokens(self) -> float:
        """The queue in nominal tokens (what it takes this worker, at its current speed,
        to compute ``queued_prefill_tokens``): what load-aware policies compare."""
        return self.queued_prefill_tokens / self.prefill_speed

    @property
    def kv_free_tokens(self) -> int:
        return max(0, self.kv_total_tokens - self.kv_used_tokens - self.inflight_tokens)

    @property
    def kv_usage(self) -> float:
        return (self.kv_used_tokens + self.inflight_tokens) / max(1, self.kv_total_tokens)

    @property
    def num_requests(self) -> int:
        return self.queued_requests + self.running_requests

    def serves(self, tier: Tier) -> bool:
        return self.tier is tier or self.tier is Tier.COLOCATED


def load_from_json(d: dict) -> WorkerLoad:
    """A ``WorkerLoad`` from its JSON form (the router's ``/bana/router/workers``); unknown keys are ignored."""
    fields = {f.name for f in dataclasses.fields(WorkerLoad)}
    return WorkerLoad(**{**{k: v for k, v in d.items() if k in fields}, "tier": Tier(d["tier"])})


MAX_HOST_SHARE = 0.8  # of a peer's time its guest layers may take (its own work keeps the rest)
MIN_DONOR_BUSY = 0.2  # a donor's guest layers are counted at least this busy


def split_speeds(num_layers: int, moved: int, donor_busy: float) -> tuple[float, float]:
    """Prefill speeds ``(donor, peer)`` while ``moved`` of the donor's ``num_layers``
    layers run on the peer (``WorkerLoad.prefill_speed``; 1 is the worker alone).

    The donor computes ``1 - phi`` of every chunk (``phi = moved / num_layers``)
    and the next chunk pipelines behind the peer's part, so it drains its queue
    ``1 / (1 - phi)`` times faster. The peer gives the guest layers
    ``share = phi / (1 - phi) * donor_busy`` of its time (the donor's own rate of
    work on them, at least ``MIN_DONOR_BUSY``, at most ``MAX_HOST_SHARE``), so its
    own work runs at ``1 - share``. The simulator applies these factors to its
    workers and reports them in their loads; the live router derives them from the
    agents' placements, so routing and balancing read the same numbers in both."""
    if not 0 <= moved < num_layers:
        raise ValueError(f"split_speeds: moved={moved!r} must be in [0, {num_layers})")
    phi = moved / num_layers
    if phi == 0:
        return 1.0, 1.0
    share = min(MAX_HOST_SHARE, phi / (1 - phi) * max(MIN_DONOR_BUSY, donor_busy))
    return 1 / (1 - phi), 1 - share
