"""The router's view of its workers: health, in-flight work, load snapshots.

One :class:`Worker` per SGLang PD worker. The router combines two sources of
load, because either alone is wrong in a burst:

- the worker's own report, polled from SGLang's ``/v1/loads?include=core``
  every ``poll_interval`` seconds (queued and running requests, waiting
  uncached tokens, KV tokens used and total); it also sees load the router did
  not send;
- the router's own count of what it has sent and not yet seen finish
  (requests and tokens), which is exact and instantaneous, so a burst that
  arrives between two polls is still spread.

:meth:`Worker.load` folds both into the pure policies' ``WorkerLoad``, taking
the larger of the two where they measure the same thing, so work is never
counted twice.

Health: a worker that refuses a connection or answers 5xx is marked down at
once (:meth:`Worker.mark_down`), taken out of routing, and probed at
``/health`` with exponential backoff (``probe_min_s`` doubling to
``probe_max_s``) until it answers 200, when it is readmitted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from urllib.parse import urlsplit

from bana_sglang.types import Tier, WorkerId, WorkerLoad

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Reported:
    """The last ``/v1/loads`` answer of a worker (DP ranks summed)."""

    running: int = 0
    waiting: int = 0
    waiting_uncached_tokens: int = 0
    used_tokens: int = 0
    total_tokens: int = 0
    utilization: float = 0.0
    gen_throughput: float = 0.0  # tokens/s over the running requests, summed over DP ranks
    # tokens of requests waiting for KV memory: SGLang's num_total_tokens counts the
    # used tokens plus (on a decode worker) the prealloc and retracted queues' tokens
    waiting_tokens: int = 0
    at: float = 0.0  # time.monotonic() of the answer; 0: never

    @property
    def decode_step_s(self) -> float:
        """Seconds per step of the running batch (its requests' inter-token time):
        running requests / generated tokens per second; 0 when either is unknown."""
        if self.running <= 0 or self.gen_throughput <= 0:
            return 0.0
        return self.running / self.gen_throughput

    @classmethod
    def from_loads_json(cls, body: dict, at: float) -> Reported:
        """Parse SGLang 0.5.23's ``/v1/loads`` JSON (one entry per DP rank)."""
        loads = body.get("loads")
        if not isinstance(loads, list):
            raise ValueError("/v1/loads answer has no 'loads' list")
        r = cls(at=at)
        util = []
        for d in loads:
            r.running += int(d.get("num_running_reqs", 0))
            r.waiting += int(d.get("num_waiting_reqs", 0))
            r.waiting_uncached_tokens += int(d.get("num_waiting_uncached_tokens", 0))
            r.used_tokens += int(d.get("num_used_tokens", 0))
            if "num_total_tokens" in d:
                r.waiting_tokens += max(
                    0, int(d["num_total_tokens"]) - int(d.get("num_used_tokens", 0))
                )
            r.total_tokens += int(d.get("max_total_num_tokens", 0) or d.get("num_total_tokens", 0))
            util.append(float(d.get("utilization", 0.0) or 0.0))
            r.gen_throughput += max(0.0, float(d.get("gen_throughput", 0.0) or 0.0))
        r.utilization = max(util, default=0.0)
        return r


class Worker:
    """One SGLang worker as the router sees it."""

    def __init__(
        self,
        url: str,
        tier: Tier,
        *,
        bootstrap_port: int | None = None,
        probe_min_s: float = 0.5,
        probe_max_s: float = 10.0,
    ) -> None:
        url = url.rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"worker URL {url!r} must look like http://HOST:PORT")
        if tier is Tier.PREFILL and bootstrap_port is None:
            raise ValueError(f"prefill worker {url} needs its bootstrap port")
        self.url = url
        self.id = WorkerId(url)
        self.host = parts.hostname
        self.tier = tier
        self.bootstrap_port = bootstrap_port
        self.probe_min_s, self.probe_max_s = probe_min_s, probe_max_s
        # health
        self.healthy = True
        self.down_reason = ""
        self.failures = 0  # consecutive
        self.next_probe = 0.0
        # the router's own accounting
        self.inflight = 0
        self.inflight_tokens = 0
        self.routed = 0  # requests sent here, ever (the hotspot tests read these)
        self.errors = 0
        self.reported = Reported()
        # time.monotonic() of the worker's last answer to a load poll, liveness or health
        # probe (any status): a worker that answers nothing is hung or stopped, not busy
        self.answered_at = time.monotonic()
        self.prefill_speed = 1.0  # from the agents' placements (AdminAPI.speed_loop)

    # ---------------------------------------------------------------- accounting
    def begin(self, tokens: int) -> None:
        self.inflight += 1
        self.inflight_tokens += tokens
        self.routed += 1

    def end(self, tokens: int) -> None:
        self.inflight = max(0, self.inflight - 1)
        self.inflight_tokens = max(0, self.inflight_tokens - tokens)

    def lower(self, tokens: int) -> None:
        """An in-flight request will take ``tokens`` fewer than it was counted with."""
        self.inflight_tokens = max(0, self.inflight_tokens - tokens)

    # ---------------------------------------------------------------- health
    def mark_down(self, reason: str, now: float | None = None) -> bool:
        """Take the worker out of routing; True if it was healthy until now."""
        now = time.monotonic() if now is None else now
        self.errors += 1
        self.failures += 1
        was = self.healthy
        self.healthy = False
        self.down_reason = reason
        backoff = min(self.probe_max_s, self.probe_min_s * 2 ** (self.failures - 1))
        self.next_probe = now + backoff
        if was:
            logger.warning(
                "worker %s (%s) marked down: %s; probing /health from %.1fs",
                self.url,
                self.tier.value,
                reason,
                backoff,
            )
        return was

    def mark_up(self) -> None:
        if not self.healthy:
            logger.warning(
                "worker %s (%s) is back (was down: %s)", self.url, self.tier.value, self.down_reason
            )
        self.healthy = True
        self.failures = 0
        self.down_reason = ""
        self.answered_at = time.monotonic()

    def due_for_probe(self, now: float) -> bool:
        return not self.healthy and now >= self.next_probe

    # ---------------------------------------------------------------- load
    def load(self, now: float | None = None) -> WorkerLoad:
        """This worker's load for the pure policies (see module docstring)."""
        r = self.reported
        total_reqs = max(r.running + r.waiting, self.inflight)
        running = min(r.running, total_reqs)
        if self.tier is Tier.PREFILL:
            queued_tokens = max(r.waiting_uncached_tokens, self.inflight_tokens)
            inflight_tokens = 0
        else:
            queued_tokens = 0
            inflight_tokens = self.inflight_tokens
        return WorkerLoad(
            worker_id=self.id,
            tier=self.tier,
            queued_requests=total_reqs - running,
            running_requests=running,
            queued_prefill_tokens=queued_tokens,
            inflight_tokens=inflight_tokens,
            kv_used_tokens=r.used_tokens,
            kv_total_tokens=max(1, r.total_tokens),
            busy_fraction=min(1.0, max(0.0, r.utilization)),
            timestamp=r.at if now is None else now,
            prefill_speed=self.prefill_speed,
            decode_step_s=r.decode_step_s if self.tier is not Tier.PREFILL else 0.0,
            kv_waiting_tokens=r.waiting_tokens if self.tier is not Tier.PREFILL else 0,
        )

    def snapshot(self) -> dict:
        """JSON view for ``/bana/router/workers`` and the logs."""
        r = self.reported
        return {
            "url": self.url,
            "role": self.tier.value,
            "bootstrap_port": self.bootstrap_port,
            "healthy": self.healthy,
            "down_reason": self.down_reason or None,
            "routed": self.routed,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "errors": self.errors,
            "reported": {
                "running": r.running,
                "waiting": r.waiting,
                "waiting_uncached_tokens": r.waiting_uncached_tokens,
                "kv_used_tokens": r.used_tokens,
                "kv_total_tokens": r.total_tokens,
                "age_s": round(time.monotonic() - r.at, 3) if r.at else None,
            },
            "load": load_to_json(self.load()),
        }


def load_to_json(w: WorkerLoad) -> dict:
    """A ``WorkerLoad`` as JSON (the balancer controller reads it back with ``load_from_json``)."""
    d = dataclasses.asdict(w)
    d["tier"] = w.tier.value
    return d


def parse_prefill_spec(spec: list[str] | tuple[str, ...]) -> tuple[str, int]:
    """``["http://h:p", "8998"]`` (as sglang_router's ``--prefill URL BOOT``)."""
    if len(spec) != 2:
        raise ValueError(f"--prefill takes URL BOOTSTRAP_PORT, got {' '.join(spec)!r}")
    url, boot = spec
    try:
        port = int(boot)
    except ValueError:
        raise ValueError(f"bootstrap port {boot!r} of {url} is not an integer") from None
    if not 0 < port < 65536:
        raise ValueError(f"bootstrap port {port} of {url} is not a TCP port")
    return url, port
