"""The launcher: one command for a whole PD cluster, or one node's share of it.

- :mod:`.spec`: the cluster spec (which host runs which part, addresses, ports), validated.
- :mod:`.plan`: pure planning: the command line, ports and environment of every part.
- :mod:`.procs`: child-process supervision (start, log, health, stop, reap).
- :mod:`.cluster`: runs a plan: start in order, wait for health, supervise, stop.
- :mod:`.cli`: ``python -m bana_sglang.launch``: flags to plan to a running cluster.

The planning and process API is re-exported here.
"""

from bana_sglang.launch.cli import main
from bana_sglang.launch.cluster import NODE_READY_MARK, READY_MARK, Cluster
from bana_sglang.launch.parts import Part, dtype_args, page_size_of, store_args
from bana_sglang.launch.plan import (
    ROUTERS,
    ClusterPlan,
    LaunchConfig,
    plan_cluster,
    plan_single_server,
    plan_spec,
)

__all__ = [
    "NODE_READY_MARK",
    "READY_MARK",
    "ROUTERS",
    "Cluster",
    "ClusterPlan",
    "LaunchConfig",
    "Part",
    "dtype_args",
    "main",
    "page_size_of",
    "plan_cluster",
    "plan_single_server",
    "plan_spec",
    "store_args",
]
