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

from bana_sglang import _cli, compat, models
from bana_sglang import spec as cluster_spec
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
NODE_READY_MARK = "bana_sglang: node ready:"
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
    tcp_host: str | None = None  # where to check tcp_port (default: the endpoint's host)
    env: tuple[tuple[str, str], ...] = ()  # added to the plan's environment for this part only
    ready_line: str | None = None  # else: this text in its output means ready
    needs: tuple[tuple[str, str], ...] = ()  # (name, host:port) on other nodes to wait for before starting


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
    node: str | None = None  # a cluster spec's node whose share this is; None: the whole cluster

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
    h = cfg.host

    master = None
    store: list[Part] = []
    index_endpoint = master_addr = None
    if cfg.mooncake_master:
        rpc, metrics = ports.take(), ports.take()
        master = master_part(h, rpc, metrics, for_store=cfg.global_store)
        master_addr = f"{h}:{rpc}"
        if cfg.global_store:
            index_port = ports.take()
            index_endpoint = f"tcp://{h}:{index_port}"
            store = store_parts(h, h, master_addr, index_port, cfg.store_bytes)

    workers: list[Part] = []
    prefill_urls: list[tuple[str, int]] = []
    decode_urls: list[str] = []
    for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
        for i in range(count):
            port = ports.take()
            boot = ports.take() if role == "prefill" else None
            agent_port = ports.take()
            workers.append(worker_part(
                f"{role}-{i}", role, model_path=model_path, served=served, bind=h, port=port,
                bootstrap_port=boot, agent_port=agent_port,
                user_args=(*cfg.sglang_args, *(cfg.prefill_args if role == "prefill" else cfg.decode_args)),
                index_endpoint=index_endpoint, master_addr=master_addr, page_size=cfg.store_page_size))
            if boot is not None:
                prefill_urls.append((f"http://{h}:{port}", boot))
            else:
                decode_urls.append(f"http://{h}:{port}")

    endpoint = f"http://{h}:{cfg.port}"
    if cfg.router == "bana":
        watch = ([("mooncake-master", master_addr)] if master_addr else []) + \
            ([("kv-index", index_endpoint.removeprefix("tcp://"))] if index_endpoint else [])
        router = router_part(
            bind=h, port=cfg.port, endpoint=endpoint, policy=cfg.policy, model_path=model_path, served=served,
            prefill_urls=prefill_urls, decode_urls=decode_urls, index_endpoint=index_endpoint,
            page_size=page_size_of((*cfg.sglang_args, *cfg.prefill_args), cfg.store_page_size),
            watch=watch, user_args=cfg.router_args, api_key=cfg.api_key,
            agents=[(w.health_url.removesuffix("/health"), dict(w.env)["BANA_AGENT_ENDPOINT"]) for w in workers])
    else:
        router_argv = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
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
        master=master, workers=tuple(workers), router=router, env=compat.child_env(host=h),
        api_key=cfg.api_key, store=tuple(store),
    )


# ----------------------------------------------------------------- part builders
# Shared by the single-machine plan above and the per-node plan of a cluster spec.

def master_part(bind: str, rpc: int, metrics: int, *, for_store: bool, host: str | None = None) -> Part:
    """``mooncake_master`` listening on ``bind``; ``host`` is where its readiness is checked."""
    argv = [
        str(Path(sys.executable).parent / "mooncake_master"),
        f"-rpc_port={rpc}", f"-rpc_address={bind}",
        f"-metrics_port={metrics}", f"-metrics_host={bind}",
        "-enable_http_metadata_server=false",
        "-minloglevel=1",  # its INFO lines are a metrics dump every 20 s
    ]
    if for_store:
        # The index removes pages itself (prefix-aware eviction); a short lease
        # lets it remove a page soon after its last read.
        argv.append("-default_kv_lease_ttl=2000")
    return Part(name="mooncake-master", argv=tuple(argv), tcp_port=rpc, tcp_host=host or bind)


def store_parts(bind: str, address: str, master_addr: str, index_port: int, store_bytes: int, *,
                protocol: str = "tcp", rdma_devices: str = "",
                needs: tuple[tuple[str, str], ...] = ()) -> list[Part]:
    """The global store: the storage process (the only Mooncake segment) and the index service."""
    from bana_sglang.radix_global import service, storage_server

    py = sys.executable
    storage = [py, "-m", "bana_sglang.radix_global.storage_server", "--master", master_addr,
               "--segment-bytes", str(store_bytes), "--host", address, "--protocol", protocol,
               "--log-level", "WARNING"]
    if rdma_devices:
        storage += ["--rdma-devices", rdma_devices]
    if needs:  # a master on another node may come up later: the launcher waits, then so can this
        storage += ["--setup-timeout", "3600"]
    return [
        Part(name="kv-storage", argv=tuple(storage), ready_line=storage_server.READY_LINE, needs=needs),
        Part(name="kv-index", argv=(
            py, "-m", "bana_sglang.radix_global.service", "--host", bind, "--port", str(index_port),
            # headroom below the segment: Mooncake allocates in its own granules
            "--capacity-bytes", str(store_bytes * 9 // 10), "--master", master_addr),
            ready_line=service.READY_LINE),
    ]


def worker_part(name: str, role: str, *, model_path: str, served: str, bind: str, port: int,
                bootstrap_port: int | None, user_args: tuple[str, ...], index_endpoint: str | None,
                master_addr: str | None, page_size: int, advertise: str | None = None,
                agent_port: int | None = None) -> Part:
    """One SGLang PD worker with the extension (and the global store's linker when there is one,
    and the migration agent on ``agent_port``)."""
    from bana_sglang.radix_global import flags

    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path, "--served-model-name", served,
        "--host", bind, "--port", str(port),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", "mooncake",
    ]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    linker = flags.linker_args(index_endpoint, master_addr, owner=name) if index_endpoint and master_addr else None
    argv += compat.server_args(role, user_args=user_args) + dtype_args(model_path, user_args)
    argv += store_args(role, linker, page_size, user_args) + list(user_args)
    url = f"http://{advertise or bind}:{port}"
    env: tuple[tuple[str, str], ...] = ()
    if agent_port is not None:
        env = (("BANA_AGENT_ENDPOINT", f"tcp://{bind}:{agent_port}"), ("BANA_WORKER_NAME", name),
               ("BANA_AGENT_HOST", advertise or bind))
    return Part(name=name, argv=tuple(argv), health_url=url + "/health", env=env)


def router_part(*, bind: str, port: int, endpoint: str, policy: str, model_path: str, served: str,
                prefill_urls: list[tuple[str, int]], decode_urls: list[str], index_endpoint: str | None,
                page_size: int, watch: list[tuple[str, str]], user_args: tuple[str, ...],
                api_key: str | None, agents: list[tuple[str, str]] = ()) -> Part:
    """The bana router in front of the workers; it also watches the store's parts for ``/health``."""
    argv = [
        sys.executable, "-m", "bana_sglang.router", "--host", bind, "--port", str(port),
        "--policy", policy, "--model-path", model_path, "--served-model-name", served,
    ]
    for url, boot in prefill_urls:
        argv += ["--prefill", url, str(boot)]
    for url in decode_urls:
        argv += ["--decode", url]
    if index_endpoint:
        argv += ["--global-index", index_endpoint, "--store-page-size", str(page_size)]
    for name, addr in watch:
        argv += ["--watch", f"{name}={addr}"]
    for url, agent in agents:  # the workers' migration agents (admin endpoints)
        argv += ["--agent", f"{url}={agent}"]
    argv += list(user_args)
    # /health is 503 until a prefill and a decode worker answer and the model is known.
    return Part(name="router", argv=tuple(argv), health_url=endpoint + "/health",
                env=(("BANA_ROUTER_API_KEY", api_key),) if api_key else ())


def plan_spec(spec: cluster_spec.ClusterSpec, node: str | None, *, dry_run: bool = False) -> ClusterPlan:
    """The share of ``node`` in a cluster spec (``None``: every node's parts, for --dry-run).

    ``dry_run`` takes a model folder as written and does not ask for the API
    key's variable (a dry run on a machine that is not the node); starting a
    node checks both. Flags that depend on the machine (the CPU layer's) are
    this machine's."""
    from bana_sglang import models

    if node is not None:
        spec.node(node)  # a clear error for an unknown name
    model_path = str(models.resolve(spec.model)) if not dry_run or spec.model in models.SPECS or \
        spec.model is None else spec.model
    served = spec.served_model_name or Path(model_path).name
    nodes = {n.name: n for n in spec.nodes}
    mnode = nodes[spec.master.node]
    master_addr = f"{mnode.address}:{spec.master.rpc_port}"
    parts: list[tuple[str, Part]] = [(mnode.name, master_part(
        mnode.bind_address, spec.master.rpc_port, spec.master.metrics_port, for_store=spec.store is not None,
        host=mnode.address))]
    index_endpoint = None
    store: list[tuple[str, Part]] = []
    if spec.store:
        snode = nodes[spec.store.node]
        index_endpoint = f"tcp://{snode.address}:{spec.store.index_port}"
        needs = (("mooncake-master", master_addr),) if snode.name != mnode.name else ()
        store = [(snode.name, p) for p in store_parts(
            snode.bind_address, snode.address, master_addr, spec.store.index_port, spec.store.bytes,
            protocol=cluster_spec.resolve_transport(snode), rdma_devices=snode.rdma_devices, needs=needs)]
    page_size = spec.store.page_size if spec.store else 16
    agents: list[tuple[str, str]] = []
    workers: list[tuple[str, Part]] = []
    prefill_urls: list[tuple[str, int]] = []
    decode_urls: list[str] = []
    for (n, name), w in zip(spec.workers(), [w for node_ in spec.nodes for w in node_.workers]):
        user = (*spec.sglang_args, *(spec.prefill_args if w.role == "prefill" else spec.decode_args),
                *device_args(w.device, cluster_spec.resolve_transport(n), n.rdma_devices), *w.args)
        workers.append((n.name, worker_part(
            name, w.role, model_path=model_path, served=served, bind=n.bind_address, port=w.port,
            bootstrap_port=w.bootstrap_port, user_args=user, index_endpoint=index_endpoint,
            master_addr=master_addr if index_endpoint else None, page_size=page_size, advertise=n.address,
            agent_port=w.agent_port)))
        if w.agent_port is not None:
            agents.append((f"http://{n.address}:{w.port}", f"tcp://{n.address}:{w.agent_port}"))
        url = f"http://{n.address}:{w.port}"
        if w.role == "prefill":
            prefill_urls.append((url, w.bootstrap_port))
        else:
            decode_urls.append(url)
    rnode = nodes[spec.router.node]
    endpoint = f"http://{rnode.address}:{spec.router.port}"
    api_key = os.environ.get(spec.router.api_key_env) if spec.router.api_key_env else None
    if spec.router.api_key_env and node == rnode.name and not api_key and not dry_run:
        raise cluster_spec.SpecError(f"router.api_key_env: ${spec.router.api_key_env} is not set on this node")
    watch = [("mooncake-master", master_addr)]
    if index_endpoint:
        watch.append(("kv-index", index_endpoint.removeprefix("tcp://")))
    router = (rnode.name, router_part(
        bind=rnode.bind_address, port=spec.router.port, endpoint=endpoint, policy=spec.router.policy,
        model_path=model_path, served=served, prefill_urls=prefill_urls, decode_urls=decode_urls,
        index_endpoint=index_endpoint, page_size=page_size, watch=watch, user_args=tuple(spec.router.args),
        api_key=api_key, agents=agents))

    def mine(items: list[tuple[str, Part]]) -> list[Part]:
        return [p for n, p in items if node is None or n == node]

    env_node = nodes[node] if node is not None else None
    env = compat.child_env() if env_node is None else \
        compat.child_env({**os.environ, **cluster_spec.node_env(env_node)}, host=env_node.address)
    return ClusterPlan(
        endpoint=endpoint, model_path=model_path, served_model_name=served,
        master=(mine(parts) or [None])[0], workers=tuple(mine(workers)), router=(mine([router]) or [None])[0],
        env=env, api_key=api_key, store=tuple(mine(store)), node=node,
    )


def device_args(device: str, transport: str, rdma_devices: str) -> list[str]:
    """SGLang flags for a spec worker's ``device`` and its node's transport."""
    out: list[str] = []
    if device == "cpu":
        out += ["--device", "cpu"]
    elif device.startswith("cuda"):
        out += ["--device", "cuda"]
        if ":" in device:
            out += ["--base-gpu-id", device.split(":", 1)[1]]
    if transport == "rdma" and rdma_devices:
        out += ["--disaggregation-ib-device", rdma_devices]
    return out


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


class _RouterHealth:
    """Readiness of the router; while it is not ready, says every 15 s which
    parts its ``/health`` reports missing (on a multi-node cluster: what this
    node is waiting for elsewhere)."""

    def __init__(self, url: str, headers: dict[str, str], note_every: float = 15.0):
        self.url, self.headers, self.note_every = url, headers, note_every
        self.next_note = time.monotonic() + note_every

    def __call__(self) -> bool:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, headers=self.headers), timeout=2.0) as r:
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

    def __init__(self, plan: ClusterPlan, *, log_dir: Path | None = None, startup_timeout: float = 600.0):
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
                    logger.info("%s waits for %s at %s (%.0fs so far)", part.name, name, addr, now - t0)
                    next_note = now + 10.0
                if now > self._deadline:
                    raise ProcessStartError(part.name, f"{name} at {addr} never came up")
                if self.stop_event.wait(min(2.0, 0.1 * 2 ** attempt)):
                    raise ProcessStartError(part.name, f"interrupted while waiting for {name}")
                attempt += 1

    def _spawn(self, part: Part) -> ManagedProcess:
        self._wait_needs(part)
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
        wait_until(check, proc=proc, what=what, timeout=max(1.0, deadline - time.monotonic()),
                   stop=self.stop_event)
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
        A node of a cluster spec stops when every one of its parts has exited
        (its workers' peers are elsewhere: the router decides what is left).
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
        if self.plan.node is not None:
            names = {p.name for p in self.plan.parts}
            return f"every part of node {self.plan.node} exited" if names and names <= dead else None
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
    p.add_argument("--spec", type=Path, default=None, metavar="FILE",
                   help="a cluster spec (YAML/TOML: hosts, workers, ports, where the master, store and "
                        "router run); with --node, start that node's share. The spec replaces the "
                        "cluster flags above. See docs/specs/")
    p.add_argument("--node", default=None,
                   help="the spec node to start (default: the only node of a one-node spec)")
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


# Flags a cluster spec replaces: giving one with --spec is an error, not silently ignored.
SPEC_REPLACES = ("model_path", "served_model_name", "num_prefill", "num_decode", "host", "port",
                 "worker_base_port", "sglang_args", "prefill_args", "decode_args", "router", "policy",
                 "api_key", "global_store", "store_bytes", "store_page_size", "router_args")


def _plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    cfg: LaunchConfig | None) -> ClusterPlan:
    if args.spec is None:
        if args.node is not None:
            parser.error("--node needs --spec")
        return plan_cluster(cfg)
    given = [d for d in SPEC_REPLACES if getattr(args, d) != parser.get_default(d)]
    if given:
        parser.error(f"--spec replaces {', '.join('--' + d.replace('_', '-') for d in given)}: "
                     "set these in the spec file")
    try:
        spec = cluster_spec.load(args.spec)
        node = args.node
        if node is None and not args.dry_run:
            if len(spec.nodes) != 1:
                raise cluster_spec.SpecError(
                    f"{args.spec} has {len(spec.nodes)} nodes: say which to start with --node "
                    f"({', '.join(n.name for n in spec.nodes)})")
            node = spec.nodes[0].name
        return plan_spec(spec, node, dry_run=args.dry_run)
    except (cluster_spec.SpecError, models.ModelBuildError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
        raise  # unreachable


def _parts_by_node(spec_path: Path | None, plan: ClusterPlan) -> list[tuple[str | None, Part]]:
    """The plan's parts, each with its spec node when the whole spec is shown."""
    if spec_path is None or plan.node is not None:
        return [(f"[{plan.node}]" if plan.node else None, p) for p in plan.parts]
    spec = cluster_spec.load(spec_path)
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
    plan = _plan_from_args(parser, args, cfg)
    if args.dry_run:
        print(f"endpoint: {plan.endpoint}  model: {plan.served_model_name} ({plan.model_path})")
        print(f"cpu layer: {'on' if compat.cpu_mode() else 'off'}")
        for node, part in _parts_by_node(args.spec, plan):
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
        print(f"{NODE_READY_MARK} {plan.node}: {', '.join(p.name for p in plan.parts)} "
              f"(up in {time.monotonic() - t0:.0f}s)", flush=True)
    if plan.router is not None:
        roles = [w.argv[w.argv.index("--disaggregation-mode") + 1] for w in plan.workers
                 if "--disaggregation-mode" in w.argv]
        shape = f"{roles.count('prefill')}P{roles.count('decode')}D" if plan.node is None else \
            f"node {plan.node}"
        print(f"{READY_MARK}: {plan.endpoint} (OpenAI-compatible; model {plan.served_model_name!r}; "
              f"{shape}; up in {time.monotonic() - t0:.0f}s)", flush=True)
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
