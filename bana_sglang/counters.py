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
