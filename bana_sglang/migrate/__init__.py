"""Migration between SGLang PD workers.

- ``messages``: the typed, versioned ZMQ control channel (operator -> agent, agent -> agent);
- ``agent``: the per-worker agent in the SGLang scheduler (``hooks`` wires it in):
  layer-weight staging to a peer through the Mooncake transfer engine;
- ``balancer``: the pure policy from load snapshots to a migration plan;
- ``python -m bana_sglang.migrate``: the operator's command line.

Not built yet: switching the execution of staged layers to the peer, KV-block
and live request migration (see the open issues).
"""
