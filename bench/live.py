"""The live harness shared by :mod:`bench.calibrate` and :mod:`bench.fidelity`: the
1P1D cluster, the client, fresh prompts, the warm-up, and what the host and the
cluster's logs say about a run (CPU steal, Mooncake transfer faults).
"""

from __future__ import annotations

import random
from pathlib import Path

from bana_sglang.launch import Cluster, LaunchConfig, plan_cluster
from bench import configs
from bench.client import ClientConfig, replay_checked
from bench.workloads import Request

WARM_BURST = (1792, 1536, 1280, 1024, 768, 512, 256, 128)  # 7296 tokens


def start_cluster(model: str, port: int, log_dir: Path) -> Cluster:
    """A 1P1D cluster of ``model`` with the launcher's defaults (global store on,
    load-aware router); a context manager that stops every process on exit."""
    cfg = LaunchConfig(
        model_path=str(configs.model_dir(model)),
        num_prefill=1,
        num_decode=1,
        port=port,
        worker_base_port=port + 10,
        log_dir=log_dir,
    )
    return Cluster(plan_cluster(cfg), log_dir=log_dir, startup_timeout=900)


def live_client(endpoint: str) -> ClientConfig:
    """The benchmark client for ``endpoint``'s first served model, with token-id prompts."""
    import httpx

    model = httpx.get(endpoint + "/v1/models", timeout=60).json()["data"][0]["id"]
    return ClientConfig(endpoint=endpoint, model=model, prompt_mode="ids", progress=False)


def replay(cfg: ClientConfig, reqs: list[Request]) -> list:
    """Replay ``reqs`` and return their records; raises if any request failed."""
    return replay_checked(cfg, reqs)


def fresh_prompt(seed: int, n: int) -> tuple[int, ...]:
    """``n`` token ids drawn from ``seed``: a prompt no cache holds."""
    rng = random.Random(seed)
    return tuple(rng.randrange(10, 8000) for _ in range(n))


def fresh_batch(lens, seed: int, max_tokens: int, *, stride: int = 1, rid0: int = 0) -> list:
    """Requests arriving together with fresh prompts of ``lens`` tokens (request i's
    prompt seeded ``seed + stride * i``)."""
    return [
        Request(
            rid=rid0 + i,
            arrival_s=0.0,
            prompt=fresh_prompt(seed + stride * i, n),
            max_tokens=max_tokens,
        )
        for i, n in enumerate(lens)
    ]


def warm_up(cfg) -> None:
    """Two fresh prompts (256 and 2048 tokens) through the cluster before anything
    is measured: the first requests after start-up pay one-off costs (connections,
    first allocations) that the profile, calibrated warm, does not model."""
    for i, n in enumerate((256, 2048)):
        replay(cfg, [Request(rid=i, arrival_s=0.0, prompt=fresh_prompt(900 + i, n), max_tokens=4)])
    # a burst of mixed lengths decoding together (WARM_BURST tokens of KV at once)
    replay(cfg, fresh_batch(WARM_BURST, 910, 16, rid0=10))


STALL_LINE = (
    "Failed to complete transfers after"  # Mooncake: a batch waited out its transfer timeout
)
FAIL_LINE = "TRANSFER_FAIL"


def store_faults(log_dir: Path) -> dict[str, int]:
    """Mooncake transfer faults the cluster's processes logged: ``stalls`` (batches
    that waited out the transfer engine's 60 s timeout; while one waits, the
    machine's two cores do measurably less work) and ``failed`` (keys whose
    transfer failed: publishes skipped, loads missed). A run with stalls is not
    the system the profile describes."""
    out = {"stalls": 0, "failed": 0}
    for f in sorted(Path(log_dir).glob("*.log")):
        with open(f, errors="replace") as fh:
            for line in fh:
                if STALL_LINE in line:
                    out["stalls"] += 1
                elif FAIL_LINE in line:
                    out["failed"] += 1
    return out


def cpu_steal_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat: the share of time the
    hypervisor gave this VM's CPUs to someone else; (0, 0) where unreadable."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (f[7] if len(f) > 7 else 0), sum(f[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """CPU steal between two :func:`cpu_steal_ticks` readings, as a share of all CPU time."""
    return (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else 0.0
