"""Planning a cluster: which processes, with which command lines, ports and
environment. Pure: nothing here starts a process (``bana_sglang.launch`` runs
a plan).

- :func:`plan_cluster`: the single-machine cluster from a :class:`LaunchConfig`
  (ports chosen by scanning for free ones);
- :func:`plan_spec`: one node's share of a cluster spec (``bana_sglang.launch.spec``);
- :func:`plan_single_server`: a plain colocated SGLang server (the reference);
- the part builders both share (master, store, worker, router).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from bana_sglang import compat, models
from bana_sglang.launch import spec as cluster_spec
from bana_sglang.launch.procs import PortAllocator, ephemeral_range
from bana_sglang.router.policy import LIVE_POLICIES

logger = logging.getLogger("bana_sglang.launch")

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
    balancer: str = "none"  # "bana": the live balancer (migrate/controller.py); "none": static PD
    balancer_args: tuple[str, ...] = ()
    cpu_threads: int = 0  # OMP threads per worker on CPU; 0: the machine's CPUs / workers

    def __post_init__(self) -> None:
        if self.balancer not in BALANCER_CHOICES:
            raise ValueError(
                f"--balancer {self.balancer!r}: choose one of {', '.join(BALANCER_CHOICES)}"
            )
        if self.balancer != "none" and self.router != "bana":
            raise ValueError(
                "--balancer needs --router bana (it acts through the bana router's admin API)"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"--router {self.router!r}: choose one of {', '.join(ROUTERS)}")
        if self.router == "bana" and self.policy not in LIVE_POLICIES:
            raise ValueError(
                f"--policy {self.policy!r}: the bana router knows {', '.join(LIVE_POLICIES)}"
            )
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
        if self.cpu_threads < 0:
            raise ValueError(
                f"--cpu-threads {self.cpu_threads}: give a positive count, or 0 for automatic"
            )


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
    needs: tuple[
        tuple[str, str], ...
    ] = ()  # (name, host:port) on other nodes to wait for before starting


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
    balancer: Part | None = None  # the live balancer, started after the router

    @property
    def parts(self) -> tuple[Part, ...]:
        return (
            ((self.master,) if self.master else ())
            + self.store
            + self.workers
            + ((self.router,) if self.router else ())
            + ((self.balancer,) if self.balancer else ())
        )


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
    model_path = str(models.resolve(cfg.model_path))
    served = cfg.served_model_name or Path(model_path).name
    base = cfg.worker_base_port or cfg.port + 100
    low, high = ephemeral_range()
    if low <= base <= high:
        logger.warning(
            "worker ports from %d lie in the kernel's ephemeral range %d-%d: an outgoing "
            "connection may take one before its worker binds it; prefer ports below %d",
            base,
            low,
            high,
            low,
        )
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
            workers.append(
                worker_part(
                    f"{role}-{i}",
                    role,
                    model_path=model_path,
                    served=served,
                    bind=h,
                    port=port,
                    bootstrap_port=boot,
                    agent_port=agent_port,
                    user_args=(
                        *cfg.sglang_args,
                        *(cfg.prefill_args if role == "prefill" else cfg.decode_args),
                    ),
                    index_endpoint=index_endpoint,
                    master_addr=master_addr,
                    page_size=cfg.store_page_size,
                )
            )
            if boot is not None:
                prefill_urls.append((f"http://{h}:{port}", boot))
            else:
                decode_urls.append(f"http://{h}:{port}")

    endpoint = f"http://{h}:{cfg.port}"
    if cfg.router == "bana":
        watch = ([("mooncake-master", master_addr)] if master_addr else []) + (
            [("kv-index", index_endpoint.removeprefix("tcp://"))] if index_endpoint else []
        )
        router = router_part(
            bind=h,
            port=cfg.port,
            endpoint=endpoint,
            policy=cfg.policy,
            model_path=model_path,
            served=served,
            prefill_urls=prefill_urls,
            decode_urls=decode_urls,
            index_endpoint=index_endpoint,
            page_size=page_size_of((*cfg.sglang_args, *cfg.prefill_args), cfg.store_page_size),
            watch=watch,
            user_args=cfg.router_args,
            api_key=cfg.api_key,
            agents=[
                (w.health_url.removesuffix("/health"), dict(w.env)["BANA_AGENT_ENDPOINT"])
                for w in workers
            ],
        )
    else:
        router_argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--host",
            h,
            "--port",
            str(cfg.port),
            "--prometheus-host",
            h,
            "--prometheus-port",
            str(ports.take()),
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
    balancer = None
    if cfg.balancer != "none":
        balancer = balancer_part(
            bind=h,
            port=ports.take(),
            endpoint=endpoint,
            model_path=model_path,
            policy=cfg.balancer,
            page_size=cfg.store_page_size,
            api_key=cfg.api_key,
            user_args=cfg.balancer_args,
        )
    return ClusterPlan(
        endpoint=endpoint,
        model_path=model_path,
        served_model_name=served,
        master=master,
        workers=tuple(workers),
        router=router,
        env=compat.with_cpu_threads(compat.child_env(host=h), len(workers), cfg.cpu_threads),
        api_key=cfg.api_key,
        store=tuple(store),
        balancer=balancer,
    )


# ----------------------------------------------------------------- part builders
# Shared by the single-machine plan above and the per-node plan of a cluster spec.


def master_part(
    bind: str, rpc: int, metrics: int, *, for_store: bool, host: str | None = None
) -> Part:
    """``mooncake_master`` listening on ``bind``; ``host`` is where its readiness is checked."""
    argv = [
        str(Path(sys.executable).parent / "mooncake_master"),
        f"-rpc_port={rpc}",
        f"-rpc_address={bind}",
        f"-metrics_port={metrics}",
        f"-metrics_host={bind}",
        "-enable_http_metadata_server=false",
        "-minloglevel=1",  # its INFO lines are a metrics dump every 20 s
    ]
    if for_store:
        # The index removes pages itself (prefix-aware eviction); a short lease
        # lets it remove a page soon after its last read.
        argv.append("-default_kv_lease_ttl=2000")
    return Part(name="mooncake-master", argv=tuple(argv), tcp_port=rpc, tcp_host=host or bind)


def store_parts(
    bind: str,
    address: str,
    master_addr: str,
    index_port: int,
    store_bytes: int,
    *,
    protocol: str = "tcp",
    rdma_devices: str = "",
    needs: tuple[tuple[str, str], ...] = (),
) -> list[Part]:
    """The global store: the storage process (the only Mooncake segment) and the index service."""
    from bana_sglang.radix_global import service, storage_server

    py = sys.executable
    storage = [
        py,
        "-m",
        "bana_sglang.radix_global.storage_server",
        "--master",
        master_addr,
        "--segment-bytes",
        str(store_bytes),
        "--host",
        address,
        "--protocol",
        protocol,
        "--log-level",
        "WARNING",
    ]
    if rdma_devices:
        storage += ["--rdma-devices", rdma_devices]
    if needs:  # a master on another node may come up later: the launcher waits, then so can this
        storage += ["--setup-timeout", "3600"]
    return [
        Part(
            name="kv-storage",
            argv=tuple(storage),
            ready_line=storage_server.READY_LINE,
            needs=needs,
        ),
        Part(
            name="kv-index",
            argv=(
                py,
                "-m",
                "bana_sglang.radix_global.service",
                "--host",
                bind,
                "--port",
                str(index_port),
                # headroom below the segment: Mooncake allocates in its own granules
                "--capacity-bytes",
                str(store_bytes * 9 // 10),
                "--master",
                master_addr,
            ),
            ready_line=service.READY_LINE,
        ),
    ]


def worker_part(
    name: str,
    role: str,
    *,
    model_path: str,
    served: str,
    bind: str,
    port: int,
    bootstrap_port: int | None,
    user_args: tuple[str, ...],
    index_endpoint: str | None,
    master_addr: str | None,
    page_size: int,
    advertise: str | None = None,
    agent_port: int | None = None,
) -> Part:
    """One SGLang PD worker with the extension (and the global store's linker when there is one,
    and the migration agent on ``agent_port``)."""
    from bana_sglang.radix_global import config as flags

    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--served-model-name",
        served,
        "--host",
        bind,
        "--port",
        str(port),
        "--disaggregation-mode",
        role,
        "--disaggregation-transfer-backend",
        "mooncake",
    ]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    linker = (
        flags.linker_args(index_endpoint, master_addr, owner=name)
        if index_endpoint and master_addr
        else None
    )
    argv += compat.server_args(role, user_args=user_args) + dtype_args(model_path, user_args)
    argv += store_args(role, linker, page_size, user_args) + list(user_args)
    url = f"http://{advertise or bind}:{port}"
    env: tuple[tuple[str, str], ...] = ()
    if agent_port is not None:
        env = (
            ("BANA_AGENT_ENDPOINT", f"tcp://{bind}:{agent_port}"),
            ("BANA_WORKER_NAME", name),
            ("BANA_AGENT_HOST", advertise or bind),
        )
    return Part(name=name, argv=tuple(argv), health_url=url + "/health", env=env)


def router_part(
    *,
    bind: str,
    port: int,
    endpoint: str,
    policy: str,
    model_path: str,
    served: str,
    prefill_urls: list[tuple[str, int]],
    decode_urls: list[str],
    index_endpoint: str | None,
    page_size: int,
    watch: list[tuple[str, str]],
    user_args: tuple[str, ...],
    api_key: str | None,
    agents: list[tuple[str, str]] = (),
) -> Part:
    """The bana router in front of the workers; it also watches the store's parts for ``/health``."""
    argv = [
        sys.executable,
        "-m",
        "bana_sglang.router",
        "--host",
        bind,
        "--port",
        str(port),
        "--policy",
        policy,
        "--model-path",
        model_path,
        "--served-model-name",
        served,
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
    return Part(
        name="router",
        argv=tuple(argv),
        health_url=endpoint + "/health",
        env=(("BANA_API_KEY", api_key),) if api_key else (),
    )


BALANCER_CHOICES = ("none", "bana")
BALANCER_READY = "bana-balancer ready on"


def balancer_part(
    *,
    bind: str,
    port: int,
    endpoint: str,
    model_path: str,
    policy: str,
    page_size: int,
    api_key: str | None,
    user_args: tuple[str, ...] = (),
) -> Part:
    """The live balancer: reads loads from the router, migrates through its admin API."""
    argv = [
        sys.executable,
        "-m",
        "bana_sglang.balancer.controller",
        "--router",
        endpoint,
        "--balancer",
        policy,
        "--model-path",
        model_path,
        "--page-size",
        str(page_size),
        "--host",
        bind,
        "--port",
        str(port),
        *user_args,
    ]
    return Part(
        name="balancer",
        argv=tuple(argv),
        ready_line=BALANCER_READY,
        env=(("BANA_API_KEY", api_key),) if api_key else (),
    )


def plan_spec(
    spec: cluster_spec.ClusterSpec, node: str | None, *, dry_run: bool = False
) -> ClusterPlan:
    """The share of ``node`` in a cluster spec (``None``: every node's parts, for --dry-run).

    ``dry_run`` takes a model folder as written and does not ask for the API
    key's variable (a dry run on a machine that is not the node); starting a
    node checks both. Flags that depend on the machine (the CPU layer's) are
    this machine's."""
    if node is not None:
        spec.node(node)  # a clear error for an unknown name
    model_path = (
        str(models.resolve(spec.model))
        if not dry_run or spec.model in models.SPECS or spec.model is None
        else spec.model
    )
    served = spec.served_model_name or Path(model_path).name
    nodes = {n.name: n for n in spec.nodes}
    mnode = nodes[spec.master.node]
    master_addr = f"{mnode.address}:{spec.master.rpc_port}"
    parts: list[tuple[str, Part]] = [
        (
            mnode.name,
            master_part(
                mnode.bind_address,
                spec.master.rpc_port,
                spec.master.metrics_port,
                for_store=spec.store is not None,
                host=mnode.address,
            ),
        )
    ]
    index_endpoint = None
    store: list[tuple[str, Part]] = []
    if spec.store:
        snode = nodes[spec.store.node]
        index_endpoint = f"tcp://{snode.address}:{spec.store.index_port}"
        needs = (("mooncake-master", master_addr),) if snode.name != mnode.name else ()
        store = [
            (snode.name, p)
            for p in store_parts(
                snode.bind_address,
                snode.address,
                master_addr,
                spec.store.index_port,
                spec.store.bytes,
                protocol=cluster_spec.resolve_transport(snode),
                rdma_devices=snode.rdma_devices,
                needs=needs,
            )
        ]
    page_size = spec.store.page_size if spec.store else 16
    agents: list[tuple[str, str]] = []
    workers: list[tuple[str, Part]] = []
    prefill_urls: list[tuple[str, int]] = []
    decode_urls: list[str] = []
    for n, name, w in spec.workers():
        user = (
            *spec.sglang_args,
            *(spec.prefill_args if w.role == "prefill" else spec.decode_args),
            *device_args(w.device, cluster_spec.resolve_transport(n), n.rdma_devices),
            *w.args,
        )
        workers.append(
            (
                n.name,
                worker_part(
                    name,
                    w.role,
                    model_path=model_path,
                    served=served,
                    bind=n.bind_address,
                    port=w.port,
                    bootstrap_port=w.bootstrap_port,
                    user_args=user,
                    index_endpoint=index_endpoint,
                    master_addr=master_addr if index_endpoint else None,
                    page_size=page_size,
                    advertise=n.address,
                    agent_port=w.agent_port,
                ),
            )
        )
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
        raise cluster_spec.SpecError(
            f"router.api_key_env: ${spec.router.api_key_env} is not set on this node"
        )
    watch = [("mooncake-master", master_addr)]
    if index_endpoint:
        watch.append(("kv-index", index_endpoint.removeprefix("tcp://")))
    router = (
        rnode.name,
        router_part(
            bind=rnode.bind_address,
            port=spec.router.port,
            endpoint=endpoint,
            policy=spec.router.policy,
            model_path=model_path,
            served=served,
            prefill_urls=prefill_urls,
            decode_urls=decode_urls,
            index_endpoint=index_endpoint,
            page_size=page_size,
            watch=watch,
            user_args=tuple(spec.router.args),
            api_key=api_key,
            agents=agents,
        ),
    )

    def mine(items: list[tuple[str, Part]]) -> list[Part]:
        return [p for n, p in items if node is None or n == node]

    env_node = nodes[node] if node is not None else None
    env = (
        compat.child_env()
        if env_node is None
        else compat.child_env(
            {**os.environ, **cluster_spec.node_env(env_node)}, host=env_node.address
        )
    )
    if env_node is not None:
        env = compat.with_cpu_threads(env, sum(1 for n, _ in workers if n == node))
    return ClusterPlan(
        endpoint=endpoint,
        model_path=model_path,
        served_model_name=served,
        master=(mine(parts) or [None])[0],
        workers=tuple(mine(workers)),
        router=(mine([router]) or [None])[0],
        env=env,
        api_key=api_key,
        store=tuple(mine(store)),
        node=node,
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


def store_args(
    role: str, linker_flags: list[str] | None, page_size: int, user_args: tuple[str, ...]
) -> list[str]:
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
    path = str(models.resolve(model_path))
    served = Path(path).name
    argv = (
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        path,
        "--served-model-name",
        served,
        "--host",
        host,
        "--port",
        str(port),
        *compat.server_args("null", user_args=sglang_args),
        *dtype_args(path, sglang_args),
        *sglang_args,
    )
    url = f"http://{host}:{port}"
    return ClusterPlan(
        endpoint=url,
        model_path=path,
        served_model_name=served,
        master=None,
        workers=(Part(name=name, argv=argv, health_url=url + "/health"),),
        router=None,
        env=compat.with_cpu_threads(compat.child_env(host=host), 1),
    )
