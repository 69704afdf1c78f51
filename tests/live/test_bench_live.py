"""The benchmark replay client against a real SGLang server: it records every
event in order, keeps the trace's schedule (open loop), and counts errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import client, metrics, workloads
from bench.workloads import Request, TokenSpace, WorkloadSpec


@pytest.fixture(scope="module")
def space(tiny_model: Path) -> TokenSpace:
    return TokenSpace.from_model(tiny_model)


def _cfg(url: str, tiny_model: Path, space: TokenSpace, **kw) -> client.ClientConfig:
    return client.ClientConfig(url, tiny_model.name, space=space, progress=False, **kw)


@pytest.mark.slow
def test_replay_records_every_event_in_order(
    single_server: str, tiny_model: Path, space: TokenSpace
) -> None:
    wl = workloads.build(
        WorkloadSpec(
            name="shared-prefix",
            num_requests=6,
            num_groups=2,
            system_len=96,
            input_len=16,
            output_len=6,
            request_rate=8.0,
            seed=3,
        ),
        space,
    )
    recs = client.replay(_cfg(single_server, tiny_model, space), wl)
    assert [r.rid for r in recs] == [r.rid for r in wl.requests]
    for r, req in zip(recs, sorted(wl.requests, key=lambda q: q.rid)):
        assert r.ok, r.error
        assert r.output_tokens == req.max_tokens == 6
        assert sum(n for _, n in r.chunks) == 6
        times = [t for t, _ in r.chunks]
        assert r.send_s <= r.first_token_s == times[0]
        assert times == sorted(times) and times[-1] <= r.end_s
        assert len(r.itls) == 5 and r.tpot is not None
        assert r.prompt_len == 112
        assert r.server_prompt_tokens == r.prompt_len  # the text tokenized back to exactly our ids
    s = metrics.summarize(recs)
    assert s.ok == 6 and s.errors == 0 and s.ttft.n == 6
    as_ids = client.replay(
        _cfg(single_server, tiny_model, space, prompt_mode="ids"), wl.requests[:2]
    )
    assert all(r.ok and r.server_prompt_tokens == 112 for r in as_ids)


@pytest.mark.slow
def test_replay_keeps_the_trace_schedule(
    single_server: str, tiny_model: Path, space: TokenSpace
) -> None:
    # Mooncake rows 0-29 arrive at 0, 3, 6, 9 s of trace time; x0.25 -> within 2.25 s.
    wl = workloads.build(
        WorkloadSpec(
            name="mooncake",
            num_requests=30,
            time_scale=0.25,
            length_scale=1 / 128,
            output_scale=1 / 256,
        ),
        space,
    )
    assert wl.duration_s == pytest.approx(2.25)
    recs = client.replay(_cfg(single_server, tiny_model, space), wl)
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok]
    lags = [r.send_s - r.scheduled_s for r in recs]
    assert min(lags) >= -0.01 and max(lags) < 0.25, (
        lags
    )  # open loop: sent on time, not after the previous
    assert max(r.send_s for r in recs) >= 2.25 - 0.01


@pytest.mark.slow
def test_replay_counts_errors(single_server: str, tiny_model: Path, space: TokenSpace) -> None:
    good = workloads.block_tokens(0, "ok", 16, space)
    reqs = [
        Request(rid=0, arrival_s=0.0, prompt=good, max_tokens=3),
        Request(rid=1, arrival_s=0.0, prompt=good, max_tokens=0),  # invalid max_tokens
        Request(
            rid=2,
            arrival_s=0.05,
            prompt=workloads.block_tokens(0, "long", 5000, space),
            max_tokens=3,
        ),
        Request(rid=3, arrival_s=0.1, prompt=good, max_tokens=3),
    ]
    recs = client.replay(_cfg(single_server, tiny_model, space), reqs)
    assert len(recs) == 4
    assert [r.ok for r in recs] == [True, False, False, True]
    assert all(r.error and r.first_token_s is None for r in recs if not r.ok)
    s = metrics.summarize(recs)
    assert (s.requests, s.ok, s.errors) == (4, 2, 2)
    bad_model = client.replay(
        client.ClientConfig(
            single_server.rsplit(":", 1)[0] + ":1", "x", space=space, progress=False, timeout_s=5
        ),
        reqs[:1],
    )
    assert (
        not bad_model[0].ok and "Error" in bad_model[0].error and not math.isnan(bad_model[0].e2e)
    )
