"""The serving configurations a side-by-side run compares, as a registry.

Each :class:`ServingConfig` turns the shared :class:`Resources` (model,
worker count, threads per process, total KV budget) into a
:class:`bana_sglang.launch.ClusterPlan`, started and stopped by
:class:`bana_sglang.launch.Cluster`. Fairness is by construction: every
configuration gets ``num_workers`` SGLang worker processes, the same
``OMP_NUM_THREADS`` in each, and ``--max-total-tokens = kv_tokens_total /
num_workers`` on each (so the same total KV budget), plus the same metrics
and cache-report flags. PD configurations also run a ``mooncake_master``
(transfer metadata, no model work) and every configuration has one router.

Registered today:

- ``ours``: ``bana_sglang.launch`` with its defaults (``plan_cluster``: PD
  workers behind ``bana_sglang.router`` with the load-only ``bana`` policy;
  the global store and migration plug in here as they land);
- ``pd-cache-aware`` / ``pd-round-robin``: stock SGLang PD behind
  ``sglang_router --pd-disaggregation --policy cache_aware|round_robin``;
- ``bana-cache-aware`` / ``bana-round-robin``: the same workers behind our
  router with those baseline policies (the hotspot comparison);
- ``colocated``: ``num_workers`` plain SGLang servers (no PD) behind
  ``sglang_router`` in regular mode with ``cache_aware`` (the vLLM-like
  baseline); ``colocated-round-robin`` the same with ``round_robin``;
- ``single``: one plain server, no router (the cross-check's reference; not
  in the default set, as it has one process).

Add a configuration with :func:`register`; an unknown name raises
:class:`ConfigError` listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from bana_sglang import compat
from bana_sglang.launch import ClusterPlan, LaunchConfig, Part, plan_cluster, plan_single_server
from bana_sglang.launch.procs import PortAllocator

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """Unknown configuration name or resources that cannot be split fairly."""


@dataclasses.dataclass(frozen=True)
class Resources:
    """What every configuration of one comparison gets."""

    model_path: str
    num_prefill: int = 2  # PD split; colocated runs num_prefill + num_decode servers
    num_decode: int = 1
    omp_threads: int = 1  # OMP_NUM_THREADS of every SGLang process
    kv_tokens_total: int = 3 * 16384  # split evenly over the workers
    host: str = "127.0.0.1"
    base_port: int = 31000  # below the kernel ephemeral range (32768+)
    extra_sglang_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ConfigError("need at least one prefill and one decode worker")
        if self.omp_threads < 1:
            raise ConfigError("omp_threads must be >= 1")
        if self.kv_per_worker < 256:
            raise ConfigError(
                f"kv_tokens_total {self.kv_tokens_total} is too small for {self.num_workers} workers"
            )

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def kv_per_worker(self) -> int:
        return self.kv_tokens_total // self.num_workers

    def worker_args(self) -> tuple[str, ...]:
        # --decode-log-interval: SGLang refreshes the decode load gauges only when it logs
        return (
            "--enable-metrics",
            "--enable-cache-report",
            "--decode-log-interval",
            "4",
            "--max-total-tokens",
            str(self.kv_per_worker),
            *self.extra_sglang_args,
        )

    def env(self) -> dict[str, str]:
        n = str(self.omp_threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}

    def describe(self) -> str:
        return (
            f"{self.num_workers} SGLang worker processes per configuration ({self.num_prefill}P{self.num_decode}D "
            f"for PD, {self.num_workers} colocated servers otherwise), OMP_NUM_THREADS={self.omp_threads} "
            f"each, KV budget {self.kv_tokens_total} tokens in total ({self.kv_per_worker} per worker, "
            f"--max-total-tokens), one router each; PD adds a mooncake_master"
        )


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    name: str
    description: str
    planner: Callable[[Resources, PortAllocator], ClusterPlan]
    baseline: bool = True  # False for our own system (ratios are against the best baseline)

    def plan(self, res: Resources) -> ClusterPlan:
        ports = PortAllocator(res.host, res.base_port, spacing=3)
        plan = self.planner(res, ports)
        return dataclasses.replace(plan, env={**plan.env, **res.env()})


CONFIGS: dict[str, ServingConfig] = {}


def register(cfg: ServingConfig) -> ServingConfig:
    CONFIGS[cfg.name] = cfg
    return cfg


def get(name: str) -> ServingConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}") from None


def worker_urls(plan: ClusterPlan) -> dict[str, str]:
    """Worker name -> base URL, for ``/metrics`` and ``/flush_cache``."""
    return {p.name: p.health_url.rsplit("/health", 1)[0] for p in plan.workers if p.health_url}


def _pd(
    router: str, policy: str, global_store: bool = False
) -> Callable[[Resources, PortAllocator], ClusterPlan]:
    """PD workers behind ``router``. Without the global store the workers are stock
    SGLang (private prefix caches) with the store's page size, so that both arms
    of a store comparison cache in the same units."""

    def planner(res: Resources, ports: PortAllocator) -> ClusterPlan:
        port = ports.take()
        args = res.worker_args()
        if not global_store and "--page-size" not in args:
            args = (*args, "--page-size", str(LaunchConfig.store_page_size))
        return plan_cluster(
            LaunchConfig(
                model_path=res.model_path,
                num_prefill=res.num_prefill,
                num_decode=res.num_decode,
                host=res.host,
                port=port,
                worker_base_port=port + 10,
                sglang_args=args,
                router=router,
                policy=policy,
                global_store=global_store,
            )
        )

    return planner


def _colocated(policy: str) -> Callable[[Resources, PortAllocator], ClusterPlan]:
    def planner(res: Resources, ports: PortAllocator) -> ClusterPlan:
        port = ports.take()
        workers: list[Part] = []
        for i in range(res.num_workers):
            single = plan_single_server(
                res.model_path,
                host=res.host,
                port=ports.take(),
                sglang_args=res.worker_args(),
                name=f"colocated-{i}",
            )
            workers.extend(single.workers)
        urls = [p.health_url.rsplit("/health", 1)[0] for p in workers if p.health_url]
        argv = (
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            res.host,
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            policy,
            "--prometheus-host",
            res.host,
            "--prometheus-port",
            str(ports.take()),
            "--log-level",
            "warn",
        )
        endpoint = f"http://{res.host}:{port}"
        return ClusterPlan(
            endpoint=endpoint,
            model_path=single.model_path,
            served_model_name=single.served_model_name,
            master=None,
            workers=tuple(workers),
            router=Part(name="router", argv=argv, health_url=endpoint + "/health"),
            env=compat.child_env(host=res.host),
        )

    return planner


register(
    ServingConfig(
        "ours",
        "bana_sglang.launch defaults (PD + global KV store + bana_sglang.router, policy bana)",
        _pd("bana", "bana", global_store=True),
        baseline=False,
    )
)
register(
    ServingConfig(
        "pd-cache-aware",
        "stock SGLang PD + sglang_router cache_aware",
        _pd("sglang", "cache_aware"),
    )
)
register(
    ServingConfig(
        "pd-round-robin",
        "stock SGLang PD + sglang_router round_robin",
        _pd("sglang", "round_robin"),
    )
)
# Our router with the baseline policies: in PD mode the stock router's cache_aware
# has no effect (it follows the bootstrap room), so this is the meaningful
# prefix-affinity baseline.
register(
    ServingConfig(
        "bana-cache-aware",
        "stock SGLang PD + bana_sglang.router cache_aware "
        "(per-worker approximate prefix trees, SGLang's thresholds)",
        _pd("bana", "cache_aware"),
    )
)
register(
    ServingConfig(
        "bana-round-robin",
        "stock SGLang PD + bana_sglang.router round_robin",
        _pd("bana", "round_robin"),
    )
)
# The global store's comparison (bench/bench_global_store.py): the same router
# and spreading policy, store on and off; it also runs "ours" and "bana-cache-aware".
register(
    ServingConfig(
        "store-round-robin",
        "PD + global KV store + bana_sglang.router round_robin",
        _pd("bana", "round_robin", global_store=True),
        baseline=False,
    )
)
register(
    ServingConfig(
        "nostore-round-robin",
        "stock SGLang PD (private prefix caches) + bana_sglang.router round_robin",
        _pd("bana", "round_robin"),
    )
)
register(
    ServingConfig(
        "colocated",
        "colocated stock SGLang servers (no PD) + sglang_router cache_aware",
        _colocated("cache_aware"),
    )
)
register(
    ServingConfig(
        "colocated-round-robin",
        "colocated stock SGLang servers (no PD) + sglang_router round_robin",
        _colocated("round_robin"),
    )
)


def _single(res: Resources, ports: PortAllocator) -> ClusterPlan:
    args = list(res.worker_args())
    args[args.index("--max-total-tokens") + 1] = str(
        res.kv_tokens_total
    )  # the whole budget in one process
    return plan_single_server(
        res.model_path, host=res.host, port=ports.take(), sglang_args=tuple(args), name="single-0"
    )


# Not part of the fair side-by-side set (one process): the reference for the
# cross-check, where no router stands between the two tools and the server,
# so both can send token-id prompts of exactly the same lengths.
register(
    ServingConfig(
        "single", "one plain SGLang server (no PD, no router) with the whole KV budget", _single
    )
)

DEFAULT_CONFIGS = ("ours", "pd-cache-aware", "pd-round-robin", "colocated")


def model_dir(model: str | None) -> Path:
    from bana_sglang import models

    return Path(models.resolve(model))
