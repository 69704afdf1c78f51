"""HTTP routes the extension adds to each SGLang worker's own FastAPI app.

``GET /bana/info`` says that the extension is loaded in this worker, which
versions run, and which CPU fixes the process applied: operators (and tests)
can tell a worker with the extension from a stock one. The routes are added
by a BEFORE hook on ``http_server.launch_server`` (see ``plugin.py``), i.e.
before uvicorn starts, and go through SGLang's own API-key middleware.
"""

from __future__ import annotations

import logging

from bana_sglang import envs
from bana_sglang.wire import security

logger = logging.getLogger(__name__)

APPLIED_FIXES: list[str] = []  # the CPU layer's, filled by plugin.register() in this process
PD_FIXES: list[str] = []  # SGLang's PD transfer's, on every device (compat.pd_fixes)


def info() -> dict:
    import sglang

    from bana_sglang import __version__, compat

    return {
        "bana_sglang": __version__,
        "sglang": sglang.__version__,
        "cpu_layer": compat.in_cpu_sglang_process(),
        "cpu_fixes": list(APPLIED_FIXES),
        "pd_fixes": list(PD_FIXES),
    }


def install(app) -> None:
    """Add the extension's routes to a FastAPI app (idempotent)."""
    if any(getattr(r, "path", None) == "/bana/info" for r in app.routes):
        return
    app.add_api_route("/bana/info", info, methods=["GET"], name="bana_info")


def before_launch_server(*args, **kwargs):
    """HookRegistry BEFORE hook on ``sglang.srt.entrypoints.http_server.launch_server``."""
    from sglang.srt.entrypoints import http_server

    install(http_server.app)
    return None


def after_launch_subprocesses(result, *args, **kwargs):
    """HookRegistry AFTER hook on ``Engine._launch_subprocesses`` in the HTTP server's
    process: the server's config is published there, and read for the API key right
    after (the middleware, the warm-up), so the cluster's worker key goes in here."""
    require_worker_key()
    return None


def require_worker_key() -> bool:
    """Make this worker require the cluster's worker API key (``BANA_WORKER_AUTH``):
    SGLang's own ``api_key``, so its middleware guards every endpoint but /health and
    /metrics and its warm-up sends the key. Set here rather than on the command line,
    where every local user could read it and SGLang's log of its arguments would print
    it. A key the operator gave with ``--api-key`` stays (the router then cannot reach
    it)."""
    if not envs.BANA_WORKER_AUTH.get():
        return False
    key = security.process_worker_key()
    if key is None:
        raise RuntimeError(
            "BANA_WORKER_AUTH is set but the process has no cluster secret "
            "(BANA_CLUSTER_SECRET_FILE): the worker would be open"
        )
    from sglang.srt.runtime_context import get_context, get_serving

    if get_serving().api_key:
        logger.warning("the worker keeps the --api-key it was given; the router cannot reach it")
        return False
    # the resolved config is sealed: SGLang's own override of a resolved value
    get_context().override("bana_sglang worker key", api_key=key)
    logger.info("bana_sglang: this worker requires the cluster's worker API key")
    return True
