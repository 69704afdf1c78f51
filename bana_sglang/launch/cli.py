"""``python -m bana_sglang.launch``: one command for a whole PD cluster.

Starts, in order: a ``mooncake_master``; the global KV cache store (a storage
process holding the Mooncake segment and the global prefix index service);
N prefill and M decode SGLang workers (real ``sglang.launch_server``
processes with the ``bana_sglang`` plugin loaded, PD over the Mooncake
transfer engine, the global store as their external cache linker); and a PD
router in front. ``--no-global-store`` gives stock SGLang workers with their
private prefix caches (the baseline). It
waits until every part is healthy, prints the OpenAI-compatible endpoint,
streams every part's log with a ``[name]`` prefix (or into ``--log-dir``),
restarts a part that exits (with backoff; a crash loop is reported and given
up on), and on Ctrl-C/SIGTERM stops everything, leaving no child process or
bound port.
If a part fails to start it says which and why, and stops the rest.

On a machine without CUDA the CPU layer (``bana_sglang.compat``) adds the
environment and flags SGLang 0.5.23 needs there.

This module is the command line (flags, plan, signals, the ready line);
:mod:`bana_sglang.launch.cluster` runs the plan.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import time
from pathlib import Path

from bana_sglang import _cli, compat, envs, models
from bana_sglang.launch import spec as cluster_spec
from bana_sglang.launch.cluster import NODE_READY_MARK, READY_MARK, Cluster
from bana_sglang.launch.parts import Part
from bana_sglang.launch.plan import (
    ROUTERS,
    ClusterPlan,
    LaunchConfig,
    plan_cluster,
    plan_spec,
)
from bana_sglang.launch.procs import (
    ProcessStartError,
)
from bana_sglang.router.policy import LIVE_POLICIES
from bana_sglang.wire import security

logger = logging.getLogger("bana_sglang.launch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.launch",
        description="Start a prefill/decode-disaggregated SGLang cluster (Mooncake master, "
        "N prefill + M decode workers with the bana_sglang extension, a PD router) and serve "
        "an OpenAI-compatible endpoint. Ctrl-C or SIGTERM stops everything.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="HF model folder, or an embedded model name (tiny, small) built on "
        "first use; default: the embedded tiny model",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name clients use; default: the folder name"
    )
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address every part binds to")
    p.add_argument("--port", type=int, default=30000, help="port of the OpenAI-compatible endpoint")
    p.add_argument(
        "--worker-base-port",
        type=int,
        default=None,
        help="first port for workers, bootstrap and Mooncake (default: --port + 100, "
        "skipping busy ports)",
    )
    p.add_argument(
        "--sglang-args",
        default="",
        help="extra SGLang server flags for every worker, as one shell-quoted string, "
        'e.g. "--max-total-tokens 8192 --chunked-prefill-size 1024"',
    )
    p.add_argument("--prefill-args", default="", help="extra SGLang flags for prefill workers only")
    p.add_argument("--decode-args", default="", help="extra SGLang flags for decode workers only")
    p.add_argument(
        "--router",
        default="bana",
        choices=ROUTERS,
        help="front: bana (bana_sglang.router, load-aware) or sglang (the stock sglang_router, "
        "for comparisons)",
    )
    p.add_argument(
        "--policy",
        default="bana",
        help=f"routing policy; bana router: {', '.join(LIVE_POLICIES)}; stock router: its own "
        "names (cache_aware, round_robin, power_of_two, random); 'bana' keeps its default",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' at the endpoint (bana router; default: "
        "$BANA_API_KEY, else none)",
    )
    p.add_argument(
        "--global-store",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the global KV cache store (storage process, index service, the linker on "
        "every worker); --no-global-store: stock SGLang private prefix caches",
    )
    p.add_argument(
        "--store-bytes",
        type=_cli.segment_size,
        default=1 << 30,
        help="memory of the store's Mooncake segment, e.g. 512M or 4G",
    )
    p.add_argument(
        "--store-page-size",
        type=int,
        default=16,
        help="--page-size of workers with the global store (a page is the store's unit)",
    )
    p.add_argument(
        "--router-args",
        default="",
        help='extra router flags as one string, e.g. "--poll-interval 0.1"',
    )
    p.add_argument(
        "--balancer",
        default="none",
        choices=("none", "bana"),
        help="none: static PD; bana: the live balancer moves layers between workers from their "
        "load (python -m bana_sglang.balancer; /metrics and /decisions)",
    )
    p.add_argument(
        "--balancer-args",
        default="",
        help='extra balancer flags as one string, e.g. "--interval 0.5 --consecutive 2"',
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        metavar="N",
        help="OpenMP threads of each SGLang worker on a CPU machine (default 0: the machine's "
        "CPUs divided among its workers; $OMP_NUM_THREADS, when set, wins)",
    )
    p.add_argument(
        "--spec",
        type=Path,
        default=None,
        metavar="FILE",
        help="a cluster spec (YAML/TOML: hosts, workers, ports, where the master, store and "
        "router run); with --node, start that node's share. The spec replaces the "
        "cluster flags above. See docs/specs/",
    )
    p.add_argument(
        "--node",
        default=None,
        help="the spec node to start (default: the only node of a one-node spec)",
    )
    p.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        help="the cluster secret (mode 0600) that authenticates every ZMQ control channel; "
        "created when missing (one machine). Default: $BANA_CLUSTER_SECRET_FILE, else a new one "
        "per run. A --spec on a non-loopback network needs it: the same file on every node",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="write each part's log to DIR/NAME.log instead of the prefixed console stream",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds for the whole cluster to become healthy",
    )
    p.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="do not restart a part that exits (default: restart it with backoff; a part that "
        "crashes 5 times within 5 minutes is given up on)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan (commands, ports) and exit"
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs for the workers on a CUDA machine (default: every GPU nvidia-smi lists); "
        "workers go round robin (--base-gpu-id) and split --mem-fraction-static where they "
        "share one",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    return LaunchConfig(
        model_path=args.model_path,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        host=args.host,
        port=args.port,
        worker_base_port=args.worker_base_port,
        served_model_name=args.served_model_name,
        sglang_args=tuple(shlex.split(args.sglang_args)),
        prefill_args=tuple(shlex.split(args.prefill_args)),
        decode_args=tuple(shlex.split(args.decode_args)),
        router_args=tuple(shlex.split(args.router_args)),
        router=args.router,
        policy=args.policy,
        api_key=args.api_key or envs.BANA_API_KEY.get() or None,
        log_dir=args.log_dir,
        startup_timeout=args.startup_timeout,
        global_store=args.global_store,
        store_bytes=args.store_bytes,
        store_page_size=args.store_page_size,
        balancer=args.balancer,
        balancer_args=tuple(shlex.split(args.balancer_args)),
        cpu_threads=args.cpu_threads,
        gpus=args.gpus,
    )


# Flags a cluster spec replaces: giving one with --spec is an error, not silently ignored.
SPEC_REPLACES = (
    "model_path",
    "served_model_name",
    "num_prefill",
    "num_decode",
    "host",
    "port",
    "worker_base_port",
    "sglang_args",
    "prefill_args",
    "decode_args",
    "router",
    "policy",
    "api_key",
    "global_store",
    "store_bytes",
    "store_page_size",
    "router_args",
    "balancer",
    "balancer_args",
    "cpu_threads",
    "gpus",
)


def _plan_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: LaunchConfig | None
) -> tuple[ClusterPlan, cluster_spec.ClusterSpec | None]:
    if args.spec is None:
        if args.node is not None:
            parser.error("--node needs --spec")
        return plan_cluster(cfg), None
    given = [d for d in SPEC_REPLACES if getattr(args, d) != parser.get_default(d)]
    if given:
        parser.error(
            f"--spec replaces {', '.join('--' + d.replace('_', '-') for d in given)}: "
            "set these in the spec file"
        )
    try:
        spec = cluster_spec.load(args.spec)
        node = args.node
        if node is None and not args.dry_run:
            if len(spec.nodes) != 1:
                raise cluster_spec.SpecError(
                    f"{args.spec} has {len(spec.nodes)} nodes: say which to start with --node "
                    f"({', '.join(n.name for n in spec.nodes)})"
                )
            node = spec.nodes[0].name
        return plan_spec(spec, node, dry_run=args.dry_run), spec
    except (cluster_spec.SpecError, models.ModelBuildError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
        raise  # unreachable


def _parts_by_node(
    spec: cluster_spec.ClusterSpec | None, plan: ClusterPlan
) -> list[tuple[str | None, Part]]:
    """The plan's parts, each with its spec node when the whole spec is shown."""
    if spec is None or plan.node is not None:
        return [(f"[{plan.node}]" if plan.node else None, p) for p in plan.parts]
    out = []
    for n in spec.nodes:
        share = plan_spec(spec, n.name, dry_run=True)
        out += [(f"[{n.name}]", p) for p in share.parts]
    return out


def _secret_file(args: argparse.Namespace, spec: cluster_spec.ClusterSpec | None) -> Path | None:
    """The cluster secret's file: given (created when missing on one machine), or None (the
    runner makes one per run). A spec whose nodes are not all loopback must name one, and
    its router must take an API key (``router.api_key_env``)."""
    given = args.cluster_secret_file or (
        Path(envs.BANA_CLUSTER_SECRET_FILE.get()) if envs.BANA_CLUSTER_SECRET_FILE.is_set else None
    )
    if spec is not None and not all(cluster_spec.is_loopback(n.address) for n in spec.nodes):
        if not spec.router.api_key_env:
            raise security.SecretError(
                f"{args.spec} spans a network: set router.api_key_env (the router's clients "
                "and its admin API need a key there; the variable holds it on the router's node)"
            )
        if given is None:
            raise security.SecretError(
                f"{args.spec} spans a network: give --cluster-secret-file (one file, mode 0600, "
                "copied to every node) so that its control channels are authenticated"
            )
        if not given.exists():
            raise security.SecretError(
                f"cluster secret file {given} is missing: every node must read the same file "
                f"(create it once: python -c 'import secrets; print(secrets.token_hex(32))' > "
                f"{given}; chmod 600 {given}; then copy it to every node)"
            )
    elif given is not None:
        security.create_secret_file(given)
    return given


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=_cli.LOG_FORMAT)
    cfg = None
    if args.spec is None:
        args, cfg = _cli.parse(parser, argv, config_from_args)
    plan, spec = _plan_from_args(parser, args, cfg)
    if args.dry_run:
        print(f"endpoint: {plan.endpoint}  model: {plan.served_model_name} ({plan.model_path})")
        print(f"cpu layer: {'on' if compat.cpu_mode() else 'off'}")
        for node, part in _parts_by_node(spec, plan):
            print(f"{node + ' ' if node else ''}{part.name}: {shlex.join(part.argv)}")
        return 0

    try:
        secret = _secret_file(args, spec)
        cluster = Cluster(
            plan,
            log_dir=args.log_dir,
            startup_timeout=args.startup_timeout,
            secret_file=secret,
            restart=args.restart,
        )
    except security.SecretError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    def on_signal(signum, _frame):
        logger.info("received %s: shutting down", signal.Signals(signum).name)
        cluster.stop_event.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    try:
        cluster.start()
    except ProcessStartError as e:
        logger.error("cluster failed to start: %s", e)
        return 1
    if plan.node is not None:
        print(
            f"{NODE_READY_MARK} {plan.node}: {', '.join(p.name for p in plan.parts)} "
            f"(up in {time.monotonic() - t0:.0f}s)",
            flush=True,
        )
    if plan.router is not None:
        roles = [
            w.argv[w.argv.index("--disaggregation-mode") + 1]
            for w in plan.workers
            if "--disaggregation-mode" in w.argv
        ]
        shape = (
            f"{roles.count('prefill')}P{roles.count('decode')}D"
            if plan.node is None
            else f"node {plan.node}"
        )
        print(
            f"{READY_MARK}: {plan.endpoint} (OpenAI-compatible; model {plan.served_model_name!r}; "
            f"{shape}; up in {time.monotonic() - t0:.0f}s)",
            flush=True,
        )
    code = 0
    while not cluster.stop_event.wait(1.0):
        why = cluster.check_parts()
        if why is not None:
            logger.error("%s; stopping the cluster", why)
            code = 1
            break
    if plan.store:
        from bana_sglang.radix_global import summary

        rows = [
            (w.name, summary.scrape(w.health_url.removesuffix("/health"), timeout=2.0))
            for w in plan.workers
        ]
        logger.info("global KV store, per worker:\n%s", summary.table(rows))
    cluster.stop()
    logger.info("cluster stopped")
    return code
