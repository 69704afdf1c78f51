"""Planning a cluster: which processes, with which command lines, ports and
environment. Pure: nothing here starts a process (``bana_sglang.launch`` runs
a plan).

- :func:`plan_cluster`: the single-machine cluster from a :class:`LaunchConfig`
  (ports chosen by scanning for free ones);
- :func:`plan_spec`: one node's share of a cluster spec (``bana_sglang.launch.spec``);
- :func:`plan_single_server`: a plain colocated SGLang server (the reference);
- the part builders they share are in :mod:`.parts`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

from bana_sglang import _cli, compat, models
from bana_sglang.launch import gpus
from bana_sglang.launch import spec as cluster_spec
from bana_sglang.launch.parts import (
    BALANCER_CHOICES,
    Part,
    balancer_part,
    device_args,
    dtype_args,
    kv_dtype,
    master_part,
    page_size_of,
    router_part,
    storage_endpoint,
    store_parts,
    worker_part,
)
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
    gpus: int | None = None  # GPUs for the workers on a CUDA machine; None: what nvidia-smi lists

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
        if self.store_bytes < _cli.MIN_SEGMENT_BYTES:
            raise ValueError(f"--store-bytes {self.store_bytes} is too small (at least 16M)")
        if self.store_page_size < 1:
            raise ValueError("--store-page-size must be >= 1")
        if self.cpu_threads < 0:
            raise ValueError(
                f"--cpu-threads {self.cpu_threads}: give a positive count, or 0 for automatic"
            )
        if self.gpus is not None and self.gpus < 1:
            raise ValueError(f"--gpus {self.gpus}: give a positive count (or leave it out)")


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
    index_endpoint: str | None = None  # the global store's index service (tcp://host:port)

    @property
    def parts(self) -> tuple[Part, ...]:
        return (
            ((self.master,) if self.master else ())
            + self.store
            + self.workers
            + ((self.router,) if self.router else ())
            + ((self.balancer,) if self.balancer else ())
        )


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
    index_endpoint = master_addr = storage = None
    if cfg.mooncake_master:
        rpc, metrics = ports.take(), ports.take()
        master = master_part(h, rpc, metrics, for_store=cfg.global_store)
        master_addr = f"{h}:{rpc}"
        if cfg.global_store:
            index_port, put_port = ports.take(), ports.take()
            index_endpoint = f"tcp://{h}:{index_port}"
            storage = storage_endpoint(put_port)
            store = store_parts(h, h, master_addr, index_port, cfg.store_bytes, put_port=put_port)

    cuda = not compat.cpu_mode()
    placement: list[tuple[int, float | None]] = []
    inventory = None
    if cuda:
        found = gpus.detect()
        inventory = dataclasses.replace(found, count=cfg.gpus) if cfg.gpus else found
        if inventory.count < 1:
            raise ValueError(
                "no GPU is visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them); "
                "give --gpus N, or run on the CPU with BANA_DEVICE=cpu"
            )
        placement = gpus.place(cfg.num_prefill + cfg.num_decode, inventory.count)
    workers: list[Part] = []
    prefill_urls: list[tuple[str, int]] = []
    decode_urls: list[str] = []
    for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
        for i in range(count):
            user = (*cfg.sglang_args, *(cfg.prefill_args if role == "prefill" else cfg.decode_args))
            device_flags: tuple[str, ...] = ()
            if cuda:
                gpu, fraction = placement[len(workers)]
                device_flags = tuple(gpus.worker_flags(gpu, fraction, user))
            port = ports.take()
            boot = ports.take() if role == "prefill" else None
            agent_port = ports.take()
            nccl_port = ports.take()
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
                    user_args=user,
                    index_endpoint=index_endpoint,
                    master_addr=master_addr,
                    page_size=cfg.store_page_size,
                    cuda=cuda,
                    device_flags=device_flags,
                    worker_auth=cfg.router == "bana",
                    nccl_port=nccl_port,
                    storage=storage,
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
            kv_dtype=kv_dtype(workers[0].argv),
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
        env=_gpu_env(
            compat.with_cpu_threads(compat.child_env(host=h), len(workers), cfg.cpu_threads),
            inventory,
        ),
        api_key=cfg.api_key,
        store=tuple(store),
        balancer=balancer,
        index_endpoint=index_endpoint,
    )


def _gpu_env(env: dict[str, str], inventory: gpus.GpuInventory | None) -> dict[str, str]:
    """On a GPU machine, Mooncake's transport from the hardware (SGLang's PD default is
    ``rdma``, which fails without an RDMA device; the store's clients take the same),
    unless the operator set it."""
    if inventory is None:
        return env
    env = dict(env)
    env.setdefault("MOONCAKE_PROTOCOL", inventory.transport)
    env.setdefault("BANA_STORE_PROTOCOL", inventory.transport)
    return env


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
                put_port=spec.store.put_port,
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
                    cuda=w.device.startswith("cuda"),
                    # a worker on the store's node publishes through the storage process
                    storage=storage_endpoint(spec.store.put_port)
                    if spec.store and n.name == spec.store.node
                    else None,
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
            kv_dtype=kv_dtype(workers[0][1].argv) if workers else None,
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
        index_endpoint=index_endpoint,
    )


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
