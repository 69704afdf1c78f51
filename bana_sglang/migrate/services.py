"""What the migration agent shares with each mechanism's handler.

:class:`Services` is built once per agent and handed to the layer, KV and
request handlers: this worker's identity and settings, the table of
migrations (and the lock that guards adding to it), the worker's handles,
the metrics, the one worker thread that runs bulk work, the transfer engine
(started on first use) and the way to ask a peer agent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from bana_sglang.counters import CounterSet
from bana_sglang.migrate.client import AgentClient, AgentUnavailable
from bana_sglang.migrate.config import MigrateConfig
from bana_sglang.migrate.errors import TransferError
from bana_sglang.migrate.records import Migration
from bana_sglang.migrate.transfer import TransferEngine
from bana_sglang.wire import agent as m

logger = logging.getLogger(__name__)


@dataclass
class WorkerHandles:
    """What the agent needs of its worker (from its SGLang ModelRunner)."""

    model: torch.nn.Module
    kv_pool: object
    req_to_token: torch.Tensor
    allocator: object
    model_path: str
    attention_backend: str
    tp_size: int = 1
    scheduler: object = None  # SGLang's Scheduler (KV-block migration: running batch, tree cache)

    @classmethod
    def from_runner(cls, runner, scheduler=None) -> WorkerHandles:
        return cls(
            model=runner.model,
            kv_pool=runner.token_to_kv_pool,
            req_to_token=runner.req_to_token_pool.req_to_token,
            allocator=runner.token_to_kv_pool_allocator,
            model_path=runner.model_config.model_path,
            attention_backend=str(runner.server_args.attention_backend),
            tp_size=int(runner.server_args.tp_size),
            scheduler=scheduler,
        )

    def why_not(self) -> str:
        """Why layers of this worker cannot run remotely, or ''."""
        if self.tp_size != 1:
            return f"tensor parallelism {self.tp_size}: remote layers are built for TP 1"
        if self.attention_backend != "bana_cpu":
            return (
                f"attention backend {self.attention_backend!r}: remote layers run the bana_cpu "
                "kernels, so the owner must too (exact tokens)"
            )
        if next(self.model.parameters()).device.type != "cpu":
            return (
                "the model is on a GPU, where remote layers and KV blocks are not run yet: a "
                "switch would leave captured CUDA graphs replaying freed weights, and the "
                "guest and host run the bana_cpu kernels (weight staging with a device "
                "checksum and the partial-attention kernels are built, their GPU tests "
                "prepared; docs/MIGRATION.md, On GPUs)"
            )
        return ""


class Services:
    """One agent's shared state and helpers (see the module docstring).

    ``migrations`` is read on the scheduler thread and the worker thread;
    records are added under ``lock``. ``endpoint`` is set once the agent's
    server has bound."""

    def __init__(
        self,
        name: str,
        role: str,
        layers: torch.nn.ModuleList,
        config: MigrateConfig,
        worker: WorkerHandles | None,
        metrics: CounterSet,
    ):
        self.name, self.role, self.layers = name, role, layers
        self.num_layers = len(layers)
        self.config = config
        self.worker = worker
        self.metrics = metrics
        self.endpoint = ""
        self.migrations: dict[str, Migration] = {}
        self.lock = threading.Lock()
        self.work = ThreadPoolExecutor(1, thread_name_prefix=f"bana-migrate-{name}")
        self.ctx = zmq.Context.instance()
        self.closed = False
        self._te: TransferEngine | None = None
        self._te_lock = threading.Lock()

    def add(self, mig: Migration) -> None:
        with self.lock:
            self.migrations[mig.migration] = mig

    @property
    def te(self) -> TransferEngine | None:
        """The transfer engine if it has started (nothing is registered otherwise)."""
        return self._te

    def engine(self) -> TransferEngine:
        """The transfer engine, started on first use."""
        with self._te_lock:
            if self._te is None:
                cfg = self.config
                self._te = TransferEngine(cfg.te_host, cfg.protocol, cfg.device)
                logger.info(
                    "migration agent of %s: transfer engine %s (%s)",
                    self.name,
                    self._te.session,
                    cfg.protocol,
                )
            return self._te

    def peer(self, endpoint: str) -> AgentClient:
        """A client of the peer agent at ``endpoint`` (the caller closes it)."""
        return AgentClient(endpoint, timeout_s=self.config.peer_timeout_s, ctx=self.ctx)

    @staticmethod
    def ask(client: AgentClient, make, **fields) -> m.Reply:
        """One call to a peer; its silence is a ``peer_unreachable`` TransferError."""
        try:
            return client.call(make, **fields)
        except AgentUnavailable as e:
            raise TransferError("peer_unreachable", str(e)) from None

    def drop_at_peer(self, client: AgentClient, migration: str) -> None:
        """Ask the peer to drop its guest copy of ``migration``, once, quietly."""
        with contextlib.suppress(TransferError):
            self.ask(client, m.DropGuest, migration=migration)

    @staticmethod
    def unknown(rid: int, migration: str) -> m.Error:
        return m.Error(id=rid, reason="invalid", detail=f"no migration {migration!r} here")

    def taken(self, rid: int, migration: str) -> m.Error | None:
        """The refusal of a new migration whose id is in use, or None."""
        if migration in self.migrations:
            return m.Error(id=rid, reason="invalid", detail=f"migration id {migration!r} is taken")
        return None
