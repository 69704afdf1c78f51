"""The benchmark harness without a server: workloads keep the trace's prefix
structure, generators and resources are as specified, and the metrics and the
results writer compute and place what they should. The replay client against a
real SGLang server is tested in ``tests/live/test_bench_live.py``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from bench import client, configs, metrics, results, workloads
from bench.workloads import TokenSpace, WorkloadSpec


@pytest.fixture(scope="module")
def space(tiny_model: Path) -> TokenSpace:
    return TokenSpace.from_model(tiny_model)


# --------------------------------------------------------------------------- workloads (no server)


def test_token_space_round_trips_as_text(space: TokenSpace, tiny_model: Path) -> None:
    assert space.context_len == 4096
    assert not {0, 1, 2, 3, 4, 5, 6} & set(space.ids)
    assert len(space.ids) > 200
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = list(workloads.block_tokens(7, "x", 500, space))
    assert tok.encode(space.to_text(ids), add_special_tokens=False).ids == ids


def test_mooncake_prompts_follow_hash_ids(space: TokenSpace) -> None:
    """Same hash id at a block position -> identical token block; different -> different."""
    wl = workloads.build(WorkloadSpec(name="mooncake", num_requests=80, length_scale=1 / 16), space)
    block = 32
    assert wl.params["block_tokens"] == block
    blocks: dict[int, tuple[int, ...]] = {}
    for r in wl.requests:
        for k, h in enumerate(r.prefix_ids):
            chunk = r.prompt[k * block : (k + 1) * block]
            if len(chunk) < block:  # the last, partial block: must be a prefix of the full one
                if h in blocks:
                    assert blocks[h][: len(chunk)] == chunk
                continue
            if h in blocks:
                assert blocks[h] == chunk, f"hash {h} gave two different blocks"
            blocks[h] = chunk
    distinct = list(blocks.items())
    assert len(distinct) > 50
    assert len({b for _, b in distinct}) == len(distinct), "two hash ids gave the same block"
    # requests sharing a leading run of hash ids share exactly that token prefix
    shared = 0
    for a, b in itertools.combinations(wl.requests, 2):
        run = 0
        while (
            run < min(len(a.prefix_ids), len(b.prefix_ids))
            and a.prefix_ids[run] == b.prefix_ids[run]
        ):
            run += 1
        if run and len(a.prompt) >= run * block and len(b.prompt) >= run * block:
            assert a.prompt[: run * block] == b.prompt[: run * block]
            shared += 1
    assert shared > 0


def test_mooncake_time_and_length_scale(space: TokenSpace) -> None:
    base = workloads.build(WorkloadSpec(name="mooncake", num_requests=40, time_scale=1.0), space)
    slow = workloads.build(WorkloadSpec(name="mooncake", num_requests=40, time_scale=2.5), space)
    assert slow.duration_s == pytest.approx(2.5 * base.duration_s)
    rated = workloads.build(WorkloadSpec(name="mooncake", num_requests=40, request_rate=0.5), space)
    assert rated.offered_rate == pytest.approx(0.5)
    rows = [r for r in base.requests if r.prompt_len < 4000 - r.max_tokens]
    assert all(
        r.prompt_len + r.max_tokens <= 4096 - workloads.CONTEXT_MARGIN for r in base.requests
    )
    assert rows and rows[0].prompt_len == round(6758 / 16) and rows[0].max_tokens == round(500 / 16)


def test_generators(space: TokenSpace) -> None:
    sp = workloads.build(
        WorkloadSpec(
            name="shared-prefix",
            num_requests=12,
            num_groups=3,
            system_len=200,
            input_len=20,
            request_rate=2.0,
        ),
        space,
    )
    by_group: dict[str, set[tuple[int, ...]]] = {}
    for r in sp.requests:
        by_group.setdefault(r.group, set()).add(r.prompt[:200])
        assert r.prompt_len == 220
    assert len(by_group) == 3 and all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3
    mixed = workloads.build(
        WorkloadSpec(name="mixed", num_requests=40, input_len=256, output_len=32), space
    )
    assert {r.group for r in mixed.requests} == {"short-in/long-out", "long-in/short-out"}
    bursty = workloads.build(
        WorkloadSpec(name="bursty", num_requests=60, request_rate=2.0, burst_on_s=2, burst_off_s=3),
        space,
    )
    assert all((r.arrival_s % 5.0) < 2.0 + 1e-9 for r in bursty.requests)
    assert (
        max(b.arrival_s - a.arrival_s for a, b in zip(bursty.requests, bursty.requests[1:])) >= 3.0
    )
    lc = workloads.build(WorkloadSpec(name="long-context", num_requests=5, output_len=16), space)
    assert all(0.6 * 4096 < r.prompt_len <= 4096 - 16 for r in lc.requests)
    az = workloads.build(WorkloadSpec(name="azure", num_requests=20, length_scale=0.25), space)
    assert az.requests[0].prompt_len == round(374 * 0.25) and az.duration_s > 0


def test_unknown_names_list_the_valid_ones(space: TokenSpace) -> None:
    with pytest.raises(workloads.WorkloadError, match="known: .*mooncake"):
        workloads.build(WorkloadSpec(name="nope"), space)
    with pytest.raises(configs.ConfigError, match="known: ours"):
        configs.get("nope")


def test_fair_resources_in_every_plan() -> None:
    res = configs.Resources(
        model_path="tiny", num_prefill=2, num_decode=1, omp_threads=1, kv_tokens_total=30000
    )
    for name in configs.DEFAULT_CONFIGS:
        plan = configs.get(name).plan(res)
        assert len(plan.workers) == 3, name
        assert plan.env["OMP_NUM_THREADS"] == "1"
        for w in plan.workers:
            argv = list(w.argv)
            assert (
                argv[argv.index("--max-total-tokens", argv.index("--enable-metrics")) + 1]
                == "10000"
            ), name


def test_metrics_and_results_writer(tmp_path: Path) -> None:
    def rec(rid: int, ttft: float, ok: bool = True) -> client.RequestRecord:
        chunks = ((1.0 + ttft, 1), (1.0 + ttft + 0.1, 1), (1.0 + ttft + 0.2, 2)) if ok else ()
        return client.RequestRecord(
            rid=rid,
            group="",
            prompt_len=10,
            max_tokens=4,
            scheduled_s=1.0,
            send_s=1.0,
            first_token_s=1.0 + ttft if ok else None,
            end_s=1.0 + ttft + 0.2,
            chunks=chunks,
            output_tokens=4 if ok else 0,
            cached_tokens=5 if ok else None,
            server_prompt_tokens=10,
            ok=ok,
            error="" if ok else "HTTP 400: bad",
        )

    recs = [rec(0, 0.1), rec(1, 0.2), rec(2, 0.3), rec(3, 0.4, ok=False)]
    assert recs[0].itls == pytest.approx([0.1, 0.1, 0.0])
    s = metrics.summarize(recs, metrics.SLO(ttft_s=0.25))
    assert (s.ok, s.errors, s.error_kinds) == (3, 1, {"HTTP 400": 1})
    assert s.ttft.p50 == pytest.approx(0.2) and s.goodput_frac == pytest.approx(0.5)
    assert s.prefix_hit_rate == pytest.approx(0.5)
    md = tmp_path / "RESULTS.md"
    results.write_results_section("x", "X", "first", md)
    results.write_results_section("y", "Y", "other", md)
    results.write_results_section("x", "X", "second", md)
    text = md.read_text()
    assert "second" in text and "first" not in text and "other" in text
    assert client.parse_metrics(
        'sglang:num_running_reqs{a="1"} 3.0\nsglang:num_running_reqs{a="2"} 1\n# x\n'
    ) == {"sglang:num_running_reqs": 4.0}
