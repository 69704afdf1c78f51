"""A declarative cluster spec: which host runs which part, and where it listens.

``python -m bana_sglang.launch --spec cluster.yaml --node NAME`` starts the
share of node ``NAME``; every node reads the same file, so every part knows
where its peers are without any discovery service. YAML (``.yaml``/``.yml``)
or TOML (``.toml``); validated with pydantic, and every error names the bad
field (``nodes.1.workers.0.port: ...``).

Addresses:
- ``address`` is what the node *advertises*: the address other hosts use to
  reach its parts (worker URLs, the PD bootstrap host, Mooncake's handshake).
  Never a loopback address when the spec has more than one node.
- ``bind`` (default: ``address``) is the only address the node's parts listen
  on. ``0.0.0.0`` is allowed but must be asked for.

Example (two CPU hosts; more in ``docs/specs/``)::

    model: tiny
    nodes:
      - name: a
        address: 10.0.0.1
        workers: [{role: prefill, port: 30100, bootstrap_port: 30101}]
      - name: b
        address: 10.0.0.2
        workers: [{role: decode, port: 30100}]
    master: {node: a, rpc_port: 50051, metrics_port: 50052}
    store: {node: a, index_port: 50053, put_port: 50054, bytes: 1G}
    router: {node: a, port: 30000}
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import shlex
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from bana_sglang._cli import MIN_SEGMENT_BYTES, byte_size

Port = Annotated[int, Field(ge=1, le=65535)]


class SpecError(ValueError):
    """The spec file cannot be read or is invalid; the message names the field."""


def _args(v: object) -> object:
    """Extra flags as a list or as one shell-quoted string."""
    return shlex.split(v) if isinstance(v, str) else v


Args = Annotated[list[str], BeforeValidator(_args)]


def _size(v: object) -> object:
    if isinstance(v, str):
        try:
            return byte_size(v)
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
    return v


Size = Annotated[int, BeforeValidator(_size), Field(ge=MIN_SEGMENT_BYTES)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerSpec(_Strict):
    role: Literal["prefill", "decode"]
    port: Port
    bootstrap_port: Port | None = None  # prefill only (SGLang's PD bootstrap server)
    agent_port: Port | None = None  # the migration agent's ZMQ port; None: no agent on this worker
    name: str | None = None  # default: ROLE-i, numbered across the whole spec
    device: str = "auto"  # auto | cpu | cuda | cuda:N (N: the first GPU of this worker)
    args: Args = []  # extra SGLang flags for this worker

    @model_validator(mode="after")
    def _check(self) -> WorkerSpec:
        if self.role == "prefill" and self.bootstrap_port is None:
            raise ValueError("a prefill worker needs bootstrap_port (SGLang's PD bootstrap server)")
        if self.role == "decode" and self.bootstrap_port is not None:
            raise ValueError("bootstrap_port is for prefill workers only")
        if self.device not in ("auto", "cpu", "cuda") and not (
            self.device.startswith("cuda:") and self.device[5:].isdigit()
        ):
            raise ValueError(f"device {self.device!r}: use auto, cpu, cuda or cuda:N")
        return self


class NodeSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    address: str  # advertised: how other nodes reach this one
    bind: str | None = None  # default: address
    transport: Literal["auto", "tcp", "rdma"] = (
        "auto"  # Mooncake's; auto: rdma iff an RDMA NIC is present
    )
    rdma_devices: str = ""  # e.g. "mlx5_0,mlx5_1" (SGLang's --disaggregation-ib-device)
    workers: list[WorkerSpec] = []

    @model_validator(mode="after")
    def _check(self) -> NodeSpec:
        for field in ("address", "bind"):
            value = getattr(self, field)
            if value is not None and not _host_ok(value):
                raise ValueError(f"{field} {value!r} is not an IP address or host name")
        if _is_wildcard(self.address):
            raise ValueError(
                f"address {self.address!r} is a wildcard: give the address peers should use "
                "(bind may be 0.0.0.0)"
            )
        return self

    @property
    def bind_address(self) -> str:
        return self.bind or self.address


class MasterSpec(_Strict):
    node: str
    rpc_port: Port = 50051
    metrics_port: Port = 50052


class StoreSpec(_Strict):
    node: str  # where the storage process (the Mooncake segment) and the index run
    index_port: Port = 50053
    put_port: Port = 50054  # the storage process's puts for workers on its node (127.0.0.1)
    bytes: Size = 1 << 30
    page_size: int = Field(16, ge=1)


class RouterSpec(_Strict):
    node: str
    port: Port = 30000
    policy: str = "bana"
    api_key_env: str | None = (
        None  # read the API key from this environment variable on the router node
    )
    args: Args = []


class ClusterSpec(_Strict):
    model: str | None = None  # embedded model name or a folder present on every node; None: tiny
    served_model_name: str | None = None
    sglang_args: Args = []  # for every worker
    prefill_args: Args = []
    decode_args: Args = []
    nodes: list[NodeSpec] = Field(min_length=1)
    master: MasterSpec
    store: StoreSpec | None = None  # None: stock SGLang workers with private prefix caches
    router: RouterSpec

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique: {', '.join(dup)} repeated")
        for field in ("master", "store", "router"):
            part = getattr(self, field)
            if part is not None and part.node not in names:
                raise ValueError(
                    f"{field}.node {part.node!r} is not one of the nodes ({', '.join(names)})"
                )
        roles = [w.role for n in self.nodes for w in n.workers]
        for role in ("prefill", "decode"):
            if role not in roles:
                raise ValueError(f"the cluster needs at least one {role} worker")
        if len(self.nodes) > 1:
            for n in self.nodes:
                if is_loopback(n.address):
                    raise ValueError(
                        f"node {n.name!r} advertises loopback {n.address}: other nodes "
                        "cannot reach it"
                    )
        from bana_sglang.router.policy import LIVE_POLICIES

        if self.router.policy not in LIVE_POLICIES:
            raise ValueError(
                f"router.policy {self.router.policy!r}: choose one of {', '.join(LIVE_POLICIES)}"
            )
        # Ports: no two listeners on one node share a port.
        taken: dict[tuple[str, int], str] = {}
        for node, port, what in self._listeners():
            key = (node, port)
            if key in taken:
                raise ValueError(
                    f"port {port} on node {node!r} is used by both {taken[key]} and {what}"
                )
            taken[key] = what
        names_w = [name for _, name, _ in self.workers()]
        dup_w = sorted({w for w in names_w if names_w.count(w) > 1})
        if dup_w:
            raise ValueError(f"worker names must be unique: {', '.join(dup_w)} repeated")
        return self

    def _listeners(self) -> list[tuple[str, int, str]]:
        out = [
            (self.master.node, self.master.rpc_port, "master.rpc_port"),
            (self.master.node, self.master.metrics_port, "master.metrics_port"),
            (self.router.node, self.router.port, "router.port"),
        ]
        if self.store:
            out.append((self.store.node, self.store.index_port, "store.index_port"))
            out.append((self.store.node, self.store.put_port, "store.put_port"))
        for ni, n in enumerate(self.nodes):
            for wi, w in enumerate(n.workers):
                out.append((n.name, w.port, f"nodes.{ni}.workers.{wi}.port"))
                if w.bootstrap_port is not None:
                    out.append(
                        (n.name, w.bootstrap_port, f"nodes.{ni}.workers.{wi}.bootstrap_port")
                    )
                if w.agent_port is not None:
                    out.append((n.name, w.agent_port, f"nodes.{ni}.workers.{wi}.agent_port"))
        return out

    # -- queries
    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise SpecError(
            f"--node {name!r} is not in the spec (nodes: {', '.join(n.name for n in self.nodes)})"
        )

    def workers(self) -> list[tuple[NodeSpec, str, WorkerSpec]]:
        """Every worker with its node and name (default: numbered per role across
        the spec in file order)."""
        count = {"prefill": 0, "decode": 0}
        out = []
        for n in self.nodes:
            for w in n.workers:
                out.append((n, w.name or f"{w.role}-{count[w.role]}", w))
                count[w.role] += 1
        return out


def _host_ok(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        labels = value.split(".")
        return (
            bool(value)
            and len(value) <= 253
            and all(lab and len(lab) <= 63 and lab.replace("-", "").isalnum() for lab in labels)
        )


def _is_wildcard(value: str) -> bool:
    try:
        return ipaddress.ip_address(value).is_unspecified
    except ValueError:
        return False


def is_loopback(value: str) -> bool:
    try:
        return ipaddress.ip_address(value).is_loopback
    except ValueError:
        return value == "localhost"


def load(path: str | Path) -> ClusterSpec:
    """Read and validate a spec file; :class:`SpecError` names the file and the bad field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read cluster spec {path}: {e.strerror}") from None
    import yaml

    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise SpecError(f"cluster spec {path}: use a .yaml, .yml, .toml or .json file")
    except SpecError:
        raise
    except (tomllib.TOMLDecodeError, yaml.YAMLError, ValueError) as e:
        raise SpecError(
            f"cluster spec {path} is not valid {path.suffix[1:].upper()}: {e}"
        ) from None
    if not isinstance(data, dict):
        raise SpecError(f"cluster spec {path}: the top level must be a mapping")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {where}: {msg}")
        raise SpecError(f"cluster spec {path} is invalid:\n" + "\n".join(lines)) from None


def resolve_transport(node: NodeSpec) -> str:
    """``tcp`` or ``rdma`` for this node; ``auto`` looks for an RDMA device here."""
    if node.transport != "auto":
        return node.transport
    ib = Path("/sys/class/infiniband")
    return "rdma" if ib.is_dir() and any(ib.iterdir()) else "tcp"


def node_env(node: NodeSpec) -> dict[str, str]:
    """Environment for every part of ``node``: bind and advertise addresses, transport."""
    transport = resolve_transport(node)
    env = {
        "SGLANG_HOST_IP": node.address,  # what SGLang's PD bootstrap advertises
        "MC_TCP_BIND_ADDRESS": node.bind_address,
        "BANA_STORE_HOST": node.address,  # the store clients' Mooncake local hostname
        "MOONCAKE_PROTOCOL": transport,
        "BANA_STORE_PROTOCOL": transport,
    }
    if transport == "rdma" and node.rdma_devices:
        env["BANA_STORE_RDMA_DEVICES"] = node.rdma_devices
    return env
