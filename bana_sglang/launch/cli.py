"""``python -m bana_sglang.launch``: one command for a whole PD cluster.

Starts, in order: a ``mooncake_master``; the global KV cache store (a storage
process holding the Mooncake segment and the global prefix index service);
N prefill and M decode SGLang workers (real ``sglang.launch_server``
processes with the ``bana_sglang`` plugin loaded, PD over the Mooncake
transfer engine, the global store as their external cache linker); and a PD
router in front. ``--no-global-store`` gives stock SGLang workers with their
private prefix caches (the baseline). It
waits until every part is healthy, prints the OpenAI-compatible endpoint,
streams every part's log with a ``[name]`` prefix (or into ``--log-dir``), and
on Ctrl-C/SIGTERM stops everything, leaving no child process or bound port.
If a part fails to start it says which and why, and stops the rest.

On a machine without CUDA the CPU layer (``bana_sglang.compat``) adds the
environment and flags SGLang 0.5.23 needs there.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bana_sglang import _cli, compat, envs, models
from bana_sglang.launch import spec as cluster_spec
from bana_sglang.launch.parts import Part
from bana_sglang.launch.plan import (
    ROUTERS,
    ClusterPlan,
    LaunchConfig,
    plan_cluster,
    plan_spec,
)
from bana_sglang.launch.procs import (
    ManagedProcess,
    ProcessStartError,
    http_ok,
    stop_all,
    tcp_open,
    wait_until,
)
from bana_sglang.router.policy import LIVE_POLICIES

logger = logging.getLogger("bana_sglang.launch")

READY_MARK = "bana_sglang: cluster ready"
NODE_READY_MARK = "bana_sglang: node ready:"


def smoke_request(
    endpoint: str, model: str, timeout: float = 60.0, api_key: str | None = None
) -> bool:
    """One greedy token through ``/v1/completions``: True when it came back."""
    body = json.dumps(
        {"model": model, "prompt": "ready?", "max_tokens": 1, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        endpoint + "/v1/completions",
        data=body,
        headers={"content-type": "application/json", **auth_headers(api_key)},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200 and bool(json.loads(resp.read()).get("choices"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _RouterHealth:
    """Readiness of the router; while it is not ready, says every 15 s which
    parts its ``/health`` reports missing (on a multi-node cluster: what this
    node is waiting for elsewhere)."""

    def __init__(self, url: str, headers: dict[str, str], note_every: float = 15.0):
        self.url, self.headers, self.note_every = url, headers, note_every
        self.next_note = time.monotonic() + note_every

    def __call__(self) -> bool:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.url, headers=self.headers), timeout=2.0
            ) as r:
                return 200 <= r.status < 300
        except urllib.error.HTTPError as e:
            try:
                missing = json.loads(e.read()).get("missing") or []
            except (ValueError, OSError, AttributeError):
                missing = []
            now = time.monotonic()
            if missing and now >= self.next_note:
                logger.info("router waits for: %s", ", ".join(missing))
                self.next_note = now + self.note_every
            return False
        except (urllib.error.URLError, OSError, ValueError):
            return False


class Cluster:
    """Runs a :class:`ClusterPlan`: start in order, wait for health, stop everything."""

    def __init__(
        self, plan: ClusterPlan, *, log_dir: Path | None = None, startup_timeout: float = 600.0
    ):
        self.plan = plan
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.procs: list[ManagedProcess] = []
        self.stop_event = threading.Event()
        self._reported_dead: set[str] = set()
        self._deadline = time.monotonic() + startup_timeout

    def _wait_needs(self, part: Part) -> None:
        """Wait for the parts on other nodes that ``part`` needs (TCP), with backoff,
        saying what it waits for."""
        for name, addr in part.needs:
            host, _, port = addr.rpartition(":")
            t0 = next_note = time.monotonic()
            attempt = 0
            while not tcp_open(host, int(port)):
                now = time.monotonic()
                if now >= next_note:
                    logger.info(
                        "%s waits for %s at %s (%.0fs so far)", part.name, name, addr, now - t0
                    )
                    next_note = now + 10.0
                if now > self._deadline:
                    raise ProcessStartError(part.name, f"{name} at {addr} never came up")
                if self.stop_event.wait(min(2.0, 0.1 * 2**attempt)):
                    raise ProcessStartError(part.name, f"interrupted while waiting for {name}")
                attempt += 1

    def _spawn(self, part: Part) -> ManagedProcess:
        self._wait_needs(part)
        proc = ManagedProcess(
            part.name, part.argv, {**self.plan.env, **dict(part.env)}, log_dir=self.log_dir
        )
        proc.start()
        self.procs.append(proc)
        logger.info("started %s (pid %s)", part.name, proc.pid)
        return proc

    def _wait_ready(self, part: Part, proc: ManagedProcess, deadline: float) -> None:
        h = self.plan.endpoint.split("//", 1)[1].rsplit(":", 1)[0]
        if part.ready_line:
            line = part.ready_line
            check = lambda: any(line in x for x in proc.tail())  # noqa: E731
            what = f"the line {line!r}"
        elif part.health_url and part is self.plan.router:
            check = _RouterHealth(part.health_url, auth_headers(self.plan.api_key))
            what = f"healthy answer at {part.health_url}"
        elif part.health_url:
            check = lambda: http_ok(part.health_url)  # noqa: E731
            what = f"healthy answer at {part.health_url}"
        else:
            host = part.tcp_host or h
            check = lambda: tcp_open(host, part.tcp_port)  # noqa: E731
            what = f"listening socket on {host}:{part.tcp_port}"
        wait_until(
            check,
            proc=proc,
            what=what,
            timeout=max(1.0, deadline - time.monotonic()),
            stop=self.stop_event,
        )
        logger.info("%s is ready", part.name)

    def start(self) -> None:
        """Start every part; raises :class:`ProcessStartError` (after stopping all) on failure."""
        deadline = self._deadline = time.monotonic() + self.startup_timeout
        try:
            if self.plan.master:
                self._wait_ready(self.plan.master, self._spawn(self.plan.master), deadline)
            for part, proc in [(part, self._spawn(part)) for part in self.plan.store]:
                self._wait_ready(part, proc, deadline)
            # Workers start together: their start-up is mostly imports and overlaps well.
            started = [(part, self._spawn(part)) for part in self.plan.workers]
            for part, proc in started:
                self._wait_ready(part, proc, deadline)
            if self.plan.router:
                router = self._spawn(self.plan.router)
                self._wait_ready(self.plan.router, router, deadline)
                # End to end: one greedy token through router, prefill, KV transfer, decode.
                wait_until(
                    lambda: smoke_request(
                        self.plan.endpoint, self.plan.served_model_name, api_key=self.plan.api_key
                    ),
                    proc=router,
                    what="a first request served end to end",
                    timeout=max(1.0, deadline - time.monotonic()),
                    stop=self.stop_event,
                )
                logger.info("first request served end to end")
            if self.plan.balancer:
                self._wait_ready(self.plan.balancer, self._spawn(self.plan.balancer), deadline)
        except BaseException:
            self.stop()
            raise

    def check_parts(self) -> str | None:
        """Report newly exited parts; a reason to stop the cluster, or None.

        A worker that dies is logged and left to the router (it marks the worker
        down and retries elsewhere) while one prefill and one decode worker are
        still alive; the router or the Mooncake master dying stops everything.
        A node of a cluster spec stops when every one of its parts has exited
        (its workers' peers are elsewhere: the router decides what is left).
        """
        for p in self.procs:
            if p.poll() is not None and p.name not in self._reported_dead:
                self._reported_dead.add(p.name)
                logger.error(
                    "%s exited unexpectedly (code %s). Last output:\n    %s",
                    p.name,
                    p.poll(),
                    "\n    ".join(p.tail()[-15:]),
                )
        dead = self._reported_dead
        vital = {part.name for part in (self.plan.master, self.plan.router) if part}
        if dead & vital:
            return f"{', '.join(sorted(dead & vital))} exited"
        if self.plan.node is not None:
            names = {p.name for p in self.plan.parts}
            return (
                f"every part of node {self.plan.node} exited" if names and names <= dead else None
            )
        for role in ("prefill", "decode"):
            names = {w.name for w in self.plan.workers if w.name.startswith(role + "-")}
            if names and names <= dead:
                return f"no {role} worker is left"
        return None

    def stop(self) -> None:
        """Stop the balancer first (it recalls the layers it moved, through the router),
        then the router (no new requests), then everything else together. Idempotent."""
        self.stop_event.set()
        router = self.plan.router.name if self.plan.router else None
        balancer = self.plan.balancer.name if self.plan.balancer else None
        first = [p for p in self.procs if p.name == balancer]
        front = [p for p in self.procs if p.name == router]
        rest = [p for p in self.procs if p.name not in (router, balancer)]
        for group in (first, front, rest):
            for name, code in stop_all(group).items():
                logger.info("stopped %s (exit %s)", name, code)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- CLI


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
        type=_cli.byte_size,
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
        "load (python -m bana_sglang.balancer.controller; /metrics and /decisions)",
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
        "--dry-run", action="store_true", help="print the plan (commands, ports) and exit"
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

    cluster = Cluster(plan, log_dir=args.log_dir, startup_timeout=args.startup_timeout)

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
