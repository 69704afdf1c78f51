"""The parts of a cluster plan: one :class:`Part` per process (command line,
health check, environment) and the builders that make them (master, store,
worker, router, balancer), shared by every planner in :mod:`.plan`. Pure."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from bana_sglang import compat
from bana_sglang.launch import gpus
from bana_sglang.mooncake_env import master_binary

logger = logging.getLogger("bana_sglang.launch")


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


def dtype_args(
    model_path: str, user_args: tuple[str, ...] | list[str], *, cuda: bool = False
) -> list[str]:
    """The dtype a float32 checkpoint runs in: float32 on CPU, bfloat16 on a GPU.

    SGLang's ``--dtype auto`` silently runs float32 checkpoints in float16
    ("common practice", ``configs/model_config.py``). On CPU that breaks the
    exactness contract (greedy float32 tokens equal HF's) and is slow, so they
    stay float32. On a GPU, SGLang's default attention backends (FlashAttention 3,
    FlashInfer) have no float32 path, so they run in bfloat16. A user's own
    ``--dtype`` always wins (``--dtype float32 --attention-backend triton`` runs a
    GPU worker in float32).
    """
    if any(a == "--dtype" or a.startswith("--dtype=") for a in user_args):
        return []
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if (cfg.get("torch_dtype") or cfg.get("dtype")) == "float32":
        return ["--dtype", "bfloat16" if cuda else "float32"]
    return []


def kv_dtype(argv: tuple[str, ...] | list[str]) -> str | None:
    """The ``--dtype`` a worker's command line gives (None: the checkpoint's)."""
    for i, a in enumerate(argv):
        if a == "--dtype" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--dtype="):
            return a.split("=", 1)[1]
    return None


# ----------------------------------------------------------------- part builders
# Shared by the single-machine plan above and the per-node plan of a cluster spec.


def master_part(
    bind: str, rpc: int, metrics: int, *, for_store: bool, host: str | None = None
) -> Part:
    """``mooncake_master`` listening on ``bind``; ``host`` is where its readiness is checked."""
    argv = [
        master_binary(),
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
        # ... and keeps its pages at most 0.9 of the segment (as the allocator takes
        # them, ``mooncake_kv.allocation_size``): the master's own eviction, which
        # starts at its watermark of requested bytes (0.9 by default), stays a backstop
        argv.append("-eviction_high_watermark_ratio=0.95")
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
    put_port: int | None = None,
) -> list[Part]:
    """The global store: the storage process (the only Mooncake segment) and the index service.
    ``put_port``: the storage process also takes puts from the shared-memory arenas of
    workers on its host, on 127.0.0.1 (:func:`storage_endpoint`)."""
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
    if put_port is not None:
        storage += ["--put-listen", storage_endpoint(put_port)]
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
                # headroom below the segment; the index counts each page as the
                # segment's allocator takes it (rounded up to its size class)
                "--capacity-bytes",
                str(store_bytes * 9 // 10),
                "--master",
                master_addr,
            ),
            ready_line=service.READY_LINE,
        ),
    ]


def storage_endpoint(put_port: int) -> str:
    """The storage process's put endpoint, for the workers on its host (loopback only:
    the arenas it maps are files of that host)."""
    return f"tcp://127.0.0.1:{put_port}"


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
    cuda: bool = False,
    device_flags: tuple[str, ...] = (),
    worker_auth: bool = True,
    nccl_port: int | None = None,
    storage: str | None = None,
) -> Part:
    """One SGLang PD worker with the extension (and the global store's linker when there is one,
    and the migration agent on ``agent_port``). ``cuda``: a GPU worker (its float32
    checkpoints run in bfloat16); ``device_flags``: its GPU and memory share; ``storage``:
    the storage process's put endpoint when the worker shares its host."""
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
    if nccl_port is not None and not gpus.given(user_args, "--nccl-port"):
        # planned with the cluster's other ports: SGLang's own pick is a random port of
        # 22000-29999, checked free when chosen and bound only later by the scheduler,
        # so another process can take it meanwhile (EADDRINUSE at start-up)
        argv += ["--nccl-port", str(nccl_port)]
    linker = (
        flags.linker_args(index_endpoint, master_addr, owner=name, storage=storage)
        if index_endpoint and master_addr
        else None
    )
    if not cuda:  # the CPU layer's flags (none on a GPU machine)
        argv += compat.server_args(role, user_args=user_args)
    argv += list(device_flags)
    argv += dtype_args(model_path, user_args, cuda=cuda)
    argv += store_args(role, linker, page_size, user_args) + list(user_args)
    url = f"http://{advertise or bind}:{port}"
    env: tuple[tuple[str, str], ...] = (("BANA_WORKER_AUTH", "1"),) if worker_auth else ()
    if agent_port is not None:
        env += (
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
    kv_dtype: str | None = None,
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
        if kv_dtype:
            argv += ["--kv-dtype", kv_dtype]
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
        "bana_sglang.balancer",
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
