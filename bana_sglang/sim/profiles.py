"""Cost-model profiles for the simulator: hardware + model + stated assumptions.

A profile is a JSON file (``profiles/*.json``) holding only *inputs* with their
sources: hardware figures, model shape, and efficiency assumptions. Everything
the simulator uses (prefill seconds, decode step seconds, KV capacity, bytes per
token, bandwidths) is derived here, in one place, so each number traces back to
a line of the JSON.

Time model (one worker = ``gpus`` devices in tensor parallel):
- prefill of ``n`` new tokens after ``c`` cached ones:
  ``fixed + (2 P n + 4 L d n (c + n / 2)) / (peak_flops * mfu)``
  (dense matmuls plus causal attention, P parameters, L layers, d = heads * head_dim);
- decode step of a batch of ``B`` requests holding ``K`` KV tokens:
  ``fixed + per_request B + max(W / (hbm_bw * hbm_eff) + K kv_bytes / kv_rate, 2 P B / (peak_flops * mfu))``
  (``per_request`` is 0 and ``kv_rate`` is ``hbm_bw * hbm_eff`` in the GPU profiles; the CPU
  calibration fits both);
- transfers: ``bytes / (bandwidth * efficiency)``.

Invariants: a ``Profile`` is frozen and validated; ``load_profile`` accepts a
registry name or a path, so a later calibration command can write a JSON with
measured values and run the same simulator on it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "h100_llama3_8b"


class ProfileError(ValueError):
    """A profile is missing, malformed or physically invalid."""

    def __init__(self, profile: str, reason: str):
        self.profile, self.reason = profile, reason
        super().__init__(f"profile {profile!r}: {reason}")


@dataclass(frozen=True)
class Profile:
    name: str
    # hardware, per worker (all of its TP devices together)
    gpus: int
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes_per_s: float
    mem_bytes: float
    net_bytes_per_s: float  # this worker's share of the RDMA/TCP fabric
    # model
    num_layers: int
    hidden_size: int
    num_params: float
    kv_bytes_per_token: int  # all layers, K and V
    weight_bytes: float
    # assumptions
    mfu: float
    hbm_efficiency: float
    net_efficiency: float
    mem_utilisation: float  # fraction of memory the server may use (weights + KV)
    prefill_fixed_s: float
    decode_fixed_s: float
    transfer_fixed_s: float
    max_prefill_tokens: int
    max_decode_batch: int
    pd_transfer_overlap: float  # fraction of the P->D KV transfer hidden under compute
    store_bytes_per_s: float  # global store -> worker, before efficiency
    local_cache_fraction: float  # of the KV pool a prefill worker keeps as prefix cache
    store_capacity_tokens_per_worker: int
    # Workers that share one host's cores (SimConfig.shared_host): a prefill chunk
    # or decode step runs this many times slower while another worker computes.
    host_contention_prefill: float = 1.0
    host_contention_decode: float = 1.0
    # SGLang's scheduler details that show on a CPU worker (measured by calibration):
    # seconds between a request's first token (prefill) and its first decode step
    # beyond the KV transfer (bootstrap, admission), and whether a prefill batch's
    # results wait for the next batch to compute (the overlap event loop, which on a
    # CPU computes synchronously inside "launch")
    pd_handoff_s: float = 0.0
    prefill_result_lag: bool = False
    # a request joining a decode worker's batch (its KV arrived) holds the whole batch
    # for ``decode_join_s + decode_join_s_per_token * prompt tokens``: receiving and
    # admitting it takes the worker's own cores (measured on a CPU host; 0 on GPUs,
    # where the KV lands in HBM without the decode loop)
    decode_join_s: float = 0.0
    decode_join_s_per_token: float = 0.0
    # that hold runs this many times longer while another worker of the shared host
    # computes (SimConfig.shared_host; measured by calibration: a join during a long
    # prefill against one with the prefill idle). The KV transfer into the decode
    # worker and its admission compete for the same cores as the prefill, so this is
    # larger than host_contention_decode. Per other computing worker, as the others.
    host_contention_join: float = 1.0
    # per running request and decode step, beyond the memory/compute law (a CPU
    # worker's per-request work: sampling, bookkeeping, its attention call); 0 on GPUs
    decode_per_request_s: float = 0.0
    # KV read rate of a decode step's attention (0: hbm_bytes_per_s x hbm_efficiency, as
    # for the weights; a CPU attention kernel reads KV far slower than its GEMMs read weights)
    kv_read_bytes_per_s: float = 0.0
    # attention of new tokens over a cached prefix (chunked prefill, prefix reuse) costs
    # this many times its FLOPs at the prefill rate (1 on GPUs; the CPU fits it)
    prefix_attention_cost: float = 1.0
    # per layer and decode step, the wait of a KV-block lender for its host's partial
    # attention (the round trip of queries and partial outputs; the host's own read of
    # the pages is charged to the host)
    remote_attention_hop_s: float = 0.0
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in (
            "gpus",
            "peak_flops",
            "hbm_bytes_per_s",
            "mem_bytes",
            "net_bytes_per_s",
            "num_layers",
            "num_params",
            "kv_bytes_per_token",
            "weight_bytes",
            "max_prefill_tokens",
            "max_decode_batch",
            "store_bytes_per_s",
        ):
            if getattr(self, f) <= 0:
                raise ProfileError(self.name, f"{f} must be positive")
        for f in ("mfu", "hbm_efficiency", "net_efficiency", "mem_utilisation"):
            if not 0 < getattr(self, f) <= 1:
                raise ProfileError(self.name, f"{f} must be in (0, 1]")
        if self.prefix_attention_cost <= 0:
            raise ProfileError(self.name, "prefix_attention_cost must be positive")
        if self.kv_read_bytes_per_s < 0:
            raise ProfileError(self.name, "kv_read_bytes_per_s must be >= 0 (0: the HBM rate)")
        if self.decode_per_request_s < 0:
            raise ProfileError(self.name, "decode_per_request_s must be >= 0")
        if self.remote_attention_hop_s < 0:
            raise ProfileError(self.name, "remote_attention_hop_s must be >= 0")
        if self.pd_handoff_s < 0:
            raise ProfileError(self.name, "pd_handoff_s must be >= 0")
        if min(self.decode_join_s, self.decode_join_s_per_token) < 0:
            raise ProfileError(self.name, "decode_join_s and decode_join_s_per_token must be >= 0")
        if (
            min(
                self.host_contention_prefill, self.host_contention_decode, self.host_contention_join
            )
            < 1
        ):
            raise ProfileError(self.name, "host contention factors must be >= 1 (1: none)")
        if not 0 <= self.pd_transfer_overlap < 1 or not 0 <= self.local_cache_fraction < 1:
            raise ProfileError(self.name, "overlap/cache fractions must be in [0, 1)")
        if self.kv_capacity_tokens < self.max_prefill_tokens:
            raise ProfileError(
                self.name,
                f"KV pool ({self.kv_capacity_tokens} tokens) "
                "smaller than one prefill batch: the model does not fit",
            )

    # -- derived ---------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        free = self.mem_bytes * self.mem_utilisation - self.weight_bytes
        return int(free // self.kv_bytes_per_token)

    @property
    def layer_weight_bytes(self) -> int:
        return int(self.weight_bytes / self.num_layers)

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.mfu

    @property
    def prefill_tokens_per_s(self) -> float:
        """Throughput on 4K-token prompts without cache (a nominal figure)."""
        return 4096 / self.prefill_seconds(4096, 0)

    def prefill_flops(self, new: int, cached: int) -> float:
        return 2.0 * self.num_params * new + 4.0 * self.num_layers * self.hidden_size * new * (
            self.prefix_attention_cost * cached + new / 2.0
        )

    def prefill_seconds(self, new: int, cached: int) -> float:
        return self.prefill_fixed_s + self.prefill_flops(new, cached) / self.flops_per_s

    def lone_prefill_seconds(self, new: int, cached: int = 0) -> float:
        """``new`` tokens after a ``cached`` prefix prefilled alone on an idle worker, in
        chunks of ``max_prefill_tokens`` as the simulator schedules them (no queueing,
        no host contention, no layer migration)."""
        done, t = 0, 0.0
        while done < new:
            take = min(self.max_prefill_tokens, new - done)
            t += self.prefill_seconds(take, cached + done)
            done += take
        return t

    def decode_step_seconds(self, batch: int, kv_tokens: float) -> float:
        hbm = self.hbm_bytes_per_s * self.hbm_efficiency
        mem = self.weight_bytes / hbm + self.kv_read_seconds(kv_tokens)
        comp = 2.0 * self.num_params * batch / self.flops_per_s
        return self.decode_fixed_s + self.decode_per_request_s * batch + max(mem, comp)

    def kv_read_seconds(self, tokens: float) -> float:
        """Reading ``tokens`` of KV (all layers) for attention, as a decode step does."""
        return (
            tokens
            * self.kv_bytes_per_token
            / (self.kv_read_bytes_per_s or self.hbm_bytes_per_s * self.hbm_efficiency)
        )

    def join_stall_seconds(self, prompt_tokens: int, admission: bool = True) -> float:
        """How long a decode batch holds while a request of ``prompt_tokens`` joins it;
        ``admission=False`` for one admitted with others (SGLang's decode scheduler
        takes every request whose KV has arrived into one prebuilt batch, so the fixed
        part ``decode_join_s`` is paid once per group)."""
        return self.decode_join_s * admission + self.decode_join_s_per_token * prompt_tokens

    def shared_host_factors(self, others: int) -> tuple[float, float, float]:
        """How many times slower a prefill chunk, a decode step and a join's hold run
        while ``others`` other workers compute on the same host: each factor per other."""
        return (
            1.0 + (self.host_contention_prefill - 1.0) * others,
            1.0 + (self.host_contention_decode - 1.0) * others,
            1.0 + (self.host_contention_join - 1.0) * others,
        )

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> Profile:
        """This profile on a host ``prefill``/``decode`` times slower (below 1: faster):
        every prefill term (the FLOP rate, the fixed cost) by ``prefill``, and every
        decode-side term (the weights' and KV reads, the per-step and per-request costs,
        a join's hold, the PD hand-off) by ``decode``. Transfers and contention ratios
        stay. The fidelity run uses it to follow a shared VM's drifting speed."""
        if prefill <= 0 or decode <= 0:
            raise ProfileError(
                self.name, f"speed scales must be positive, got prefill {prefill}, decode {decode}"
            )
        return replace(
            self,
            peak_flops=self.peak_flops / prefill,
            prefill_fixed_s=self.prefill_fixed_s * prefill,
            hbm_bytes_per_s=self.hbm_bytes_per_s / decode,
            kv_read_bytes_per_s=self.kv_read_bytes_per_s / decode,
            decode_fixed_s=self.decode_fixed_s * decode,
            decode_per_request_s=self.decode_per_request_s * decode,
            decode_join_s=self.decode_join_s * decode,
            decode_join_s_per_token=self.decode_join_s_per_token * decode,
            pd_handoff_s=self.pd_handoff_s * decode,
        )

    def net_seconds(self, nbytes: float) -> float:
        return self.transfer_fixed_s + nbytes / (self.net_bytes_per_s * self.net_efficiency)

    def store_seconds(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.store_bytes_per_s * self.net_efficiency)


def _flatten(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """JSON sections ``hardware``/``model``/``assumptions`` hold ``{"value", "source"}``
    entries (or bare numbers); flatten to Profile fields."""
    out: dict[str, Any] = {"name": doc.get("name", name)}
    sources: list[str] = list(doc.get("sources", []))
    assumptions: list[str] = []
    for section in ("hardware", "model", "assumptions"):
        for key, entry in doc.get(section, {}).items():
            if isinstance(entry, dict):
                out[key] = entry["value"]
                note = entry.get("source") or entry.get("why")
                if note:
                    (assumptions if section == "assumptions" else sources).append(f"{key}: {note}")
            else:
                out[key] = entry
    out["sources"], out["assumptions"] = tuple(sources), tuple(assumptions)
    return out


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile by registry name (``profiles/<name>.json``) or by path."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILE_DIR / f"{name_or_path}.json"
    if not p.is_file():
        raise ProfileError(
            str(name_or_path), f"no such file {p}; known: {', '.join(list_profiles())}"
        )
    try:
        doc = json.loads(p.read_text())
        return Profile(**_flatten(doc, p.stem))
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ProfileError(p.stem, f"malformed: {e}") from e


_SECTIONS = {
    "hardware": (
        "gpus",
        "peak_flops",
        "hbm_bytes_per_s",
        "mem_bytes",
        "net_bytes_per_s",
        "store_bytes_per_s",
    ),
    "model": ("num_layers", "hidden_size", "num_params", "kv_bytes_per_token", "weight_bytes"),
}


def save_profile(p: Profile, path: Path | str, notes: dict[str, str] | None = None) -> Path:
    """Write ``p`` in the sectioned JSON format ``load_profile`` reads; ``notes``
    maps field names to their source (a calibration run states what it measured)."""
    notes = notes or {}
    doc: dict[str, Any] = {"name": p.name, "hardware": {}, "model": {}, "assumptions": {}}
    placed = {f for fs in _SECTIONS.values() for f in fs}
    for f in Profile.__dataclass_fields__:
        if f in ("name", "sources", "assumptions"):
            continue
        section = next((s for s, fs in _SECTIONS.items() if f in fs), "assumptions")
        key = "why" if f not in placed else "source"
        doc[section][f] = {"value": getattr(p, f), key: notes.get(f, "")}
    out = Path(path)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def list_profiles() -> list[str]:
    # ``*.fit.json`` next to a calibrated profile holds its fit, not a profile
    return sorted(q.stem for q in PROFILE_DIR.glob("*.json") if not q.name.endswith(".fit.json"))
