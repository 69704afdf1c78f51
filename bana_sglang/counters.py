"""Counters of a worker-side component, exported to SGLang's ``/metrics``.

A :class:`CounterSet` keeps plain numbers (for logs and tests) and, when
``prometheus_client`` is importable, one Prometheus counter per name
(``<prefix>_<name>_total``). SGLang's ``--enable-metrics`` sets up the
multiprocess directory, so counters created in the scheduler process appear on
the worker's ``/metrics``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any


class CounterSet:
    def __init__(self, prefix: str, names: Mapping[str, str]):
        self.names = dict(names)
        self.values = dict.fromkeys(self.names, 0.0)
        self._prom: dict[str, Any] = {}
        self._lock = threading.Lock()
        try:
            from prometheus_client import Counter
        except ImportError:
            return
        for name, doc in self.names.items():
            try:
                self._prom[name] = Counter(f"{prefix}_{name}", doc)
            except ValueError:  # already registered in this process (tests)
                pass

    def add(self, name: str, value: float = 1.0) -> None:
        if value <= 0:
            return
        with self._lock:
            self.values[name] += value
        c = self._prom.get(name)
        if c is not None:
            c.inc(value)


#: Bucket bounds (seconds) of the durations a worker-side component observes.
SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class HistogramSet:
    """Durations of a component: one Prometheus histogram per name (``<prefix>_<name>``,
    seconds) when ``prometheus_client`` is importable, and local sums and counts."""

    def __init__(self, prefix: str, names: Mapping[str, str]):
        self.names = dict(names)
        self.sums = dict.fromkeys(self.names, 0.0)
        self.counts = dict.fromkeys(self.names, 0)
        self._prom: dict[str, Any] = {}
        self._lock = threading.Lock()
        try:
            from prometheus_client import Histogram
        except ImportError:
            return
        for name, doc in self.names.items():
            try:
                self._prom[name] = Histogram(f"{prefix}_{name}", doc, buckets=SECONDS_BUCKETS)
            except ValueError:  # already registered in this process (tests)
                pass

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self.sums[name] += seconds
            self.counts[name] += 1
        h = self._prom.get(name)
        if h is not None:
            h.observe(seconds)

    def mean(self, name: str) -> float:
        n = self.counts[name]
        return self.sums[name] / n if n else 0.0
