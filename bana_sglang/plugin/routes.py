"""HTTP routes the extension adds to each SGLang worker's own FastAPI app.

``GET /bana/info`` says that the extension is loaded in this worker, which
versions run, and which CPU fixes the process applied: operators (and tests)
can tell a worker with the extension from a stock one. The routes are added
by a BEFORE hook on ``http_server.launch_server`` (see ``plugin.py``), i.e.
before uvicorn starts, and go through SGLang's own API-key middleware.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

APPLIED_FIXES: list[str] = []  # filled by plugin.register() in this process


def info() -> dict:
    import sglang

    from bana_sglang import __version__, compat

    return {
        "bana_sglang": __version__,
        "sglang": sglang.__version__,
        "cpu_layer": compat.in_cpu_sglang_process(),
        "cpu_fixes": list(APPLIED_FIXES),
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
