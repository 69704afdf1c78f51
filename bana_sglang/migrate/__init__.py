"""Migration (planned).

Will hold: the typed, versioned ZMQ control plane between per-worker migration
agents, layer-level weight migration, attention-level KV-block migration, live
request migration, and the balancer that decides migrations from live load.
"""
