"""The global-store benchmark's comparisons: the store alone, and as shipped against
the stock private-cache arms (no cluster)."""

from __future__ import annotations

from types import SimpleNamespace

from bench import bench_global_store as gs
from bench import global_store_report as rep


def _arm(name: str, hit: float | None, p50: float, p99: float, rps: float = 1.0) -> rep.ArmResult:
    summary = SimpleNamespace(
        prefix_hit_rate=hit,
        ttft=SimpleNamespace(p50=p50, p99=p99),
        req_per_s=rps,
        out_tok_per_s=10.0,
        errors=0,
    )
    return rep.ArmResult(name, summary, {})


def _row(rows: list[str], label: str) -> list[str]:
    (row,) = [r for r in rows if r.startswith(f"| {label} |")]
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_the_store_alone_and_as_shipped_against_each_stock_arm_and_the_better_one() -> None:
    by = {
        a.name: a
        for a in (
            _arm("store-round-robin", 0.40, 2.0, 10.0, rps=1.0),
            _arm("nostore-round-robin", 0.20, 4.0, 8.0, rps=0.8),
            _arm("ours", 0.40, 1.0, 6.0, rps=1.2),
            _arm("bana-cache-aware", 0.32, 3.0, 12.0, rps=1.0),
        )
    }
    rows = rep.ratio_rows(by, 0.5)
    # hit / infinite, hit / stock hit, p50, p99, throughput
    assert _row(rows, "store / no store, both round-robin") == [
        "0.80",
        "2.00",
        "0.50",
        "1.25",
        "1.25",
    ]
    assert _row(rows, "ours / nostore-round-robin") == ["0.80", "2.00", "0.25", "0.75", "1.50"]
    assert _row(rows, "ours / bana-cache-aware") == ["0.80", "1.25", "0.33", "0.50", "1.20"]
    # the better stock arm for each figure: the higher hit rate, the lower p50 and p99,
    # the higher throughput
    assert _row(rows, "ours / the better stock arm") == ["0.80", "1.25", "0.33", "0.75", "1.20"]


def test_an_arm_without_a_successful_request_gives_n_a_not_a_crash() -> None:
    nan = float("nan")
    by = {
        a.name: a
        for a in (
            _arm("ours", 0.4, 1.0, 2.0, rps=1.0),
            _arm("nostore-round-robin", None, nan, nan, rps=0.0),
            _arm("bana-cache-aware", 0.2, 2.0, 4.0, rps=0.5),
        )
    }
    rows = rep.ratio_rows(by, 0.5)
    assert _row(rows, "ours / nostore-round-robin") == ["0.80", "n/a", "n/a", "n/a", "n/a"]
    # the better stock arm leaves the broken one out, whatever its place
    assert _row(rows, "ours / the better stock arm") == ["0.80", "2.00", "0.50", "0.50", "2.00"]


def test_only_the_comparisons_whose_arms_ran() -> None:
    only_rr = {a.name: a for a in (_arm("store-round-robin", 0.4, 1, 1), _arm("ours", 0.4, 1, 1))}
    assert rep.ratio_rows(only_rr, 0.5) == []
    rows = rep.ratio_rows(
        {a.name: a for a in (_arm("ours", None, 1, 2), _arm("bana-cache-aware", 0.3, 2, 2))}, 0.5
    )
    assert _row(rows, "ours / bana-cache-aware") == ["n/a", "n/a", "0.50", "1.00", "1.00"]
    assert not any(r.startswith("| ours / the better") for r in rows)


def test_cpu_rows_group_parts_and_compare_with_the_first_stock_arm() -> None:
    from bench import breakdown

    on = _arm("ours", 0.4, 1, 1)
    on.cpu_s = breakdown.cpu_columns(
        {"prefill-0": 30.0, "prefill-1": 20.0, "decode-0": 20.0, "kv-storage": 8.0, "router": 2.0}
    )
    off = _arm("nostore-round-robin", 0.2, 1, 1)
    off.cpu_s = breakdown.cpu_columns({"prefill-0": 55.0, "prefill-1": 25.0, "decode-0": 20.0})
    other = _arm("bana-cache-aware", 0.3, 1, 1)
    other.cpu_s = breakdown.cpu_columns({"prefill-0": 40.0, "decode-0": 10.0})
    rows = rep.cpu_rows([on, off, other])
    assert "total / nostore-round-robin" in rows[2]  # the first stock arm that ran
    # prefill, decode, router, master, storage, index, total, total / stock
    assert _row(rows, "ours") == ["50.0", "20.0", "2.0", "0.0", "8.0", "0.0", "80.0", "0.80"]
    assert _row(rows, "nostore-round-robin")[-2:] == ["100.0", "1.00"]
    assert _row(rows, "bana-cache-aware")[-2:] == ["50.0", "0.50"]
    assert rep.cpu_rows([_arm("ours", 0.4, 1, 1)]) == []


def test_ttft_splits_at_the_opening_window_and_is_compared_after_it() -> None:
    def rec(ok, ttft, at, cached=None, n=100):
        return SimpleNamespace(ok=ok, ttft=ttft, scheduled_s=at, cached_tokens=cached, prompt_len=n)

    recs = [
        rec(True, 5.0, 0.0, cached=0),
        rec(True, 7.0, 0.5, cached=50),
        rec(False, None, 1.0, cached=100),  # failed: in neither window
        rec(True, 0.2, 20.0, cached=80),
        rec(True, 0.4, 30.0, cached=None),  # no cache report: not in the hit rate
    ]
    assert rep.split_ttft(recs, 10.0) == ([5.0, 7.0], [0.2, 0.4])
    assert rep.split_hit(recs, 10.0) == (0.25, 0.8)
    assert rep.split_hit(recs[:3], 10.0) == (0.25, None)
    on, off = _arm("ours", 0.4, 1, 1), _arm("nostore-round-robin", 0.2, 1, 1)
    aff = _arm("bana-cache-aware", 0.3, 1, 1)
    on.start_ttft, on.after_ttft = [6.0, 8.0], [0.1, 0.3]
    on.start_hit, on.after_hit = 0.125, 0.75
    off.start_ttft, off.after_ttft = [5.0, 7.0], [0.2, 0.6]
    aff.start_ttft, aff.after_ttft = [5.0, 9.0], [0.4, 0.4]  # a higher p50, a lower p99
    rows = rep.phase_rows([on, off, aff], 10.0, (0.15, 0.8))
    assert "first 10.0 s" in rows[0]
    ours = [r for r in rows if r.startswith("| ours |")]
    # per arm: start n, hit, p50, p99, mean; after n, hit, p50, p99, mean
    assert ours[0] == (
        "| ours | 2 | 12.5% | 7.000 | 7.980 | 7.000 | 2 | 75.0% | 0.200 | 0.298 | 0.200 |"
    )
    assert _row(rows, "nostore-round-robin")[1] == "-"  # no hit rate measured
    (inf,) = [r for r in rows if r.startswith("| infinite cache |")]
    assert [c.strip() for c in inf.strip("|").split("|")][2] == "15.0%"
    assert [c.strip() for c in inf.strip("|").split("|")][7] == "80.0%"
    # after the start, against the better stock arm figure by figure:
    # p50 0.2 / min(0.4, 0.4), p99 0.298 / min(0.596, 0.4)
    assert ours[1] == "| ours | 0.50 | 0.74 |"
    assert rep.phase_rows([on, off], 0.0) == []


def test_a_failed_raw_bandwidth_probe_is_reported_not_fatal() -> None:
    on = _arm("store-round-robin", 0.5, 1, 2)
    on.store = {
        "prefill-0": {"loaded_bytes": 4e6, "load_seconds": 0.1, "load_wait_seconds": 0.01},
        "decode-0": None,
    }
    on.raw_error = "AssertionError: put: NO_AVAILABLE_HANDLE (store full or no segment mounted)"
    text = rep.report([on], 0.5, SimpleNamespace(describe=lambda: "w"), "cmd")
    assert (
        "- raw Mooncake bandwidth: not measured (AssertionError: put: NO_AVAILABLE_HANDLE" in text
    )
    assert "load bandwidth reached: 40.0 MB/s" in text
    assert "ratio" not in text.split("load bandwidth reached")[1].split("\n")[1]


def test_the_infinite_cache_counts_a_window_with_every_earlier_page_cached() -> None:
    """Every page computed before is hit (never a prompt's last token); a window
    counts only its own requests' tokens, the requests before it still fill the cache."""

    def req(t: float, prompt: list[int]):
        return SimpleNamespace(arrival_s=t, prompt=prompt)

    a = list(range(8))
    wl = SimpleNamespace(requests=(req(0.0, a), req(1.0, a + [9, 9, 9, 9]), req(2.0, a)))
    # 0 of 8, then 8 of 12, then 4 of 8 (its last page holds its last token)
    assert gs.infinite_cache_hits(wl, 4) == (12, 28)
    assert gs.infinite_cache_hits(wl, 4, until=1.0) == (0, 8)
    assert gs.infinite_cache_hits(wl, 4, since=1.0) == (12, 20)
