"""Discrete-event simulator of a PD-disaggregated (or colocated) SGLang cluster.

It answers the questions that need 16-64 GPUs with the *same* policy code as the
live system: routing through ``bana_sglang.router.policy`` and balancing through
``bana_sglang.balancer.policy`` (resolved by name from their registries, never
copied). Modules:

- ``profiles``: cost model (prefill FLOPs, decode bytes, bandwidths) from a JSON
  profile with a source for every number (``profiles/*.json``; a calibration run
  can write another one and pass its path).
- ``workloads``: the Mooncake and Azure traces, and generators (long-context,
  bursty on/off, mixed, shared-prefix).
- ``cluster``: workers, jobs, cache tiers; ``engine``: the event loop, with
  ``speeds`` (host contention, speed factors), ``leases`` (balancer ticks,
  migrations, leases) and ``events`` (event kinds); ``metrics``: per-request
  records and the run summary.
- ``config``: ``SimConfig`` and the named systems of the comparison;
  ``compare``/``report``: the at-scale comparison that writes docs/SIMULATION.md.

Entry point: ``python -m bana_sglang.sim --help``.

Invariants: a run is a deterministic function of (config, workload); every
request finishes exactly once or is reported as rejected; no worker ever holds
more KV than its capacity.
"""

from __future__ import annotations
