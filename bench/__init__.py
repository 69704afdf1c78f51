"""Benchmark harness for bana_sglang: trace replay, side-by-side runs, and the
simulator's calibration and fidelity against the live system.

Modules, one role each:

- :mod:`bench.workloads`: the registry of workload sources and ``build``; the
  trace readers (:mod:`bench.traces`: Mooncake conversation, Azure 2023, read
  from the copies shipped in ``bench/data/traces`` unless given ``--trace``)
  and the generators (:mod:`bench.generators`: long-context, bursty, mixed,
  shared-prefix) all yield the same thing, a :class:`~bench.workloads.Workload`
  of requests with an arrival time, prompt token ids and an enforced output
  length (the types: :mod:`bench.workload_types`);
- :mod:`bench.client`: the open-loop, asynchronous, streaming replay client
  for any OpenAI-compatible endpoint, plus the per-worker ``/metrics`` sampler;
- :mod:`bench.metrics`: percentiles, goodput, load imbalance, summaries;
- :mod:`bench.configs`: the serving configurations compared (a registry) and
  how each one is started with :mod:`bana_sglang.launch`;
- :mod:`bench.sidebyside`: runs configurations one after another (and the
  request-rate sweep); :mod:`bench.report`: its tables, ratios, plots and
  report; :mod:`bench.crosscheck`: the ``sglang.bench_serving`` cross-check;
- :mod:`bench.results`: the machine's description, the single-cluster
  benchmarks' shared options, and the ``docs/RESULTS.md`` writer;
- :mod:`bench.calibrate` (measurements), :mod:`bench.fit` (the pure fits) and
  :mod:`bench.fidelity`: the simulator's CPU profile fitted to the live 1P1D
  cluster and checked against it, on the harness of :mod:`bench.live`;
- ``bench.bench_*``: one benchmark each (router overhead, global store,
  migrations, attention kernels), run as ``python -m bench.bench_<name>``;
- :mod:`bench.__main__`: the ``python -m bench`` command line, its commands in
  :mod:`bench.commands`.

Invariant: a benchmark never fakes a part. Every number comes from real
SGLang processes answering real HTTP requests on this machine.
"""

from __future__ import annotations
