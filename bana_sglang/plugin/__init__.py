"""SGLang plugin entry point (``sglang.srt.plugins`` group, name ``bana_sglang``).

SGLang 0.5.23 calls :func:`register` early in each of its processes (engine,
scheduler, detokenizer, DP controller). It must stay cheap and idempotent, and
it must never break a stock SGLang process: everything it does is gated on the
configuration that applies (CPU layer only without CUDA).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import sys

from bana_sglang import envs

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from bana_sglang import compat
    from bana_sglang.compat import pd_fixes
    from bana_sglang.plugin import routes as server_routes
    from bana_sglang.radix_global.hooks import (
        decode_queue_hook,
        init_cache_linker_hook,
        prebuilt_hook,
        run_batch_hook,
    )

    applied = compat.apply_in_process_fixes()
    short_ms, long_ms = compat.idle_poll_ms(), envs.BANA_IDLE_SLEEP_MS.get()
    if applied and short_ms > 0 and long_ms > 0:
        HookRegistry.register(
            "sglang.srt.managers.scheduler.Scheduler.maybe_sleep_on_idle",
            functools.partial(compat.sleep_on_idle_hook, short_ms=short_ms, long_ms=long_ms),
            HookType.AROUND,
        )
        applied.append(f"an idle scheduler with nothing under way waits {long_ms} ms")
    if applied and short_ms > 0:
        HookRegistry.register(
            "sglang.srt.managers.scheduler.Scheduler.on_idle",
            functools.partial(compat.wait_while_waiting_hook, short_ms=short_ms),
            HookType.AROUND,
        )
        applied.append(f"a scheduler whose requests wait for PD events polls every {short_ms} ms")
    if applied:
        logger.info("bana_sglang: CPU fixes applied: %s", ", ".join(applied))
    pd = pd_fixes.apply()  # every device
    if pd:
        logger.info("bana_sglang: PD transfer fixes applied: %s", ", ".join(pd))
    server_routes.APPLIED_FIXES[:] = applied
    server_routes.PD_FIXES[:] = pd
    try:
        cpu = compat.cpu_mode()
    except compat.GpuUnusable:  # the launcher refuses this machine; never break SGLang here
        cpu = False
    if multiprocessing.parent_process() is None:
        # The HTTP server's process (SGLang's children, spawned or forked, have a
        # parent): add the extension's routes before uvicorn starts.
        HookRegistry.register(
            "sglang.srt.entrypoints.http_server.launch_server",
            server_routes.before_launch_server,
            HookType.BEFORE,
        )
        # SGLang picks the start method of its children and the metrics directory there
        HookRegistry.register(
            "sglang.srt.entrypoints.engine._set_envs_and_config",
            functools.partial(after_sglang_env, fork=cpu and compat.start_method() == "fork"),
            HookType.AFTER,
        )
        # A streamed chat answer's token ids, for the router's resume of the stream
        from bana_sglang.plugin import chat_ids

        HookRegistry.register(
            "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream",
            chat_ids.chat_stream_hook,
            HookType.AROUND,
        )
        HookRegistry.register(
            "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
            chat_ids.generate_request_hook,
            HookType.AROUND,
        )
        if envs.BANA_WORKER_AUTH.get():  # the cluster's worker key, once the config is out
            HookRegistry.register(
                "sglang.srt.entrypoints.engine.Engine._launch_subprocesses",
                server_routes.after_launch_subprocesses,
                HookType.AFTER,
            )
    # The global store's linker needs SGLang's linker wrapper extended (the parent
    # page of each offloaded node); installed for our linker only.
    HookRegistry.register(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.init_cache_linker",
        init_cache_linker_hook,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
        decode_queue_hook,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode_schedule_batch_mixin."
        "ScheduleBatchDisaggregationDecodeMixin.process_prebuilt",
        prebuilt_hook,
        HookType.AROUND,
    )
    # The linker's cost model times the prefill forwards that load nothing.
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch", run_batch_hook, HookType.AROUND
    )
    # The migration agent answers its ZMQ requests at every batch boundary.
    from bana_sglang.migrate.hooks import scheduler_hook

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.process_input_requests",
        scheduler_hook,
        HookType.AROUND,
    )
    if cpu:
        # The CPU attention backend: its name must pass argparse and reach the model runner.
        try:
            from bana_sglang.attention import register_backend

            register_backend()
        except Exception:  # never break an SGLang process over an optional backend
            logger.exception("bana_sglang: could not register the bana_cpu attention backend")


def after_sglang_env(_result, *args, fork: bool, **kwargs) -> None:
    """AFTER hook on SGLang's ``_set_envs_and_config`` (the server process), which
    set the ``spawn`` start method and ``PROMETHEUS_MULTIPROC_DIR``; ``fork``: switch
    to ``fork`` (CPU only, see compat: "Start-up")."""
    values = sys.modules.get("prometheus_client.values")
    if values is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # prometheus_client picks its value class when it is first imported, which
        # here was before SGLang set the directory (applying the plugin's hooks
        # imports SGLang modules that import it): the server's own metrics (TTFT,
        # e2e latency, tokens) stayed in memory, where /metrics never reads them.
        # Metrics made from now on, here and in forked children, use the directory.
        values.ValueClass = values.get_value_class()
    if fork:
        multiprocessing.set_start_method("fork", force=True)
