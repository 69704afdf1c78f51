"""Wiring of the migration agent into SGLang's scheduler (plugin hook).

The plugin registers :func:`scheduler_hook` in every SGLang process; the agent
itself is created on the scheduler's first loop iteration, only where the
launcher asked for one (``BANA_AGENT_ENDPOINT``), on TP rank 0.

Its settings are read once, there (:func:`config_from_envs`; the launcher sets
them per worker): ``BANA_AGENT_ENDPOINT`` (``tcp://HOST:PORT`` the agent
binds), ``BANA_WORKER_NAME`` (the worker's name in the cluster,
``prefill-0``), ``BANA_AGENT_HOST`` (the address its transfer engine
advertises; default: the endpoint's host), ``MOONCAKE_PROTOCOL`` (``tcp`` or
``rdma``), and the timeouts and thresholds of :class:`~.config.MigrateConfig`
(``BANA_MIGRATE_STEP_TIMEOUT_S``, ``BANA_MIGRATE_PEER_TIMEOUT_S``,
``BANA_KV_STEP_TIMEOUT_S``, ``BANA_KV_HOST_RECLAIM_BELOW``,
``BANA_REQUEST_PRECOPY_S``).
"""

from __future__ import annotations

import atexit
import logging
import os

import zmq

from bana_sglang import envs
from bana_sglang.migrate.agent import MigrationAgent
from bana_sglang.migrate.config import MigrateConfig
from bana_sglang.migrate.services import WorkerHandles

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


def config_from_envs(endpoint: str) -> MigrateConfig:
    """The agent's settings, read now from the environment."""
    return MigrateConfig(
        te_host=envs.BANA_AGENT_HOST.get() or endpoint.removeprefix("tcp://").rsplit(":", 1)[0],
        protocol=os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
        peer_timeout_s=envs.BANA_MIGRATE_PEER_TIMEOUT_S.get(),
        step_timeout_s=envs.BANA_MIGRATE_STEP_TIMEOUT_S.get(),
        kv_step_timeout_s=envs.BANA_KV_STEP_TIMEOUT_S.get(),
        kv_reclaim_below=envs.BANA_KV_HOST_RECLAIM_BELOW.get(),
        request_precopy_s=envs.BANA_REQUEST_PRECOPY_S.get(),
    )


def _handles(runner, scheduler=None) -> WorkerHandles | None:
    """The agent's handles on the worker, or None (staging still works) if this
    model runner lacks what the switch needs."""
    try:
        return WorkerHandles.from_runner(runner, scheduler)
    except Exception:
        logger.warning("migration agent: this worker cannot switch layer execution", exc_info=True)
        return None


def _start(scheduler):
    endpoint = envs.BANA_AGENT_ENDPOINT.get()
    if not endpoint:
        return _DISABLED
    # SGLang's own module: imported where the hook runs, inside a scheduler
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().tp_rank != 0:  # one agent per worker: TP rank 0's
        return _DISABLED
    runner = scheduler.tp_worker.model_runner
    model = runner.model
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        logger.error("migration agent disabled: %s has no model.layers", type(model).__name__)
        return _DISABLED
    role = getattr(scheduler.server_args, "disaggregation_mode", "null")
    try:
        agent = MigrationAgent(
            envs.BANA_WORKER_NAME.get() or f"{role}-{os.getpid()}",
            role,
            layers,
            endpoint,
            config=config_from_envs(endpoint),
            worker=_handles(runner, scheduler),
        )
    except Exception:
        logger.exception("migration agent disabled: could not start it on %s", endpoint)
        return _DISABLED
    atexit.register(agent.close)
    _wake_on(scheduler, agent)
    return agent


def _wake_on(scheduler, agent) -> None:
    """Let an idle scheduler sleep longer (the CPU layer's idle wait) without making the
    agent wait: its socket wakes the scheduler, and a busy agent keeps the wait short."""
    poller = getattr(getattr(scheduler, "idle_sleeper", None), "poller", None)
    if poller is not None:
        poller.register(agent.socket, zmq.POLLIN)
    scheduler._bana_keep_awake = (*getattr(scheduler, "_bana_keep_awake", ()), agent.busy)
