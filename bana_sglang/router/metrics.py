"""Prometheus metrics of the router (a private registry, served at ``/metrics``).

Names follow Prometheus conventions (``_total`` counters, ``_seconds``
histograms); worker labels are worker URLs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Router-added latency is sub-millisecond to a few ms; TTFT and e2e span seconds.
_FAST = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._answered: dict[tuple[str, int], tuple] = {}
        self._ttfb: dict[str, Histogram] = {}
        self.requests = Counter(
            "bana_router_requests_total",
            "Requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.routed = Counter(
            "bana_router_worker_requests_total",
            "Requests sent to each worker",
            ["worker", "role"],
            registry=r,
        )
        self.retries = Counter(
            "bana_router_retries_total",
            "Requests retried before their first byte (on another worker where there is one), by cause",
            ["reason"],
            registry=r,
        )
        self.unmigratable = Counter(
            "bana_router_unmigratable_total",
            "Streamed requests not marked for request migration, by the field that prevents it",
            ["reason"],
            registry=r,
        )
        self.worker_failures = Counter(
            "bana_router_worker_failures_total",
            "Connection errors and 5xx answers per worker",
            ["worker", "role"],
            registry=r,
        )
        self.stalls = Counter(
            "bana_router_worker_stalls_total",
            "Workers marked down because they answered nothing (no load poll, no liveness "
            "probe) while a request waited on them (hung or stopped); their streams were "
            "resumed and their unanswered requests retried elsewhere",
            ["worker", "role"],
            registry=r,
        )
        self.stream_errors = Counter(
            "bana_router_stream_errors_total",
            "Streams ended with an error event after the first byte",
            registry=r,
        )
        self.inflight = Gauge(
            "bana_router_worker_inflight",
            "Requests in flight per worker (router's count)",
            ["worker", "role"],
            registry=r,
        )
        self.healthy = Gauge(
            "bana_router_worker_healthy",
            "1 if the worker is routable",
            ["worker", "role"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "bana_router_worker_kv_usage",
            "KV token usage reported by the worker",
            ["worker", "role"],
            registry=r,
        )
        self.queued = Gauge(
            "bana_router_worker_queued_requests",
            "Waiting requests reported by the worker",
            ["worker", "role"],
            registry=r,
        )
        self.part_up = Gauge(
            "bana_router_part_up",
            "1 if a watched cluster part (--watch) accepts TCP connections",
            ["part"],
            registry=r,
        )
        self.global_lookups = Counter(
            "bana_router_global_lookups_total",
            "Prompts looked up in the global KV index, by outcome (hit, miss, unknown)",
            ["outcome"],
            registry=r,
        )
        self.global_cached_tokens = Counter(
            "bana_router_global_cached_tokens_total",
            "Prompt tokens the global KV index reported cached",
            registry=r,
        )
        self.global_lookup_seconds = Histogram(
            "bana_router_global_lookup_seconds",
            "One prompt's global index lookup: page hashes and the index round trip",
            buckets=_FAST,
            registry=r,
        )
        self.stream_resumes = Counter(
            "bana_router_stream_resumes_total",
            "Streams whose decode worker failed mid-answer, by result: resumed on another "
            "pair, failed (no pair could take it), not_resumable (no token ids: a chat stream "
            "from a worker without the extension; or nothing left to resume)",
            ["result"],
            registry=r,
        )
        self.request_migrations = Counter(
            "bana_router_request_migrations_total",
            "Streams whose request moved to another decode worker, by outcome "
            "(continued, failed, published_late: continued before the index "
            "listed every handed-off page)",
            ["result"],
            registry=r,
        )
        self.migration_stall_seconds = Histogram(
            "bana_router_request_migration_stall_seconds",
            "Handoff seen to the continuation's first byte (the client's stall)",
            buckets=_SLOW,
            registry=r,
        )
        self.route_seconds = Histogram(
            "bana_router_routing_seconds", "Time to pick a worker pair", buckets=_FAST, registry=r
        )
        self.ttfb_seconds = Histogram(
            "bana_router_first_byte_seconds",
            "Request arrival to first byte sent to the client",
            ["endpoint"],
            buckets=_SLOW,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "bana_router_request_seconds",
            "Request arrival to last byte",
            ["endpoint"],
            buckets=_SLOW,
            registry=r,
        )

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        """Count an answer and its end-to-end time (labelled children kept: a lookup
        by labels takes a lock and builds a key, per request)."""
        key = (endpoint, status)
        pair = self._answered.get(key)
        if pair is None:
            pair = self._answered[key] = (
                self.requests.labels(endpoint, str(status)),
                self.e2e_seconds.labels(endpoint),
            )
        pair[0].inc()
        pair[1].observe(seconds)

    def first_byte(self, endpoint: str, seconds: float) -> None:
        child = self._ttfb.get(endpoint)
        if child is None:
            child = self._ttfb[endpoint] = self.ttfb_seconds.labels(endpoint)
        child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
