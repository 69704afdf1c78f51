"""Benchmark harness for bana_sglang: trace replay and side-by-side runs.

Modules, one role each:

- :mod:`bench.workloads`: trace readers (Mooncake conversation, Azure 2023)
  and generators (long-context, bursty, mixed, shared-prefix) that all yield
  the same thing, a :class:`~bench.workloads.Workload` of requests with an
  arrival time, prompt token ids and an enforced output length;
- :mod:`bench.client`: the open-loop, asynchronous, streaming replay client
  for any OpenAI-compatible endpoint, plus the per-worker ``/metrics`` sampler;
- :mod:`bench.metrics`: percentiles, goodput, load imbalance, summaries;
- :mod:`bench.configs`: the serving configurations compared (a registry) and
  how each one is started with :mod:`bana_sglang.launch`;
- :mod:`bench.sidebyside`: runs configurations one after another, tables,
  ratios, plots, request-rate sweeps, the ``sglang.bench_serving`` cross-check
  and the ``docs/RESULTS.md`` writer;
- :mod:`bench.__main__`: the ``python -m bench`` command line.

Invariant: a benchmark never fakes a part. Every number comes from real
SGLang processes answering real HTTP requests on this machine.
"""

from __future__ import annotations
