"""The router's configuration (built once from the command line, or by tests)."""

from __future__ import annotations

import dataclasses

from bana_sglang.router.policy import DEFAULT_POLICY


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[tuple[str, int], ...]  # (url, bootstrap port)
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = DEFAULT_POLICY
    seed: int = 0
    model_names: tuple[str, ...] = ()  # empty: ask the workers' /v1/models
    tokenizer_path: str | None = None
    page_tokens: int = 16  # routing page size (cache_aware's prefix tree)
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_tokens_limit: int = 1 << 20
    poll_interval_s: float = 0.25
    max_attempts: int = 3
    max_upstream_connections: int = 1024  # per worker (a limit per host cannot deadlock PD)
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 600.0
    # a decode stream silent this long after its first byte, from a worker that answered
    # nothing else meanwhile (a hung or stopped process), is resumed elsewhere
    stall_timeout_s: float = 30.0
    # a continuation (a resumed or migrated stream) whose pair has sent no first byte
    # this long, from workers that still answer (a PD handshake that never completes),
    # is given up there and opened again, on another pair when there is one
    continuation_timeout_s: float = 30.0
    probe_min_s: float = 0.5
    probe_max_s: float = 10.0
    global_index: str | None = None  # tcp://host:port of the global store's index service
    model_path: str | None = None  # for the store's KV layout (with global_index)
    store_page_size: int = 16
    kv_dtype: str | None = None  # the workers' KV dtype (None: the checkpoint's)
    watch: tuple[tuple[str, str], ...] = ()  # (name, host:port) of other parts reported by /health
    agents: tuple[tuple[str, str], ...] = ()  # (worker url, tcp://host:port of its migration agent)
    request_migration: bool = True  # mark streamed requests migratable (live request migration)

    # ``watch`` entries are checked by TCP connect; they never gate routing.

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode worker")
        if self.max_upstream_connections < 1:
            raise ValueError("max_upstream_connections must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be positive")
        if self.continuation_timeout_s <= 0:
            raise ValueError("continuation_timeout_s must be positive")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive")
        for name, addr in self.watch:
            host, _, port = addr.rpartition(":")
            if not name or not host or not port.isdigit():
                raise ValueError(f"--watch {name}={addr}: expected NAME=HOST:PORT")
        for url, endpoint in self.agents:
            if not url.startswith("http") or not endpoint.startswith("tcp://"):
                raise ValueError(f"--agent {url}={endpoint}: expected WORKER_URL=tcp://HOST:PORT")
        if self.global_index and not self.model_path:
            raise ValueError(
                "--global-index needs --model-path (the store's keys depend on the model)"
            )
