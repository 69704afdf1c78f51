"""Migration agents in the test process, for the fast tests of the migration
control plane: small layer stacks served on real ZMQ sockets."""

from __future__ import annotations

import threading
import time

import torch

from bana_sglang.migrate.agent import MigrationAgent
from bana_sglang.migrate.client import AgentClient
from bana_sglang.migrate.config import MigrateConfig
from bana_sglang.wire import agent as m


def layers(seed: int, n: int = 4, width: int = 64) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width),
            torch.nn.LayerNorm(2 * width),
            torch.nn.Linear(2 * width, width),
        )
        for _ in range(n)
    )


class Running:
    """An agent over ``layers(seed, n, width)`` serving on a thread, and a client to it."""

    def __init__(self, name: str, role: str, seed: int, n: int = 4, width: int = 64):
        self.layers = layers(seed, n, width)
        self.agent = MigrationAgent(
            name, role, self.layers, "tcp://127.0.0.1:*", config=MigrateConfig(peer_timeout_s=2.0)
        )
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.agent.serve_forever, args=(self.stop,), daemon=True
        )
        self.thread.start()
        self.client = AgentClient(self.agent.endpoint, timeout_s=5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.client.close()
        self.agent.close()


def wait_state(client: AgentClient, mid: str, timeout: float = 30) -> m.Reply:
    """Watch migration ``mid`` until it is no longer in progress; its last reply."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.call(m.Watch, migration=mid)
        if not isinstance(r, m.Progress):
            return r
        assert time.monotonic() < deadline, f"migration {mid} still {r.state}"
        time.sleep(0.05)
