"""The per-request breakdown of the global store's costs, from ``/metrics``.

Every benchmark that runs the store prints it for its store arm: the
workers' ``bana_store_*`` counters and histograms and the router's
``bana_router_global_lookup_seconds``, as deltas over a phase, divided by the
phase's requests. :func:`scrape` and :func:`router_metrics` read them;
:func:`rows` and :func:`markdown` lay them out. :func:`cpu_of_parts` adds what
``/metrics`` cannot see: the CPU time of each of the cluster's processes (a
worker with its scheduler and detokenizer, the router, the store's three).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import httpx
import psutil

from bana_sglang.radix_global import summary as store_summary

Metrics = Mapping[str, Mapping[str, float]]  # worker -> name -> value


def scrape(urls: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Counters and histogram sums/counts of each worker (empty for one that did not answer)."""
    return {name: store_summary.scrape_all(u) or {} for name, u in urls.items()}


def router_metrics(endpoint: str) -> dict[str, float]:
    """The router's global lookup histogram (``global_lookup_seconds_sum``/``_count``)."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(endpoint + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("bana_router_global_lookup_seconds_") and " " in line:
            name, _, value = line.rpartition(" ")
            if name.endswith(("_sum", "_count")):
                out[name.removeprefix("bana_router_")] = float(value)
    return out


def cpu_of_parts(procs) -> dict[str, float]:
    """CPU seconds so far (user + system, every thread) of each running part of a
    cluster (``Cluster.procs``), its child processes included, by part name."""
    out: dict[str, float] = {}
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        total = 0.0
        for p in tree:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        out[proc.name] = total
    return out


#: (name prefix of a cluster part, column): how the CPU tables group a cluster's parts
CPU_PARTS = (
    ("prefill", "prefill"),
    ("decode", "decode"),
    ("router", "router"),
    ("mooncake-master", "master"),
    ("kv-storage", "storage"),
    ("kv-index", "index"),
)


def cpu_columns(cpu_s: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds by part name (:func:`cpu_of_parts` deltas) -> by column of
    :data:`CPU_PARTS` (every column present), plus ``total``."""
    out = {col: 0.0 for _, col in CPU_PARTS}
    for part, secs in cpu_s.items():
        col = next((c for prefix, c in CPU_PARTS if part.startswith(prefix)), None)
        if col is not None:
            out[col] += secs
    out["total"] = sum(out.values())
    return out


def master_addr(plan) -> str:
    """``host:port`` of a cluster plan's Mooncake master (its RPC port)."""
    flags = dict(a.lstrip("-").split("=", 1) for a in plan.master.argv if a.startswith("-rpc_"))
    return f"{flags.get('rpc_address', '127.0.0.1')}:{flags['rpc_port']}"


def page_nbytes(plan) -> int:
    """Bytes of one store page's payload in a cluster plan: float32 K and V of every
    layer (the embedded models' dtype), at the workers' page size."""
    from bana_sglang.launch import page_size_of

    page_size = page_size_of(tuple(plan.workers[0].argv), 16)
    cfg = json.loads((Path(plan.model_path) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * page_size * heads * head_dim * 4


def raw_bandwidth(master: str, page_bytes: int, total_mb: int) -> tuple[float, float]:
    """(put, get) MB/s of whole pages in batches of 16 through the same store
    (registered buffers, zero copy): the wire's speed that loads are held to."""
    from bana_sglang.radix_global import bench_store

    rows = bench_store.run(master, [page_bytes], total_mb << 20, batch=16)
    reg = next(r for r in rows if r[0] == "registered")
    return reg[2], reg[3]


def load_figures(metrics: Metrics) -> tuple[float, float, float] | None:
    """(loaded MB, load-thread seconds, fraction hidden under compute) summed over
    workers, or None if nothing was loaded."""
    loaded = sum(m.get("loaded_bytes", 0.0) for m in metrics.values())
    load_s = sum(m.get("load_seconds", 0.0) for m in metrics.values())
    wait_s = sum(m.get("load_wait_seconds", 0.0) for m in metrics.values())
    if not load_s or not loaded:
        return None
    return loaded / 1e6, load_s, 1.0 - wait_s / load_s


def delta(after: Metrics, before: Metrics) -> dict[str, dict[str, float]]:
    return {
        w: {k: v - before.get(w, {}).get(k, 0.0) for k, v in m.items()} for w, m in after.items()
    }


def rows(
    metrics: Metrics, n: int, router: Mapping[str, float] | None = None
) -> list[tuple[str, str]]:
    """(what, value) per row, for ``n`` requests."""
    n = max(1, n)
    tot: dict[str, float] = {}
    for m in metrics.values():
        for k, v in m.items():
            tot[k] = tot.get(k, 0.0) + v

    def ms(key: str) -> str:
        return f"{1e3 * tot.get(key, 0.0) / n:.2f} ms per request"

    def per_call(name: str) -> str:
        c = tot.get(f"{name}_count", 0.0)
        return f"{1e3 * tot.get(f'{name}_sum', 0.0) / c:.2f} ms x {c / n:.1f}" if c else "-"

    out: list[tuple[str, str]] = []
    if router is not None:
        c = router.get("global_lookup_seconds_count", 0.0)
        s = router.get("global_lookup_seconds_sum", 0.0)
        out.append(
            ("router: global lookup (beside the dispatch)", f"{1e3 * s / c:.2f} ms" if c else "-")
        )
    tok_p = tot.get("forward_tokens_publishing", 0.0)
    sec_p = tot.get("forward_seconds_publishing", 0.0)
    tok = tot.get("forward_tokens", 0.0) - tok_p
    sec = tot.get("forward_seconds", 0.0) - sec_p
    slow = (
        f"{(sec_p / tok_p) / (sec / tok):.2f}x ({1e6 * sec_p / tok_p:.0f} vs "
        f"{1e6 * sec / tok:.0f} us/token)"
        if tok and tok_p and sec and sec_p
        else "no forward overlapped a publish"
    )
    loaded = tot.get("loaded_pages", 0.0)
    local_share = f"{tot.get('local_loaded_pages', 0.0) / loaded:.0%}" if loaded else "-"
    out += [
        ("worker: index round trip per lookup", per_call("lookup_index_seconds")),
        ("worker: presence check per hit lookup", per_call("lookup_header_seconds")),
        (
            "worker: hit pages recomputed (load predicted slower)",
            f"{tot.get('recomputed_hit_pages', 0.0) / n:.1f} per request",
        ),
        ("worker: load batch", per_call("load_batch_seconds")),
        ("worker: of which read sessions", ms("load_session_seconds")),
        ("worker: of which reads (Mooncake or the storage process)", ms("load_read_seconds")),
        ("worker: of which header and MAC checks", ms("load_verify_seconds")),
        ("worker: of which copies into the KV pool", ms("load_copy_seconds")),
        ("worker: loaded pages copied by the storage process", local_share),
        ("worker: forward waiting for layers", ms("load_wait_seconds")),
        ("worker: publishing wall time", ms("publish_seconds")),
        ("worker: publishing CPU time (publish thread)", ms("publish_cpu_seconds")),
        ("worker: publishing index round trips", per_call("publish_index_seconds")),
        ("worker: published", f"{tot.get('published_bytes', 0.0) / n / 1e6:.2f} MB per request"),
        ("prefill forward per token while a publish was written", slow),
    ]
    return out


def markdown(metrics: Metrics, n: int, router: Mapping[str, float] | None = None) -> str:
    lines = ["| | per request |", "|---|---|"]
    lines += [f"| {what} | {value} |" for what, value in rows(metrics, n, router)]
    return "\n".join(lines)
