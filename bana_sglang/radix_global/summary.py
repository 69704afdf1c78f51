"""The global store's per-worker counters, read from each worker's ``/metrics``.

``python -m bana_sglang.radix_global.summary http://127.0.0.1:30206 ...`` prints
one row per worker; the launcher prints the same table when it stops a cluster
that ran the store.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from collections.abc import Sequence

from bana_sglang import _cli

PREFIX = "bana_store_"


def parse(text: str) -> dict[str, float]:
    """``bana_store_*_total`` counters of a Prometheus text page, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{", 1)[0].removeprefix(PREFIX)
        if not key.endswith("_total"):
            continue
        try:
            out[key.removesuffix("_total")] = out.get(key.removesuffix("_total"), 0.0) + float(
                value
            )
        except ValueError:
            continue
    return out


def parse_histograms(text: str) -> dict[str, tuple[float, float]]:
    """``bana_store_*`` histograms of a Prometheus text page: name -> (sum, count),
    summed over labels."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{", 1)[0].removeprefix(PREFIX)
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            if key.endswith(suffix):
                try:
                    out.setdefault(key.removesuffix(suffix), [0.0, 0.0])[slot] += float(value)
                except ValueError:
                    pass
    return {k: (v[0], v[1]) for k, v in out.items()}


def _get(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")
    except OSError:
        return None


def scrape(url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """The counters of the worker at ``url``, or None when it does not answer."""
    text = _get(url, timeout)
    return None if text is None else parse(text)


def scrape_all(url: str, timeout: float = 5.0) -> dict[str, float] | None:
    """The counters and, as ``<name>_sum``/``<name>_count``, the histograms of the
    worker at ``url``; None when it does not answer."""
    text = _get(url, timeout)
    if text is None:
        return None
    out = parse(text)
    for name, (total, count) in parse_histograms(text).items():
        out[f"{name}_sum"] = total
        out[f"{name}_count"] = count
    return out


def table(rows: Sequence[tuple[str, dict[str, float] | None]]) -> str:
    head = (
        f"{'worker':<12} {'local hit tok':>13} {'global hit tok':>14} {'loaded MB':>9} "
        f"{'load s':>7} {'hidden':>6} {'published pages':>15} {'published MB':>12} {'failures':>8}"
    )
    lines = [head]
    for name, m in rows:
        if m is None:
            lines.append(f"{name:<12} (no answer)")
            continue
        load = m.get("load_seconds", 0.0)
        hidden = f"{1 - m.get('load_wait_seconds', 0.0) / load:.0%}" if load else "-"
        lines.append(
            f"{name:<12} {m.get('local_hit_tokens', 0):>13.0f} {m.get('global_hit_tokens', 0):>14.0f} "
            f"{m.get('loaded_bytes', 0) / 1e6:>9.2f} {load:>7.2f} {hidden:>6} "
            f"{m.get('published_pages', 0):>15.0f} {m.get('published_bytes', 0) / 1e6:>12.2f} "
            f"{m.get('load_failures', 0):>8.0f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bana_sglang.radix_global.summary",
        description="Print the global store's counters of each worker.",
    )
    p.add_argument("urls", nargs="+", help="worker base URLs, e.g. http://127.0.0.1:30206")
    p.add_argument("--log-level", default="WARNING")
    args, _ = _cli.parse(p, list(argv) if argv is not None else None, lambda a: None)
    print(table([(u, scrape(u)) for u in args.urls]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
