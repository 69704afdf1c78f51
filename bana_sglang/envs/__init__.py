"""Every environment variable bana_sglang reads: one typed, documented registry.

Each setting is an :class:`EnvVar` with a name (``BANA_`` prefix), a type, a
default and one line of documentation. A setting is read when it is used
(``envs.BANA_INDEX_TIMEOUT_S.get()``), never at import time, so a test can set
the variable (or :func:`override` it) after importing the module that reads it.
A malformed value raises :class:`ValueError` naming the variable and what it
accepts. ``python -m bana_sglang.envs`` prints the table (as in ``README.md``).

Command-line flags stay the configuration of record: the launcher passes most of
these to the processes it starts (``launcher`` in the table); set them by hand
only when running a part yourself, or to tune what the table says.
Stdlib only: every process, the router included, may import this module.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

REGISTRY: dict[str, EnvVar] = {}


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: ``get()`` reads it now (``default`` when unset or empty)."""

    name: str
    kind: type
    default: T
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    set_by: str = ""  # "launcher": the launcher sets it for the processes it starts

    def __post_init__(self) -> None:
        if not self.name.startswith("BANA_"):
            raise ValueError(f"{self.name}: every setting is named BANA_*")
        if self.name in REGISTRY:
            raise ValueError(f"{self.name} is registered twice")
        REGISTRY[self.name] = self

    @property
    def is_set(self) -> bool:
        return bool(os.environ.get(self.name, "").strip())

    def get(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        return self.parse(raw)

    def parse(self, raw: str) -> T:
        if self.kind is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True  # type: ignore[return-value]
            if low in ("0", "false", "no", "off"):
                return False  # type: ignore[return-value]
            raise ValueError(f"{self.name} must be 0 or 1, got {raw!r}")
        if self.kind is str:
            value: object = raw.lower() if self.choices else raw
            if self.choices and value not in self.choices:
                raise ValueError(
                    f"{self.name} must be one of {', '.join(self.choices)}, got {raw!r}"
                )
            return value  # type: ignore[return-value]
        try:
            value = self.kind(raw)
        except ValueError:
            raise ValueError(
                f"{self.name} must be {'an integer' if self.kind is int else 'a number'}, "
                f"got {raw!r}"
            ) from None
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name} must be >= {self.minimum:g}, got {raw!r}")
        return value  # type: ignore[return-value]


def _var(name: str, kind: type, default, doc: str, **kw) -> EnvVar:
    return EnvVar(name, kind, default, doc, **kw)


# -- machine and CPU layer
BANA_DEVICE = _var(
    "BANA_DEVICE",
    str,
    "",
    "force the device flavour: `cpu` (the CPU layer applies) or `cuda`; unset: cuda iff torch "
    "sees a GPU (also picks the wheels in scripts/setup.sh)",
    choices=("cpu", "cuda"),
)
BANA_CPU_ATTENTION = _var(
    "BANA_CPU_ATTENTION",
    str,
    "bana",
    "default `--attention-backend` on CPU: `bana` (bana_cpu) or `stock` (torch_native)",
    choices=("bana", "stock"),
)
BANA_IDLE_POLL_MS = _var(
    "BANA_IDLE_POLL_MS",
    int,
    5,
    "idle wait of an SGLang scheduler on CPU, in ms (0: SGLang's busy spin)",
    minimum=0,
)
BANA_IDLE_SLEEP_MS = _var(
    "BANA_IDLE_SLEEP_MS",
    int,
    100,
    "idle wait of an SGLang scheduler on CPU that holds no request and no migration, in ms "
    "(a request or an agent command wakes it at once; 0: BANA_IDLE_POLL_MS throughout)",
    minimum=0,
)
BANA_CPU_START_METHOD = _var(
    "BANA_CPU_START_METHOD",
    str,
    "fork",
    "how an SGLang worker on CPU starts its scheduler and detokenizer: `fork` (they inherit "
    "the imported modules: the worker is up in half the time) or `spawn` (SGLang's own)",
    choices=("fork", "spawn"),
)
BANA_MERGE_TRITON = _var(
    "BANA_MERGE_TRITON",
    bool,
    True,
    "use the Triton kernel for the two-way attention merge on CUDA (0: the torch path)",
)
BANA_MODEL_CACHE = _var(
    "BANA_MODEL_CACHE",
    str,
    "",
    "where the embedded models are built (default ~/.cache/bana_sglang/models)",
)
BANA_VENV = _var(
    "BANA_VENV", str, ".venv", "the virtual environment of scripts/setup.sh, run.sh and test.sh"
)

# -- the router and the operators' tools
BANA_API_KEY = _var(
    "BANA_API_KEY",
    str,
    "",
    "the router's API key (`--api-key` wins): the router requires it, the migrate CLI, the "
    "balancer and the launcher's health checks send it",
    set_by="launcher",
)

BANA_CLUSTER_SECRET_FILE = _var(
    "BANA_CLUSTER_SECRET_FILE",
    str,
    "",
    "the cluster secret (a file of mode 0600, `--cluster-secret-file`): every ZMQ control "
    "channel (index, agent, layer steps, KV host) uses CurveZMQ with keys derived from it and "
    "accepts only peers that hold it; unset: plain ZMQ (the launcher always sets it)",
    set_by="launcher",
)
BANA_WORKER_AUTH = _var(
    "BANA_WORKER_AUTH",
    bool,
    False,
    "a worker requires SGLang's API key, derived from the cluster secret, on every endpoint "
    "but /health and /metrics (the router and the project's clients send it)",
    set_by="launcher",
)

# -- the global KV cache store
BANA_INDEX_ENDPOINT = _var(
    "BANA_INDEX_ENDPOINT",
    str,
    "",
    "ZMQ endpoint of the global prefix index service (tcp://host:port)",
    set_by="launcher",
)
BANA_INDEX_TIMEOUT_S = _var(
    "BANA_INDEX_TIMEOUT_S",
    float,
    0.5,
    "how long a worker waits for the index before a lookup counts as a miss",
    minimum=0,
)
BANA_INDEX_RETRY_S = _var(
    "BANA_INDEX_RETRY_S",
    float,
    1.0,
    "after an index timeout, how long lookups fail fast before the index is tried again",
    minimum=0,
)
BANA_STORE_MASTER = _var(
    "BANA_STORE_MASTER",
    str,
    "127.0.0.1:50051",
    "host:port of mooncake_master's RPC",
    set_by="launcher",
)
BANA_STORE_HOST = _var(
    "BANA_STORE_HOST",
    str,
    "127.0.0.1",
    "the address this process's Mooncake client advertises",
    set_by="launcher",
)
BANA_STORE_PROTOCOL = _var(
    "BANA_STORE_PROTOCOL",
    str,
    "tcp",
    "Mooncake store transport: `tcp` or `rdma`",
    choices=("tcp", "rdma"),
    set_by="launcher",
)
BANA_STORE_RDMA_DEVICES = _var(
    "BANA_STORE_RDMA_DEVICES",
    str,
    "",
    "RDMA devices for the store (e.g. `mlx5_0`; empty: Mooncake picks)",
    set_by="launcher",
)
BANA_STORE_STAGING_BYTES = _var(
    "BANA_STORE_STAGING_BYTES",
    int,
    32 << 20,
    "registered staging buffer of a worker's store client, in bytes",
    minimum=1,
)
BANA_STORE_MODE = _var(
    "BANA_STORE_MODE",
    str,
    "staged",
    "how a worker's loads reach its KV pool: `staged` (through a registered host arena, one "
    "range per page per layer group; CPU or CUDA) or `direct` (ranged reads straight into "
    "the pool's slots)",
    choices=("staged", "direct"),
)
BANA_STORE_ARENA_BYTES = _var(
    "BANA_STORE_ARENA_BYTES",
    int,
    64 << 20,
    "each of a worker's two host arenas (loads, publishes), in bytes (pinned on CUDA)",
    minimum=1 << 20,
)
BANA_STORE_LOCAL_LOADS = _var(
    "BANA_STORE_LOCAL_LOADS",
    bool,
    True,
    "a CPU worker on the storage process's host loads a hit's whole pages through it (a local "
    "copy into a shared-memory arena) instead of layer groups over the transfer engine; a load "
    "larger than the arena, or one the storage process does not answer, reads over the engine",
)
BANA_STORE_GROUP_GROWTH = _var(
    "BANA_STORE_GROUP_GROWTH",
    float,
    2.0,
    "layer groups of a load: layer 0 alone, then each group this minus 1 times the layers "
    "loaded before it (2: 1, 1, 2, 4, ... layers; 1: one layer per group)",
    minimum=1,
)
BANA_STORE_MIN_SLICE_BYTES = _var(
    "BANA_STORE_MIN_SLICE_BYTES",
    int,
    64 << 10,
    "layer groups of a load are large enough that one page's range carries this many bytes "
    "(over TCP a slice costs about as much as 64 KB of payload; 0: no floor)",
    minimum=0,
)
BANA_STORE_LOAD_TIMEOUT_S = _var(
    "BANA_STORE_LOAD_TIMEOUT_S",
    float,
    5.0,
    "the longest a forward waits for one layer of a staged load; then the load fails "
    "(SGLang answers 503, the router retries) and lookups miss until the stuck read "
    "returns (0: wait as long as the transfer takes; direct loads always do)",
    minimum=0,
)
BANA_STORE_LOAD_POLICY = _var(
    "BANA_STORE_LOAD_POLICY",
    str,
    "auto",
    "`auto`: load a hit only when the worker's measured load speed beats its measured "
    "prefill speed for those tokens; `always`: load every hit",
    choices=("auto", "always"),
)
BANA_STORE_PUBLISH_NICE = _var(
    "BANA_STORE_PUBLISH_NICE",
    int,
    10,
    "how much the publish thread (and its Mooncake client's threads) lower their "
    "scheduling priority (Linux nice; 0: none)",
    minimum=0,
)
BANA_STORE_PUBLISH_SETTLE_MS = _var(
    "BANA_STORE_PUBLISH_SETTLE_MS",
    int,
    -1,
    "a prefill worker publishes this long after its last forward ended, when the request's "
    "KV has left and its first token is computed (-1: 50 on a CPU pool, 0 on CUDA)",
    minimum=-1,
)
BANA_STORE_PUBLISH_MAX_DELAY_MS = _var(
    "BANA_STORE_PUBLISH_MAX_DELAY_MS",
    int,
    1000,
    "the longest a publish waits for such a quiet moment",
    minimum=0,
)
BANA_STORE_PUBLISH_ARRIVAL_DELAY_MS = _var(
    "BANA_STORE_PUBLISH_ARRIVAL_DELAY_MS",
    int,
    5,
    "a decode worker publishes the prompt of a request whose KV has just arrived this long "
    "after, when the request's first token is out (its scheduler sends it in about 1 ms)",
    minimum=0,
)
BANA_STORE_PROBE_INTERVAL_S = _var(
    "BANA_STORE_PROBE_INTERVAL_S",
    float,
    0.5,
    "while the store is down, how often a worker probes the master",
    minimum=0,
)

# -- migration
BANA_WORKER_NAME = _var(
    "BANA_WORKER_NAME",
    str,
    "",
    "this worker's name in the cluster (default: role-pid)",
    set_by="launcher",
)
BANA_AGENT_ENDPOINT = _var(
    "BANA_AGENT_ENDPOINT",
    str,
    "",
    "the ZMQ endpoint this worker's migration agent binds (unset: no agent)",
    set_by="launcher",
)
BANA_AGENT_HOST = _var(
    "BANA_AGENT_HOST",
    str,
    "",
    "the address this worker's transfer engine and guest executors advertise (default: the "
    "agent endpoint's host)",
    set_by="launcher",
)
BANA_MIGRATE_STEP_TIMEOUT_S = _var(
    "BANA_MIGRATE_STEP_TIMEOUT_S",
    float,
    30.0,
    "how long an owner waits for its guest's layers in one step before it reloads "
    "them from the checkpoint",
    minimum=0.01,
)
BANA_MIGRATE_PEER_TIMEOUT_S = _var(
    "BANA_MIGRATE_PEER_TIMEOUT_S",
    float,
    30.0,
    "how long an agent waits for a peer agent's reply",
    minimum=0.01,
)
BANA_KV_STEP_TIMEOUT_S = _var(
    "BANA_KV_STEP_TIMEOUT_S",
    float,
    0.0,
    "how long a KV lender waits for its host in one decode step (0: the layer step timeout)",
    minimum=0,
)
BANA_KV_HOST_RECLAIM_BELOW = _var(
    "BANA_KV_HOST_RECLAIM_BELOW",
    float,
    0.05,
    "a KV host asks for its memory back when its free KV share drops below this",
    minimum=0,
)
BANA_REQUEST_PRECOPY_S = _var(
    "BANA_REQUEST_PRECOPY_S",
    float,
    0.2,
    "a migrating request decodes on this long after its pages start to copy (0: stop "
    "at the first batch boundary)",
    minimum=0,
)


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Set settings for the duration of a ``with`` block (tests): ``override(BANA_IDLE_POLL_MS=0)``."""
    old = {}
    for name, value in values.items():
        if name not in REGISTRY:
            raise KeyError(f"unknown setting {name!r}")
        old[name] = os.environ.get(name)
        os.environ[name] = str(int(value) if isinstance(value, bool) else value)
    try:
        yield
    finally:
        for name, prev in old.items():
            if prev is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = prev


def markdown_table() -> str:
    """The settings as a Markdown table (README's "Settings")."""
    rows = ["| variable | type | default | set by | what it does |", "|---|---|---|---|---|"]
    for var in REGISTRY.values():
        kind = " / ".join(var.choices) if var.choices else var.kind.__name__
        default = (
            "" if var.default == "" else (int(var.default) if var.kind is bool else var.default)
        )
        rows.append(
            f"| `{var.name}` | {kind} | {f'`{default}`' if default != '' else ''} | {var.set_by} | "
            f"{var.doc} |"
        )
    return "\n".join(rows)
