"""SGLang plugin entry point (``sglang.srt.plugins`` group, name ``bana_sglang``).

SGLang 0.5.23 calls :func:`register` early in each of its processes (engine,
scheduler, detokenizer, DP controller). It must stay cheap and idempotent, and
it must never break a stock SGLang process: everything it does is gated on the
configuration that applies (CPU layer only without CUDA).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from bana_sglang import compat

    applied = compat.apply_in_process_fixes()
    if applied:
        logger.info("bana_sglang: CPU fixes applied: %s", ", ".join(applied))
