"""The router against fake PD workers (fast, in one process, real HTTP on 127.0.0.1).

The fakes (``bench.fake_pd``) mimic the PD contract that matters to a router:
the decode worker answers only once the prefill worker with the same
``bootstrap_room`` has run (so a router that does not cancel decode after a
prefill failure hangs), and a fake can refuse connections, answer 5xx, or break
a stream half way. The real workers are exercised in ``test_router_live.py``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support.fake_router import run, running

from bana_sglang.router.bodies import chat_messages
from bana_sglang.router.requests import BadRequest, PromptView, check_max_tokens
from bana_sglang.router.workers import Reported, Worker, parse_prefill_spec
from bana_sglang.types import Tier, WorkerId, WorkerLoad
from bench.fake_pd import MODEL, FakeWorker

# ---------------------------------------------------------------- pure helpers


def test_check_max_tokens():
    assert check_max_tokens(None, name="m", limit=10, allow_zero=False) is None
    assert check_max_tokens(0, name="m", limit=10, allow_zero=True) == 0
    for bad in (-1, 0, 11, 1.5, "3", True):
        with pytest.raises(BadRequest) as e:
            check_max_tokens(bad, name="max_tokens", limit=10, allow_zero=False)
        assert e.value.status == 400 and "max_tokens" in e.value.message


def test_prompt_view_hashes_are_chained_and_prefix_stable():
    v = PromptView(page_tokens=4)
    a = v.page_hashes(list(range(12)))
    b = v.page_hashes(list(range(8)) + [99, 98, 97, 96])
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert v.page_hashes([1, 2, 3]) == ()  # no full page
    assert len(v.tokens("x" * 40)) == 10  # byte estimate without a tokenizer


def test_without_a_tokenizer_each_four_bytes_of_a_text_are_one_little_endian_id():
    v = PromptView(page_tokens=4)
    for text in ["", "a", "abcd", "abcde", "h\u00e9llo \u2603 \udc80", "x" * 1001]:
        b = text.encode("utf-8", "surrogatepass")
        want = [int.from_bytes(b[i : i + 4], "little") for i in range(0, len(b), 4)]
        assert v.tokens(text) == want, text


def test_chat_messages_rejects_bad_messages():
    assert chat_messages([{"role": "user", "content": "hi"}]).startswith("hi")
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert chat_messages([{"role": "user", "content": parts}]).startswith("a")
    for bad in (
        None,
        [],
        ["x"],
        "text",
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
        [{"role": "user", "content": ["plain string part"]}],
    ):
        with pytest.raises(BadRequest, match="messages"):
            chat_messages(bad)


def test_worker_load_takes_the_larger_of_report_and_own_count():
    w = Worker("http://127.0.0.1:1", Tier.PREFILL, bootstrap_port=2)
    w.reported = Reported.from_loads_json(
        {
            "loads": [
                {
                    "num_running_reqs": 1,
                    "num_waiting_reqs": 2,
                    "num_waiting_uncached_tokens": 50,
                    "num_used_tokens": 10,
                    "max_total_num_tokens": 100,
                }
            ]
        },
        at=1.0,
    )
    assert w.load().num_requests == 3 and w.load().queued_prefill_tokens == 50
    for _ in range(5):
        w.begin(100)  # a burst the last poll has not seen
    assert w.load().num_requests == 5 and w.load().queued_prefill_tokens == 500
    with pytest.raises(ValueError):
        Reported.from_loads_json({"nope": 1}, at=0)


def test_decode_load_reports_its_step_time_from_the_generation_rate():
    """SGLang's /v1/loads gives running requests and generated tokens/s (per DP rank):
    their ratio is the step time the balancer's TPOT guard reads; unknown is 0."""
    d = Worker("http://127.0.0.1:1", Tier.DECODE)
    d.reported = Reported.from_loads_json(
        {
            "loads": [
                {"num_running_reqs": 6, "gen_throughput": 150.0, "max_total_num_tokens": 100},
                {"num_running_reqs": 2, "gen_throughput": 50.0, "max_total_num_tokens": 100},
            ]
        },
        at=1.0,
    )
    assert d.load().decode_step_s == pytest.approx(8 / 200)
    d.reported = Reported.from_loads_json(
        {"loads": [{"num_running_reqs": 0, "gen_throughput": 0.0}]}, at=2.0
    )
    assert d.load().decode_step_s == 0.0
    p = Worker("http://127.0.0.1:2", Tier.PREFILL, bootstrap_port=3)
    p.reported = Reported.from_loads_json(
        {"loads": [{"num_running_reqs": 3, "gen_throughput": 30.0}]}, at=1.0
    )
    assert p.load().decode_step_s == 0.0  # a prefill worker's "generation" is its first tokens
    with pytest.raises(ValueError, match="decode_step_s"):
        WorkerLoad(WorkerId("x"), Tier.DECODE, decode_step_s=-1.0)


def test_decode_load_reports_the_kv_of_requests_waiting_for_its_memory():
    """SGLang's num_total_tokens is the used tokens plus, on a decode worker, the
    tokens of its prealloc and retracted queues (requests waiting for memory): their
    difference, summed over DP ranks, is kv_waiting_tokens; the router's own in-flight
    count (which includes resident requests) does not enter it."""
    d = Worker("http://127.0.0.1:1", Tier.DECODE)
    d.reported = Reported.from_loads_json(
        {
            "loads": [
                {"num_used_tokens": 90, "num_total_tokens": 130, "max_total_num_tokens": 100},
                {"num_used_tokens": 50, "num_total_tokens": 50, "max_total_num_tokens": 100},
            ]
        },
        at=1.0,
    )
    d.begin(500)
    load = d.load()
    assert (
        load.kv_waiting_tokens == 40 and load.kv_used_tokens == 140 and load.kv_total_tokens == 200
    )
    assert load.inflight_tokens == 500
    d.reported = Reported.from_loads_json(
        {"loads": [{"num_used_tokens": 10, "max_total_num_tokens": 100}]}, at=2.0
    )
    assert d.load().kv_waiting_tokens == 0  # an answer without the field: nothing known to wait
    p = Worker("http://127.0.0.1:2", Tier.PREFILL, bootstrap_port=3)
    p.reported = Reported.from_loads_json(
        {"loads": [{"num_used_tokens": 10, "num_total_tokens": 400, "max_total_num_tokens": 100}]},
        at=1.0,
    )
    assert p.load().kv_waiting_tokens == 0  # a prefill worker's waiting prompts are its queue
    with pytest.raises(ValueError, match="kv_waiting_tokens"):
        WorkerLoad(WorkerId("x"), Tier.DECODE, kv_waiting_tokens=-1)


def test_worker_backoff_doubles_and_resets():
    w = Worker("http://127.0.0.1:1", Tier.DECODE, probe_min_s=1, probe_max_s=4)
    assert w.mark_down("x", now=0) and w.next_probe == 1
    assert not w.mark_down("x", now=0) and w.next_probe == 2
    w.mark_down("x", now=0)
    w.mark_down("x", now=0)
    assert w.next_probe == 4  # capped
    w.mark_up()
    assert w.healthy and w.failures == 0


def test_bad_worker_specs_are_named():
    with pytest.raises(ValueError, match="bootstrap"):
        parse_prefill_spec(["http://h:1", "x"])
    with pytest.raises(ValueError, match="HOST:PORT"):
        Worker("localhost", Tier.DECODE)


# ---------------------------------------------------------------- router over fakes


def test_pd_pairing_injects_one_room_for_both_and_accepts_missing_model():
    async def go():
        p, d = FakeWorker("prefill"), FakeWorker("decode")
        async with running([p], [d]) as (router, c):
            async with c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
            (pb,), (db,) = p.bodies, d.bodies
            assert pb["bootstrap_room"] == db["bootstrap_room"]
            assert pb["bootstrap_host"] == "127.0.0.1" and pb["bootstrap_port"] == p.boot
            assert db["model"] == MODEL  # filled in
            async with c.post("/v1/completions", json={"model": "other", "prompt": "a"}) as r:
                assert r.status == 404
                err = (await r.json())["error"]
                assert err["code"] == "model_not_found" and "other" in err["message"]

    run(go())


def test_refused_and_5xx_prefill_workers_are_retried_elsewhere_and_marked_down():
    async def go():
        bad1, bad2 = FakeWorker("prefill", "refuse"), FakeWorker("prefill", "error500")
        good, d = FakeWorker("prefill"), FakeWorker("decode")
        async with running([bad1, bad2, good], [d], policy="round_robin") as (router, c):
            for i in range(6):
                async with c.post(
                    "/generate", json={"text": f"q {i}", "sampling_params": {"max_new_tokens": 2}}
                ) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["text"] == "decoded"
            state = {w.url: w for w in router.prefill}
            assert not state[bad1.url].healthy  # refuses: stays down (its probes fail)
            assert state[bad2.url].errors >= 1  # answers 500 (its /health is fine: readmitted)
            assert state[good.url].healthy and len(good.bodies) == 6
            text = router.metrics.render().decode()
            assert 'bana_router_retries_total{reason="prefill_failed"}' in text

    run(go())


def test_a_decode_that_reports_missing_kv_blames_the_prefill_and_stays_routable():
    """A prefill host cut off the network fails only at the connect timeout,
    but its decode peer answers 500 "KVTransferError" first: the prefill is
    blamed and the request retried on another pair, the (only) decode worker
    stays up, and no request fails."""

    async def go():
        gone, good = FakeWorker("prefill", "hang"), FakeWorker("prefill")
        d = FakeWorker("decode", kv_wait_s=0.3)
        async with running([gone, good], [d], policy="round_robin") as (router, c):
            for i in range(4):
                async with c.post(
                    "/generate", json={"text": f"q {i}", "sampling_params": {"max_new_tokens": 2}}
                ) as r:
                    assert r.status == 200, await r.text()
            state = {w.url: w for w in router.workers}
            assert state[d.url].healthy
            assert not state[gone.url].healthy
            assert "could not receive the KV" in state[gone.url].down_reason
            assert len(good.bodies) == 4

    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_store_load_is_retried_and_the_prefill_worker_stays_up(stream):
    """The only prefill worker answers 503 "External KV cache load failed" (a page
    lost or failing its MAC mid-load; it reported the page): the request is sent
    again and served, and the worker is not marked down."""

    async def go():
        p, d = FakeWorker("prefill", "store_load_503_once"), FakeWorker("decode", kv_wait_s=5)
        async with running([p], [d]) as (router, c):
            body = {"text": "q", "sampling_params": {"max_new_tokens": 2}, "stream": stream}
            async with c.post("/generate", json=body) as r:
                assert r.status == 200, await r.text()
                text = await r.text()
            assert ("[DONE]" in text) if stream else ("decoded" in text)
            assert len(p.bodies) == 2
            assert all(w.healthy for w in router.workers)
            assert (
                'bana_router_retries_total{reason="store_load_failed"} 1.0'
                in router.metrics.render().decode()
            )

    run(go())


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_streamed_prefill_abort_is_retried_not_left_waiting_for_kv(path):
    """SGLang answers a *streamed* request whose store load failed with 200 and an abort
    event (seen live with the storage process stopped: the decode worker then waited
    300 s for KV that never came). The router reads the abort in the prefill's answer,
    drops that decode half and retries: the client gets the answer at once, the worker
    stays up."""
    import asyncio

    async def go():
        p = FakeWorker("prefill", "stream_abort_once", ids=True)
        d = FakeWorker("decode", ids=True, kv_wait_s=60)
        async with running([p], [d]) as (router, c):
            if path == "/generate":
                body = {"input_ids": [4, 4, 2], "sampling_params": {"max_new_tokens": 3}}
            else:
                body = {"prompt": [4, 4, 2], "max_tokens": 3}
            async with c.post(path, json=dict(body, stream=True)) as r:
                assert r.status == 200
                text = await asyncio.wait_for(r.text(), 20)  # not the decode's 60 s
            assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text
            assert len(p.bodies) == 2 and len(d.bodies) == 2
            assert all(w.healthy for w in router.workers)
            assert (
                'bana_router_retries_total{reason="store_load_failed"} 1.0'
                in router.metrics.render().decode()
            )

    run(go())


def test_streamed_failures_are_read_from_whole_answers():
    from bana_sglang.router.errors import streamed_failure

    fr = {"type": "abort", "message": "External KV cache load failed", "status_code": 503}
    gen = b"data: " + json.dumps({"meta_info": {"finish_reason": fr}}).encode() + b"\n\n"
    assert streamed_failure(gen + b"data: [DONE]\n\n") == (503, "External KV cache load failed")
    err = {"error": {"message": "too long", "code": 400}}
    assert streamed_failure(b"data: " + json.dumps(err).encode() + b"\n\n") == (400, "too long")
    graceful = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
    assert streamed_failure(b"data: " + json.dumps(graceful).encode()) == (503, "aborted")
    ok = {"text": "abort", "meta_info": {"finish_reason": {"type": "length"}}}  # the word alone
    assert streamed_failure(b"data: " + json.dumps(ok).encode() + b"\n\n") is None
    assert streamed_failure(b'data: {"error": "not an object"}\n\n') is None


def test_a_request_whose_kv_host_died_is_recomputed_and_the_decode_worker_stays_up():
    """A decode worker answers 503 "KV blocks lost" (the peer holding pages of the
    request died, KV-block migration): the request is sent again (recomputed) and
    the decode worker, which is healthy, is not marked down."""

    async def go():
        p, d = FakeWorker("prefill"), FakeWorker("decode", "kv_lost_once")
        async with running([p], [d]) as (router, c):
            async with c.post(
                "/generate", json={"text": "q", "sampling_params": {"max_new_tokens": 2}}
            ) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["text"] == "decoded"
            assert len(d.bodies) == 2 and len(p.bodies) == 2  # sent twice, to the same pair
            assert all(w.healthy for w in router.workers)
            assert (
                'bana_router_retries_total{reason="kv_blocks_lost"} 1.0'
                in router.metrics.render().decode()
            )

    run(go())


def test_a_slow_load_answer_does_not_take_a_worker_out_of_routing(monkeypatch):
    """A busy CPU worker answers /v1/loads late: it stays routable (slow is not
    dead), and the other workers' snapshots keep coming (one poller per worker)."""
    from bana_sglang.router import monitor

    monkeypatch.setattr(monitor, "LOADS_TIMEOUT_S", 0.2)

    async def go():
        slow, fast, d = (
            FakeWorker("prefill", loads_delay_s=1.0),
            FakeWorker("prefill"),
            FakeWorker("decode"),
        )
        async with running([slow, fast], [d], policy="round_robin") as (router, c):
            await asyncio.sleep(0.6)  # several polls of the slow worker time out
            assert all(w.healthy for w in router.workers)
            for i in range(4):
                async with c.post(
                    "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2}
                ) as r:
                    assert r.status == 200
            assert len(slow.bodies) == 2 and len(fast.bodies) == 2
            assert fast.url in {w.url for w in router.prefill if w.reported.at > 0}  # not held up

    run(go())


def test_all_prefill_workers_failing_gives_502_not_a_hang():
    async def go():
        async with running([FakeWorker("prefill", "error500")], [FakeWorker("decode")]) as (
            router,
            c,
        ):
            async with c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 502
                assert "no worker pair" in (await r.json())["error"]["message"]

    run(go())


def test_upstream_connections_are_bounded_per_worker_and_requests_wait_for_one():
    async def go():
        prefill = [FakeWorker("prefill", prefill_delay_s=0.02)]
        decode = [FakeWorker("decode", chunks=5, chunk_delay_s=0.02)]
        async with running(prefill, decode, max_upstream_connections=2) as (_, client):

            async def one() -> list[bytes]:
                body = {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 5}
                async with client.post("/v1/completions", json=body) as r:
                    assert r.status == 200
                    return [ln async for ln in r.content if ln.startswith(b"data:")]

            got = await asyncio.gather(*(one() for _ in range(6)))
            return got, prefill[0].most_in_flight, decode[0].most_in_flight

    got, most_p, most_d = run(go())
    assert all(len(events) == 6 for events in got)  # 5 chunks and [DONE] each: none lost
    # two streams at a time reached each worker, and never more
    assert most_d == 2 and 1 <= most_p <= 2, (most_p, most_d)


def test_prompt_only_requests_skip_decode_and_logprob_windows_are_all_numbers():
    async def go():
        p, d = FakeWorker("prefill"), FakeWorker("decode")
        async with running([p], [d]) as (router, c):
            req = {
                "text": ["w1 w2 w3 w4 w5 w6", "w1 w2 w3 w4 w5 w6 w7"],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 3,
            }
            async with c.post("/generate", json=req) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
            assert not d.bodies
            assert [b["bootstrap_host"] for b in p.bodies] == ["2.2.2.2", "2.2.2.2"]
            assert all(b["logprob_start_len"] == 2 for b in p.bodies)
            for item, n in zip(out, (6, 7)):
                lps = item["meta_info"]["input_token_logprobs"]
                assert [e[1] for e in lps] == list(range(3, n))  # the asked window, in order
                assert all(isinstance(e[0], float) for e in lps)

    run(go())


def test_api_key_body_size_and_json_errors():
    async def go():
        async with running(
            [FakeWorker("prefill")],
            [FakeWorker("decode")],
            api_key="k3y",
            max_body_bytes=4096,
            max_tokens_limit=100,
        ) as (router, c):
            async with c.get("/v1/models") as r:
                assert r.status == 401
            async with c.get("/v1/models", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            h = {"Authorization": "Bearer k3y"}
            async with c.get("/v1/models", headers=h) as r:
                assert r.status == 200
            async with c.post("/v1/completions", data=b"{oops", headers=h) as r:
                assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
            async with c.post("/v1/completions", json={"prompt": "x" * 5000}, headers=h) as r:
                assert r.status == 413
            async with c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 101}, headers=h
            ) as r:
                assert (
                    r.status == 400 and "max-tokens-limit" in (await r.json())["error"]["message"]
                )
            async with c.post("/generate", json={"text": "x", "input_ids": [1]}, headers=h) as r:
                assert r.status == 400
            async with c.get("/metrics", headers=h) as r:
                assert (
                    'bana_router_requests_total{endpoint="completions",status="413"}'
                    in await r.text()
                )

    run(go())


def _status(worker: str, placement: list[tuple[int, int, str]], states: tuple[str, ...] = ()):
    from bana_sglang.wire import agent as m

    return m.StatusResult(
        id="s",
        worker=worker,
        role="prefill",
        num_layers=4,
        guest_bytes=0,
        placement=[m.Placement(start=a, stop=b, executor=e) for a, b, e in placement],
        migrations=[
            m.MigrationInfo(
                migration=f"m{i}",
                side="source",
                peer="x",
                start=2,
                stop=4,
                state=s,
                bytes_done=0,
                bytes_total=1,
                seconds=0.0,
            )
            for i, s in enumerate(states)
        ],
    )


def test_prefill_speeds_come_from_the_agents_placements_while_layers_are_away():
    """prefill-0's layers [2, 4) run on decode-0: the donor drains its queue twice as
    fast, decode-0 gives them the donor's busy share; the router's loads carry both,
    and once every placement is home again the loop sets 1.0 and goes idle."""
    from bana_sglang.router.admin import AdminAPI, layer_split_speeds
    from bana_sglang.types import split_speeds

    away = {
        "http://p0": _status("prefill-0", [(0, 2, "prefill-0"), (2, 4, "decode-0")], ("remote",)),
        "http://d0": _status("decode-0", [(0, 4, "decode-0")]),
        "http://p1": _status("prefill-1", [(0, 4, "prefill-1")]),
    }
    speeds = layer_split_speeds(away, {"http://p0": 0.6})
    assert speeds == pytest.approx(
        {"http://p0": 2.0, "http://d0": split_speeds(4, 2, 0.6)[1], "http://p1": 1.0}
    )
    assert speeds["http://d0"] == pytest.approx(0.4)
    # a peer whose agent did not answer is left out (it keeps 1.0); the donor is still known
    assert layer_split_speeds({"http://p0": away["http://p0"]}, {}) == {"http://p0": 2.0}
    # every layer away: counted as all but one, never an error that would stop the loop
    whole = {
        "http://p0": _status("prefill-0", [(0, 4, "decode-0")]),
        "http://d0": away["http://d0"],
    }
    assert layer_split_speeds(whole, {"http://p0": 1.0}) == pytest.approx(
        {"http://p0": 4.0, "http://d0": split_speeds(4, 3, 1.0)[1]}
    )

    admin = AdminAPI(())
    rounds = [
        away,
        {**away, "http://p0": _status("prefill-0", [(0, 4, "prefill-0")], ("recalling",))},
        {**away, "http://p0": _status("prefill-0", [(0, 4, "prefill-0")], ("home",))},
    ]
    calls, applied = [], []

    async def statuses():
        calls.append(1)
        return rounds[min(len(calls), len(rounds)) - 1]

    admin._statuses = statuses
    import bana_sglang.router.admin as admin_mod

    async def go():
        admin_mod.SPEED_REFRESH_S, saved = 0.01, admin_mod.SPEED_REFRESH_S
        task = asyncio.create_task(admin.speed_loop(lambda: {"http://p0": 0.6}, applied.append))
        try:
            await asyncio.sleep(0.1)
            assert not calls  # idle until a layer migration is started here
            admin.layers_out = True
            for _ in range(100):
                if not admin.layers_out:
                    break
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            admin_mod.SPEED_REFRESH_S = saved

    run(go())
    assert not admin.layers_out and len(calls) == 3  # away, recalling (still in flight), home
    assert applied[0]["http://p0"] == pytest.approx(2.0)
    assert applied[-1] == {"http://p0": 1.0, "http://d0": 1.0, "http://p1": 1.0}
    admin.close()


def test_the_router_raises_its_open_files_limit_within_the_hard_one():
    import resource

    from bana_sglang.router.__main__ import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_open_files_limit(1) == soft  # never lowered
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = soft + 1
        assert raise_open_files_limit(want) == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert raise_open_files_limit(1 << 40) <= hard or hard == resource.RLIM_INFINITY


def test_a_streamed_kv_transfer_abort_of_the_prefill_is_left_to_the_decode_side():
    """Seen live (a decode worker SIGKILLed, 1P2D): the prefill streamed "Prefill transfer
    failed ... KVTransferError" (500) for a request paired with the dead decode worker.
    Taken as the prefill's failure, it marked the only prefill worker down and the request
    got a 502; the decode half's own failure decides instead, as before."""
    from bana_sglang.router.upstream import prefill_stream_failure

    def ev(message: str, code: int = 500) -> bytes:
        fr = {"type": "abort", "message": message, "status_code": code}
        return b"data: " + json.dumps({"meta_info": {"finish_reason": fr}}).encode() + b"\n\n"

    transfer = "Prefill transfer failed for request rank=0 with exception KVTransferError(room=1)"
    assert prefill_stream_failure(ev(transfer)) is None
    assert prefill_stream_failure(ev("External KV cache load failed", 503)) == (
        503,
        "External KV cache load failed",
    )


def test_the_continuation_deadline_is_a_router_flag_and_must_be_positive():
    from bana_sglang.router.__main__ import build_parser, config_from_args

    base = ["--prefill", "http://127.0.0.1:1", "8998", "--decode", "http://127.0.0.1:2"]
    cfg = config_from_args(build_parser().parse_args(base))
    assert cfg.continuation_timeout_s == 30.0
    cfg = config_from_args(build_parser().parse_args([*base, "--continuation-timeout", "4.5"]))
    assert cfg.continuation_timeout_s == 4.5
    with pytest.raises(ValueError, match="continuation_timeout_s must be positive"):
        config_from_args(build_parser().parse_args([*base, "--continuation-timeout", "0"]))
