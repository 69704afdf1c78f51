"""Load-aware PD router: ``python -m bana_sglang.router`` (the launcher's default front).

Torch-free: it imports the wire protocol, the shared types, the torch-free
parts of the global store (:mod:`bana_sglang.radix_global.keys`,
:mod:`bana_sglang.radix_global.client`) and the agent client, nothing else of
the project.

- :mod:`.policy`: pure routing policies (shared with the simulator);
  :mod:`.prefix_tree`: the approximate per-worker prefix trees of ``cache_aware``;
- :mod:`.server`: the asynchronous OpenAI-compatible HTTP front (endpoints, auth,
  input limits); :mod:`.front`: its listener (the generation requests on a path of
  its own, the rest through aiohttp); :mod:`.http1`: its client for the workers;
  :mod:`.dispatch`: the PD pairing, relay and retries;
  :mod:`.generate`: ``/generate`` batches and logprob windows;
  :mod:`.requests`: request validation, token counting and routing page hashes;
- :mod:`.global_index`: how much of a prompt the global index holds;
- :mod:`.workers`, :mod:`.monitor`: health, load snapshots and in-flight counts;
  :mod:`.upstream`: one open streamed PD request, one half awaiting its answer;
  :mod:`.stalls`: requests taken away from a worker that hangs;
- :mod:`.continuation`, :mod:`.splice`: live request migration: continue a
  handed-off stream on another decode worker in the same client stream;
- :mod:`.admin`: the migration admin endpoints (forwarded to the agents);
- :mod:`.metrics`: Prometheus metrics; :mod:`.errors`: OpenAI-format errors;
  :mod:`.config`: ``RouterConfig``.
"""
