"""Load-aware PD router: ``python -m bana_sglang.router`` (the launcher's default front).

- :mod:`.policy`: pure routing policies (shared with the simulator);
- :mod:`.prefix_tree`: the approximate per-worker prefix trees of ``cache_aware``;
- :mod:`.workers`: health, load snapshots and the router's own in-flight counts;
- :mod:`.requests`: request validation, token counting and routing page hashes;
- :mod:`.server`: the asynchronous HTTP front (PD pairing, streaming, retries);
- :mod:`.metrics`: its Prometheus metrics.
"""
