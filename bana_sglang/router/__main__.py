"""``python -m bana_sglang.router``: the load-aware PD router on its own.

The launcher starts it for you; run it by hand to put it in front of SGLang PD
workers started elsewhere::

    python -m bana_sglang.router --prefill http://127.0.0.1:30100 8998 \\
        --decode http://127.0.0.1:30200 --policy bana --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from bana_sglang import _cli, envs
from bana_sglang.router.config import RouterConfig
from bana_sglang.router.policy import DEFAULT_POLICY, LIVE_POLICIES
from bana_sglang.router.server import Router
from bana_sglang.router.workers import parse_prefill_spec


async def serve(
    cfg: RouterConfig, *, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Run the router until ``stop`` is set (or forever)."""
    router = Router(cfg)
    runner = web.AppRunner(router.build_app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = router.site(runner, cfg.host, cfg.port, reuse_address=True)
    await site.start()
    print(f"bana-router ready on http://{cfg.host}:{cfg.port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await runner.cleanup()


def default_tokenizer(model_path: str | Path | None) -> str | None:
    if model_path and (Path(model_path) / "tokenizer.json").is_file():
        return str(model_path)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.router",
        description="OpenAI-compatible, load-aware router for SGLang prefill/decode workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--prefill",
        nargs=2,
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        default=[],
        help="a prefill worker and its disaggregation bootstrap port (repeat per worker)",
    )
    p.add_argument(
        "--decode",
        action="append",
        metavar="URL",
        default=[],
        help="a decode worker (repeat per worker)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=30000, help="port to bind")
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=LIVE_POLICIES,
        help="routing policy: bana is purely load-aware; the others are baselines",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of randomized policies")
    p.add_argument(
        "--model-path",
        default=None,
        help="model folder; its tokenizer.json makes token counts exact",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        help="model name(s) to accept; default: what the workers' /v1/models lists",
    )
    p.add_argument(
        "--page-tokens",
        type=int,
        default=16,
        help="tokens per page of the routing prefix hashes (cache_aware's trees)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint "
        "(default: $BANA_API_KEY, else none)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest request body (413 above)",
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=1 << 20,
        help="largest max_tokens / max_new_tokens accepted (400 above)",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.25,
        help="seconds between load polls of each worker",
    )
    p.add_argument(
        "--max-upstream-connections",
        type=int,
        default=1024,
        help="open connections to one worker at most; more requests wait for one to free "
        "(per worker, so that decode streams can never starve their prefills)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="worker pairs tried per request before answering 502",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds of silence from a worker before the request fails",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="seconds a decode stream may stay silent, after its first byte, while its "
        "worker answers nothing else (load polls, /health) before the worker is marked "
        "down and the stream resumed on another one",
    )
    p.add_argument(
        "--continuation-timeout",
        type=float,
        default=30.0,
        help="seconds a resumed or migrated stream's new worker pair may take to send its "
        "first byte (while both workers still answer) before it is abandoned and the "
        "continuation opened again, on another pair when there is one",
    )
    p.add_argument(
        "--global-index",
        default=None,
        metavar="tcp://HOST:PORT",
        help="the global KV store's index service: the bana policy then counts only a prompt's "
        "globally uncached tokens as prefill work (needs --model-path)",
    )
    p.add_argument(
        "--store-page-size",
        type=int,
        default=16,
        help="the workers' --page-size (the store's unit)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="the workers' KV dtype, part of the store's page keys (default: the checkpoint's; "
        "the launcher passes bfloat16 when GPU workers run a float32 checkpoint in bf16)",
    )
    p.add_argument(
        "--watch",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="another part of the cluster (Mooncake master, store index, ...) whose TCP "
        "reachability /health reports; repeatable; never gates routing",
    )
    p.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="WORKER_URL=tcp://HOST:PORT",
        help="a worker's migration agent, for the admin endpoints (/bana/admin/...); repeatable",
    )
    p.add_argument(
        "--no-request-migration",
        dest="request_migration",
        action="store_false",
        help="do not mark streamed requests migratable (a decode worker's agent can then not hand "
        "them off to another decode worker; needs --agent to work at all)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        prefill=tuple(parse_prefill_spec(s) for s in args.prefill),
        decode=tuple(u.rstrip("/") for u in args.decode),
        host=args.host,
        port=args.port,
        policy=args.policy,
        seed=args.seed,
        model_names=tuple(args.served_model_name),
        tokenizer_path=default_tokenizer(args.model_path),
        page_tokens=args.page_tokens,
        api_key=args.api_key or envs.BANA_API_KEY.get() or None,
        max_body_bytes=args.max_body_bytes,
        max_tokens_limit=args.max_tokens_limit,
        poll_interval_s=args.poll_interval,
        max_attempts=args.max_attempts,
        max_upstream_connections=args.max_upstream_connections,
        read_timeout_s=args.read_timeout,
        stall_timeout_s=args.stall_timeout,
        continuation_timeout_s=args.continuation_timeout,
        global_index=args.global_index,
        model_path=args.model_path,
        store_page_size=args.store_page_size,
        kv_dtype=args.kv_dtype,
        watch=tuple(tuple(w.split("=", 1)) if "=" in w else ("", w) for w in args.watch),
        agents=tuple(tuple(a.split("=", 1)) if "=" in a else (a, "") for a in args.agent),
        request_migration=args.request_migration,
    )


def raise_open_files_limit(want: int) -> int:
    """Raise this process's soft limit of open files towards ``want`` (at most the hard
    limit), as SGLang's own servers do; returns the soft limit now in force. Each
    stream holds a client socket and an upstream one, so 1024, a common default,
    caps a router at a few hundred streams."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def main(argv: list[str] | None = None) -> int:
    _, cfg = _cli.parse(build_parser(), argv, config_from_args)
    # client sockets, plus every worker's upstream connections, plus some spare
    workers = len(cfg.prefill) + len(cfg.decode)
    want = 2 * workers * cfg.max_upstream_connections + 1024
    got = raise_open_files_limit(want)
    if got < want:
        logging.getLogger("bana_sglang.router").warning(
            "open files are limited to %d (ulimit -n), below the %d that %d workers x "
            "--max-upstream-connections %d can use: past it new connections fail",
            got,
            want,
            workers,
            cfg.max_upstream_connections,
        )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop=stop)

    try:
        asyncio.run(run())
    except OSError as e:
        logging.getLogger("bana_sglang.router").error(
            "cannot serve on %s:%d: %s", cfg.host, cfg.port, e
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
