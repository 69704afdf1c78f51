"""Wiring of the migration agent into SGLang's scheduler (plugin hook).

Light to import: the plugin registers :func:`scheduler_hook` in every SGLang
process; the agent itself is created on the scheduler's first loop iteration,
only where the launcher asked for one (``BANA_AGENT_ENDPOINT``), on TP rank 0.

Environment (set per worker by the launcher):
- ``BANA_AGENT_ENDPOINT``: ``tcp://HOST:PORT`` the agent binds;
- ``BANA_WORKER_NAME``: the worker's name in the cluster (``prefill-0``);
- ``BANA_AGENT_HOST``: the address its transfer engine advertises (default:
  the endpoint's host); ``MOONCAKE_PROTOCOL``: ``tcp`` (default) or ``rdma``;
- ``BANA_MIGRATE_STEP_TIMEOUT_S``: how long a forward waits for a peer running
  its migrated layers before it restores them and runs them itself (30);
  ``BANA_MIGRATE_PEER_TIMEOUT_S``: how long a peer agent may stay silent
  during staging before the migration fails ``peer_unreachable`` (30).
"""

from __future__ import annotations

import atexit
import logging
import os

from bana_sglang import envs

logger = logging.getLogger(__name__)

_DISABLED = object()


def scheduler_hook(original, scheduler, *args, **kwargs):
    """AROUND hook on ``Scheduler.process_input_requests``: after SGLang handled
    its own inputs (a batch boundary), answer the agent's waiting requests."""
    out = original(scheduler, *args, **kwargs)
    agent = getattr(scheduler, "_bana_migration_agent", None)
    if agent is None:
        agent = _start(scheduler)
        scheduler._bana_migration_agent = agent
    if agent is not _DISABLED:
        try:
            agent.poll()
        except Exception:  # never take the scheduler down over the control plane
            logger.exception("migration agent poll failed")
    return out


def _handles(runner, scheduler=None):
    """The switch's handles on the worker, or None (staging still works) if this
    model runner lacks what it needs."""
    from bana_sglang.migrate.layers.handler import WorkerHandles

    try:
        return WorkerHandles.from_runner(runner, scheduler)
    except Exception:
        logger.warning("migration agent: this worker cannot switch layer execution", exc_info=True)
        return None


def _start(scheduler):
    endpoint = envs.BANA_AGENT_ENDPOINT.get()
    if not endpoint:
        return _DISABLED
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().tp_rank != 0:  # one agent per worker: TP rank 0's
        return _DISABLED
    runner = scheduler.tp_worker.model_runner
    model = runner.model
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        logger.error("migration agent disabled: %s has no model.layers", type(model).__name__)
        return _DISABLED
    from bana_sglang.migrate.agent import (
        PEER_TIMEOUT_S,
        STEP_TIMEOUT_S,
        MigrationAgent,
    )

    host = envs.BANA_AGENT_HOST.get() or endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    role = getattr(scheduler.server_args, "disaggregation_mode", "null")
    try:
        agent = MigrationAgent(
            envs.BANA_WORKER_NAME.get() or f"{role}-{os.getpid()}",
            role,
            layers,
            endpoint,
            te_host=host,
            protocol=os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
            worker=_handles(runner, scheduler),
            step_timeout_s=envs.BANA_MIGRATE_STEP_TIMEOUT_S.get() or STEP_TIMEOUT_S,
            peer_timeout_s=envs.BANA_MIGRATE_PEER_TIMEOUT_S.get() or PEER_TIMEOUT_S,
        )
    except Exception:
        logger.exception("migration agent disabled: could not start it on %s", endpoint)
        return _DISABLED
    atexit.register(agent.close)
    return agent
