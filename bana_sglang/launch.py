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
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bana_sglang import _cli, compat
from bana_sglang.procs import (
    ManagedProcess,
    PortAllocator,
    ProcessStartError,
    ephemeral_range,
    http_ok,
    stop_all,
    tcp_open,
    wait_until,
)
from bana_sglang.router.policy import LIVE_POLICIES

logger = logging.getLogger("bana_sglang.launch")

READY_MARK = "bana_sglang: cluster ready"
ROUTERS = ("bana", "sglang")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher decides; built once from the command line."""

    model_path: str | None = None  # embedded model name or folder; None: the tiny model
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    worker_base_port: int | None = None  # None: scan up from port + 100
    served_model_name: str | None = None
    sglang_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    startup_timeout: float = 600.0
    mooncake_master: bool = True
    router: str = "bana"  # "bana": bana_sglang.router; "sglang": the stock sglang_router
    policy: str = "bana"
    api_key: str | None = None  # bana router only; passed by environment, never argv
    global_store: bool = True  # storage process + index service + the linker on every worker
    store_bytes: int = 1 << 30  # Mooncake segment of the storage process
    store_page_size: int = 16  # --page-size of workers with the store (unless given)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"--router {self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.router == "bana" and self.policy not in LIVE_POLICIES:
            raise ValueError(f"--policy {self.policy!r}: the bana router knows {', '.join(LIVE_POLICIES)}")
        if self.router == "sglang" and self.api_key:
            raise ValueError("--api-key needs --router bana (the stock router is not wired for it)")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a PD cluster needs at least one prefill and one decode worker")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.startup_timeout <= 0:
            raise ValueError("--startup-timeout must be positive")
        if self.global_store and not self.mooncake_master:
            raise ValueError("the global store needs the Mooncake master")
        if self.store_bytes < 16 << 20:
            raise ValueError(f"--store-bytes {self.store_bytes} is too small (at least 16M)")
        if self.store_page_size < 1:
            raise ValueError("--store-page-size must be >= 1")


@dataclasses.dataclass(frozen=True)
class Part:
    """One process of the cluster and how to tell that it is ready."""

    name: str
    argv: tuple[str, ...]
    health_url: str | None = None  # HTTP 2xx means ready
    tcp_port: int | None = None  # else: accepting TCP connections means ready
    env: tuple[tuple[str, str], ...] = ()  # added to the plan's environment for this part only
    ready_line: str | None = None  # else: this text in its output means ready


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    endpoint: str
    model_path: str
    served_model_name: str
    master: Part | None
    workers: tuple[Part, ...]
    router: Part | None
    env: dict[str, str]
    api_key: str | None = None  # the endpoint's key, for readiness checks
    store: tuple[Part, ...] = ()  # the global store's storage process and index service

    @property
    def parts(self) -> tuple[Part, ...]:
        return ((self.master,) if self.master else ()) + self.store + self.workers + \
            ((self.router,) if self.router else ())


def dtype_args(model_path: str, user_args: tuple[str, ...] | list[str]) -> list[str]:
    """Keep a float32 checkpoint in float32.

    SGLang's ``--dtype auto`` silently runs float32 checkpoints in float16
    ("common practice", ``configs/model_config.py``), which breaks the
    exactness contract (greedy float32 tokens equal HF's) and, on CPU, is slow.
    A user's own ``--dtype`` always wins.
    """
    if any(a == "--dtype" or a.startswith("--dtype=") for a in user_args):
        return []
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32":
        return ["--dtype", "float32"]
    return []


def plan_cluster(cfg: LaunchConfig) -> ClusterPlan:
    """Pure planning: ports, command lines and environment; starts nothing."""
    from bana_sglang import models

    model_path = str(models.resolve(cfg.model_path))
    served = cfg.served_model_name or Path(model_path).name
    base = cfg.worker_base_port or cfg.port + 100
    low, high = ephemeral_range()
    if low <= base <= high:
        logger.warning("worker ports from %d lie in the kernel's ephemeral range %d-%d: an outgoing "
                       "connection may take one before its worker binds it; prefer ports below %d",
                       base, low, high, low)
    ports = PortAllocator(cfg.host, base, spacing=2)
    ports.taken.add(cfg.port)
    py = sys.executable
    h = cfg.host

    master = None
    if cfg.mooncake_master:
        rpc, metrics = ports.take(), ports.take()
        master = Part(
            name="mooncake-master",
            argv=(
                str(Path(py).parent / "mooncake_master"),
                f"-rpc_port={rpc}", f"-rpc_address={h}",
                f"-metrics_port={metrics}", f"-metrics_host={h}",
                "-enable_http_metadata_server=false",
                "-minloglevel=1",  # its INFO lines are a metrics dump every 20 s
            ),
            tcp_port=rpc,
        )

    store: list[Part] = []
    store_flags: dict[str, list[str]] = {}
    if cfg.global_store and master is not None:
        from bana_sglang.radix_global import flags, service, storage_server

        master_addr = f"{h}:{rpc}"
        # The index removes pages itself (prefix-aware eviction); a short lease
        # lets it remove a page soon after its last read.
        master = dataclasses.replace(master, argv=(*master.argv, "-default_kv_lease_ttl=2000"))
        index_port = ports.take()
        index_endpoint = f"tcp://{h}:{index_port}"
        store = [
            Part(name="kv-storage", argv=(
                py, "-m", "bana_sglang.radix_global.storage_server", "--master", master_addr,
                "--segment-bytes", str(cfg.store_bytes), "--host", h, "--log-level", "WARNING"),
                ready_line=storage_server.READY_LINE),
            Part(name="kv-index", argv=(
                py, "-m", "bana_sglang.radix_global.service", "--host", h, "--port", str(index_port),
                # headroom below the segment: Mooncake allocates in its own granules
                "--capacity-bytes", str(cfg.store_bytes * 9 // 10), "--master", master_addr),
                ready_line=service.READY_LINE),
        ]
        for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
            for i in range(count):
                store_flags[f"{role}-{i}"] = flags.linker_args(index_endpoint, master_addr, owner=f"{role}-{i}")

    workers: list[Part] = []
    prefill_urls: list[tuple[str, int]] = []
    decode_urls: list[str] = []
    for role, count, role_args in (("prefill", cfg.num_prefill, cfg.prefill_args),
                                   ("decode", cfg.num_decode, cfg.decode_args)):
        for i in range(count):
            port = ports.take()
            user = (*cfg.sglang_args, *role_args)
            argv = [
                py, "-m", "sglang.launch_server",
                "--model-path", model_path, "--served-model-name", served,
                "--host", h, "--port", str(port),
                "--disaggregation-mode", role,
                "--disaggregation-transfer-backend", "mooncake",
            ]
            url = f"http://{h}:{port}"
            if role == "prefill":
                boot = ports.take()
                argv += ["--disaggregation-bootstrap-port", str(boot)]
                prefill_urls.append((url, boot))
            else:
                decode_urls.append(url)
            argv += compat.server_args(role, user_args=user) + dtype_args(model_path, user)
            argv += store_args(role, store_flags.get(f"{role}-{i}"), cfg.store_page_size, user) + list(user)
            workers.append(Part(name=f"{role}-{i}", argv=tuple(argv), health_url=url + "/health"))

    endpoint = f"http://{h}:{cfg.port}"
    env = compat.child_env(host=h)
    if cfg.router == "bana":
        router_argv = [
            py, "-m", "bana_sglang.router", "--host", h, "--port", str(cfg.port),
            "--policy", cfg.policy, "--model-path", model_path, "--served-model-name", served,
        ]
        for url, boot in prefill_urls:
            router_argv += ["--prefill", url, str(boot)]
        for url in decode_urls:
            router_argv += ["--decode", url]
        if store:
            router_argv += ["--global-index", index_endpoint, "--store-page-size",
                            str(page_size_of((*cfg.sglang_args, *cfg.prefill_args), cfg.store_page_size))]
        router_argv += list(cfg.router_args)
        # /health is 503 until a prefill and a decode worker answer and the model is known.
        router = Part(name="router", argv=tuple(router_argv), health_url=endpoint + "/health",
                      env=(("BANA_ROUTER_API_KEY", cfg.api_key),) if cfg.api_key else ())
    else:
        router_argv = [
            py, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", h, "--port", str(cfg.port),
            "--prometheus-host", h, "--prometheus-port", str(ports.take()),
        ]
        for url, boot in prefill_urls:
            router_argv += ["--prefill", url, str(boot)]
        for url in decode_urls:
            router_argv += ["--decode", url]
        if cfg.policy != "bana":
            router_argv += ["--policy", cfg.policy]
        if "--log-level" not in cfg.router_args:
            router_argv += ["--log-level", "warn"]  # its INFO is a per-step workflow trace
        router_argv += list(cfg.router_args)
        # The stock router's /health is 200 before it has registered any worker; its
        # /v1/models answers 503 "No models available" until it has.
        router = Part(name="router", argv=tuple(router_argv), health_url=endpoint + "/v1/models")
    return ClusterPlan(
        endpoint=endpoint, model_path=model_path, served_model_name=served,
        master=master, workers=tuple(workers), router=router, env=env, api_key=cfg.api_key,
        store=tuple(store),
    )


def page_size_of(user_args: tuple[str, ...], default: int) -> int:
    """The --page-size among SGLang flags, else ``default``."""
    for i, a in enumerate(user_args):
        if a == "--page-size" and i + 1 < len(user_args):
            return int(user_args[i + 1])
        if a.startswith("--page-size="):
            return int(a.split("=", 1)[1])
    return default


def store_args(role: str, linker_flags: list[str] | None, page_size: int,
               user_args: tuple[str, ...]) -> list[str]:
    """Worker flags for the global store: the linker, a page size (the store's
    unit; one index entry per page), SGLang's metrics (the store's counters
    are exported through them) and, on decode workers, SGLang's radix cache
    (off by default there; finished requests reach the store through it). A
    flag the user gave wins."""
    if not linker_flags:
        return []
    present = {a.split("=", 1)[0] for a in user_args if a.startswith("--")}
    out = list(linker_flags)
    if "--page-size" not in present:
        out += ["--page-size", str(page_size)]
    if "--enable-metrics" not in present:
        out.append("--enable-metrics")
    if role == "decode" and "--disaggregation-decode-enable-radix-cache" not in present:
        out.append("--disaggregation-decode-enable-radix-cache")
    return out


def plan_single_server(
    model_path: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 31000,
    sglang_args: tuple[str, ...] = (),
    name: str = "server",
) -> ClusterPlan:
    """A plain, colocated SGLang server (no PD, no router): the reference that
    PD, cache and migration results are compared with, and a baseline."""
    from bana_sglang import models

    path = str(models.resolve(model_path))
    served = Path(path).name
    argv = (
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", path, "--served-model-name", served,
        "--host", host, "--port", str(port),
        *compat.server_args("null", user_args=sglang_args), *dtype_args(path, sglang_args), *sglang_args,
    )
    url = f"http://{host}:{port}"
    return ClusterPlan(
        endpoint=url, model_path=path, served_model_name=served, master=None,
        workers=(Part(name=name, argv=argv, health_url=url + "/health"),),
        router=None, env=compat.child_env(host=host),
    )


def smoke_request(endpoint: str, model: str, timeout: float = 60.0, api_key: str | None = None) -> bool:
    """One greedy token through ``/v1/completions``: True when it came back."""
    body = json.dumps({"model": model, "prompt": "ready?", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(endpoint + "/v1/completions", data=body,
                                 headers={"content-type": "application/json", **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200 and bool(json.loads(resp.read()).get("choices"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Cluster:
    """Runs a :class:`ClusterPlan`: start in order, wait for health, stop everything."""

    def __init__(self, plan: ClusterPlan, *, log_dir: Path | None = None, startup_timeout: float = 600.0):
        self.plan = plan
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.procs: list[ManagedProcess] = []
        self.stop_event = threading.Event()
        self._reported_dead: set[str] = set()

    def _spawn(self, part: Part) -> ManagedProcess:
        proc = ManagedProcess(part.name, part.argv, {**self.plan.env, **dict(part.env)}, log_dir=self.log_dir)
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
        elif part.health_url:
            headers = auth_headers(self.plan.api_key) if part is self.plan.router else {}
            check = lambda: http_ok(part.health_url, headers=headers)  # noqa: E731
            what = f"healthy answer at {part.health_url}"
        else:
            check = lambda: tcp_open(h, part.tcp_port)  # noqa: E731
            what = f"listening socket on port {part.tcp_port}"
        wait_until(check, proc=proc, what=what, timeout=max(1.0, deadline - time.monotonic()),
                   stop=self.stop_event)
        logger.info("%s is ready", part.name)

    def start(self) -> None:
        """Start every part; raises :class:`ProcessStartError` (after stopping all) on failure."""
        deadline = time.monotonic() + self.startup_timeout
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
                wait_until(lambda: smoke_request(self.plan.endpoint, self.plan.served_model_name,
                                                 api_key=self.plan.api_key),
                           proc=router, what="a first request served end to end",
                           timeout=max(1.0, deadline - time.monotonic()), stop=self.stop_event)
                logger.info("first request served end to end")
        except BaseException:
            self.stop()
            raise

    def check_parts(self) -> str | None:
        """Report newly exited parts; a reason to stop the cluster, or None.

        A worker that dies is logged and left to the router (it marks the worker
        down and retries elsewhere) while one prefill and one decode worker are
        still alive; the router or the Mooncake master dying stops everything.
        """
        for p in self.procs:
            if p.poll() is not None and p.name not in self._reported_dead:
                self._reported_dead.add(p.name)
                logger.error("%s exited unexpectedly (code %s). Last output:\n    %s",
                             p.name, p.poll(), "\n    ".join(p.tail()[-15:]))
        dead = self._reported_dead
        vital = {part.name for part in (self.plan.master, self.plan.router) if part}
        if dead & vital:
            return f"{', '.join(sorted(dead & vital))} exited"
        for role in ("prefill", "decode"):
            names = {w.name for w in self.plan.workers if w.name.startswith(role + "-")}
            if names and names <= dead:
                return f"no {role} worker is left"
        return None

    def stop(self) -> None:
        """Stop the router first (no new requests), then everything else together. Idempotent."""
        self.stop_event.set()
        router = self.plan.router.name if self.plan.router else None
        front = [p for p in self.procs if p.name == router]
        rest = [p for p in self.procs if p.name != router]
        for group in (front, rest):
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
    p.add_argument("--model-path", default=None,
                   help="HF model folder, or an embedded model name (tiny, small) built on "
                        "first use; default: the embedded tiny model")
    p.add_argument("--served-model-name", default=None, help="model name clients use; default: the folder name")
    p.add_argument("--num-prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address every part binds to")
    p.add_argument("--port", type=int, default=30000, help="port of the OpenAI-compatible endpoint")
    p.add_argument("--worker-base-port", type=int, default=None,
                   help="first port for workers, bootstrap and Mooncake (default: --port + 100, "
                        "skipping busy ports)")
    p.add_argument("--sglang-args", default="",
                   help="extra SGLang server flags for every worker, as one shell-quoted string, "
                        "e.g. \"--max-total-tokens 8192 --chunked-prefill-size 1024\"")
    p.add_argument("--prefill-args", default="", help="extra SGLang flags for prefill workers only")
    p.add_argument("--decode-args", default="", help="extra SGLang flags for decode workers only")
    p.add_argument("--router", default="bana", choices=ROUTERS,
                   help="front: bana (bana_sglang.router, load-aware) or sglang (the stock sglang_router, "
                        "for comparisons)")
    p.add_argument("--policy", default="bana",
                   help=f"routing policy; bana router: {', '.join(LIVE_POLICIES)}; stock router: its own "
                        "names (cache_aware, round_robin, power_of_two, random); 'bana' keeps its default")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' at the endpoint (bana router; default: "
                        "$BANA_API_KEY, else none)")
    p.add_argument("--global-store", action=argparse.BooleanOptionalAction, default=True,
                   help="run the global KV cache store (storage process, index service, the linker on "
                        "every worker); --no-global-store: stock SGLang private prefix caches")
    p.add_argument("--store-bytes", type=_cli.byte_size, default=1 << 30,
                   help="memory of the store's Mooncake segment, e.g. 512M or 4G")
    p.add_argument("--store-page-size", type=int, default=16,
                   help="--page-size of workers with the global store (a page is the store's unit)")
    p.add_argument("--router-args", default="",
                   help="extra router flags as one string, e.g. \"--poll-interval 0.1\"")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="write each part's log to DIR/NAME.log instead of the prefixed console stream")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the whole cluster to become healthy")
    p.add_argument("--dry-run", action="store_true", help="print the plan (commands, ports) and exit")
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
        api_key=args.api_key or os.environ.get("BANA_API_KEY") or None,
        log_dir=args.log_dir,
        startup_timeout=args.startup_timeout,
        global_store=args.global_store,
        store_bytes=args.store_bytes,
        store_page_size=args.store_page_size,
    )


def main(argv: list[str] | None = None) -> int:
    args, cfg = _cli.parse(build_parser(), argv, config_from_args)
    plan = plan_cluster(cfg)
    if args.dry_run:
        print(f"endpoint: {plan.endpoint}  model: {plan.served_model_name} ({plan.model_path})")
        print(f"cpu layer: {'on' if compat.cpu_mode() else 'off'}")
        for part in plan.parts:
            print(f"{part.name}: {shlex.join(part.argv)}")
        return 0

    cluster = Cluster(plan, log_dir=cfg.log_dir, startup_timeout=cfg.startup_timeout)

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
    print(f"{READY_MARK}: {plan.endpoint} (OpenAI-compatible; model {plan.served_model_name!r}; "
          f"{cfg.num_prefill}P{cfg.num_decode}D; up in {time.monotonic() - t0:.0f}s)", flush=True)
    code = 0
    while not cluster.stop_event.wait(1.0):
        why = cluster.check_parts()
        if why is not None:
            logger.error("%s; stopping the cluster", why)
            code = 1
            break
    if plan.store:
        from bana_sglang.radix_global import summary

        rows = [(w.name, summary.scrape(w.health_url.removesuffix("/health"), timeout=2.0)) for w in plan.workers]
        logger.info("global KV store, per worker:\n%s", summary.table(rows))
    cluster.stop()
    logger.info("cluster stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
