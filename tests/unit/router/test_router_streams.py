"""Streams through the router over fake PD workers: relaying, a decode worker that dies
or aborts mid-answer (the stream resumes on another with the same tokens), a worker
that stops answering (stall watch), and ``n > 1`` streamed as one response. The fakes
are ``bench.fake_pd``'s; the helpers are ``tests/support/fake_router.py``'s."""

from __future__ import annotations

import json

import pytest
from support.fake_router import run, running

from bench.fake_pd import FakeWorker, fake_answer


def test_stream_is_relayed_and_a_mid_stream_failure_ends_with_an_error_event():
    async def go():
        async with running([FakeWorker("prefill")], [FakeWorker("decode")]) as (router, c):
            async with c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}
            ) as r:
                text = await r.text()
            assert text.count("data: {") == 4 and text.endswith("data: [DONE]\n\n")
        async with running([FakeWorker("prefill")], [FakeWorker("decode", "break_stream")]) as (
            router,
            c,
        ):
            async with c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}
            ) as r:
                assert r.status == 200
                text = await r.text()
            events = [
                json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")
            ]
            assert events[:2] == [{"i": 0}, {"i": 1}]
            assert "failed mid-stream" in events[-1]["error"]["message"]
            assert text.endswith("data: [DONE]\n\n")

    run(go())


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_stream_whose_decode_worker_dies_resumes_on_another_with_the_same_tokens():
    """The decode worker drops the connection after two tokens: the router resumes the
    stream on the other decode worker from the prompt and the answer so far, and the
    client reads one answer with exactly the tokens an unbroken run gives; the token
    ids the router asked for on its own are not shown to the client."""

    async def go():
        breaking = FakeWorker("decode", "break_stream", ids=True, chunks=8)
        ok = FakeWorker("decode", ids=True)
        async with running(
            [FakeWorker("prefill", ids=True)], [breaking, ok], policy="round_robin"
        ) as (router, c):
            prompt = [5, 17, 29, 41]
            want = fake_answer(prompt, 6)
            # /generate with input_ids, until the breaking worker has served one
            while not breaking.bodies:
                body = {"input_ids": prompt, "stream": True}
                body["sampling_params"] = {"max_new_tokens": 6}
                async with c.post("/generate", json=body) as r:
                    assert r.status == 200
                    events = _events(await r.text())
                assert events[-1]["output_ids"] == want, events
                assert "error" not in events[-1]
                assert "prompt_token_ids" not in events[-1]
            # /v1/completions with a text prompt: ids only from SGLang's events
            breaking.bodies.clear()
            next(w for w in router.decode if w.url == breaking.url).mark_up()
            text_want = fake_answer([1, *b"hello"], 5)
            while not breaking.bodies:
                body = {"prompt": "hello", "max_tokens": 5, "stream": True}
                async with c.post("/v1/completions", json=body) as r:
                    raw = await r.text()
                events = _events(raw)
                got = "".join(ch["text"] for e in events for ch in e.get("choices", []))
                assert got == "".join(f" {t}" for t in text_want), raw
                assert raw.endswith("data: [DONE]\n\n") and '"error"' not in raw
                assert "token_ids" not in raw  # asked for by the router, not by the client
            resumed = router.metrics.stream_resumes.labels("resumed")._value.get()
            assert resumed == 2
            # the continuations went to the healthy worker with prompt + answer so far
            cont = [b for b in ok.bodies if b.get("prompt") == [1, *b"hello", *text_want[:2]]]
            assert cont and cont[-1]["max_tokens"] == 3

    run(go())


def test_a_stream_its_decode_worker_aborts_before_a_token_is_resumed_not_relayed():
    """SGLang ends a request with an ``abort`` finish reason and no token (its KV
    transfer failed, or an abort by rid prefix reached it): relayed, the client would
    read an empty answer that looks finished. The router resumes the stream instead."""

    async def go():
        aborting = FakeWorker("decode", "abort_once", ids=True)
        async with running(
            [FakeWorker("prefill", ids=True)], [aborting, FakeWorker("decode", ids=True)]
        ) as (router, c):
            body = {
                "input_ids": [9, 8, 7],
                "stream": True,
                "sampling_params": {"max_new_tokens": 5},
            }
            while not aborting.bodies:
                async with c.post("/generate", json=body) as r:
                    events = _events(await r.text())
                assert events[-1]["output_ids"] == fake_answer([9, 8, 7], 5), events
            assert router.metrics.stream_resumes.labels("resumed")._value.get() == 1

    run(go())


def test_a_stream_whose_decode_worker_stops_answering_resumes_on_another():
    """A decode worker stops after two tokens, as a SIGSTOPped process does: its
    connections stay open but nothing comes, not on the stream, not on ``/v1/loads``,
    not on ``/health``. Once the stream and the worker have been silent for the
    stall timeout, the router marks the worker down and resumes the stream on the
    other worker: the client reads the unbroken run's tokens, long before the read
    timeout, and new requests avoid the stopped worker."""
    import asyncio

    async def go():
        frozen = FakeWorker("decode", "freeze_stream", ids=True, chunks=8)
        ok = FakeWorker("decode", ids=True)
        async with running(
            [FakeWorker("prefill", ids=True)],
            [frozen, ok],
            policy="round_robin",
            stall_timeout_s=0.5,
        ) as (router, c):
            prompt = [3, 1, 4, 1, 5]
            want = fake_answer(prompt, 6)
            body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 6}}

            async def one() -> list[dict]:
                async with c.post("/generate", json=body) as r:
                    assert r.status == 200
                    return _events(await r.text())

            while not frozen.bodies:  # the read timeout is 600 s: a held stream fails here
                events = await asyncio.wait_for(one(), 20)
                assert events[-1]["output_ids"] == want, events
                assert "error" not in events[-1]
            w = next(w for w in router.decode if w.url == frozen.url)
            assert not w.healthy and "hung or stopped" in w.down_reason, w.down_reason
            assert router.metrics.stalls.labels(frozen.url, "decode")._value.get() == 1
            assert router.metrics.stream_resumes.labels("resumed")._value.get() == 1
            assert [b.get("input_ids") for b in ok.bodies][-1] == prompt + want[:2]
            served = len(frozen.bodies)
            for _ in range(3):  # the stopped worker gets no new request
                events = await asyncio.wait_for(one(), 20)
                assert events[-1]["output_ids"] == want
            assert len(frozen.bodies) == served and not router._watched

    run(go())


def test_a_continuation_whose_pair_never_starts_is_opened_again_within_its_deadline():
    """A stream's decode worker dies after two tokens and its continuation's prefill half
    is taken in and never answered, while every worker still answers its polls (a PD
    handshake that never completes): the stall watch cannot call that a hung worker, so
    the continuation's deadline gives the pair up and opens it again (here on the same
    prefill worker, the only one, with a new bootstrap room). The client reads the
    unbroken run's tokens long before SGLang's 300 s timeout, and no worker is marked
    down for it."""
    import asyncio
    import time

    async def go():
        prefill = FakeWorker("prefill", ids=True, hang_nth=2)
        breaking = FakeWorker("decode", "break_stream", ids=True, chunks=8)
        ok = FakeWorker("decode", ids=True)
        async with running(
            [prefill], [breaking, ok], policy="round_robin", continuation_timeout_s=0.6
        ) as (router, c):
            prompt = [2, 7, 1, 8]
            want = fake_answer(prompt, 6)
            body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 6}}
            t0 = time.monotonic()
            async with c.post("/generate", json=body) as r:
                assert r.status == 200
                events = _events(await asyncio.wait_for(r.text(), 20))
            took = time.monotonic() - t0
            assert len(breaking.bodies) == 1, "round robin sends the first request to it"
            assert events[-1]["output_ids"] == want, events
            assert "error" not in events[-1]
            assert 0.6 <= took < 10, took  # the deadline passed once, then the retry served
            m = router.metrics
            assert m.retries.labels("continuation_timeout")._value.get() == 1
            assert m.stream_resumes.labels("resumed")._value.get() == 1
            # the hung try and the one that served: same prompt, fresh rooms
            first, hung, served = prefill.bodies
            assert hung["input_ids"] == served["input_ids"] == prompt + want[:2]
            assert (
                len({first["bootstrap_room"], hung["bootstrap_room"], served["bootstrap_room"]})
                == 3
            )
            assert all(w.healthy for w in router.prefill), "a slow pair is not a dead worker"
            assert m.stalls.labels(prefill.url, "prefill")._value.get() == 0
            assert not router._watched

    run(go())


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_request_on_a_worker_that_never_answers_is_retried_on_another(role, stream):
    """A worker is stopped before the request comes: it takes the connection and
    answers nothing, load polls and liveness probes included. A request whose decode
    half (no first byte) or prefill half (no answer) went to it is retried on another
    pair once the stall timeout has passed, streamed or not, and the worker is marked
    down."""
    import asyncio

    prompt = [6, 2, 8, 3]
    frozen = FakeWorker(role, "frozen", ids=True)
    pair = {
        "prefill": [FakeWorker("prefill", ids=True)],
        "decode": [FakeWorker("decode", ids=True)],
    }
    pair[role].append(frozen)  # second: the router learns the model from the first

    async def go():
        async with running(
            pair["prefill"], pair["decode"], policy="round_robin", stall_timeout_s=0.5
        ) as (router, c):
            while not frozen.bodies:
                body = {"input_ids": prompt, "stream": stream}
                body["sampling_params"] = {"max_new_tokens": 4}
                async with c.post("/generate", json=body) as r:
                    assert r.status == 200
                    raw = await asyncio.wait_for(r.text(), 20)  # the read timeout is 600 s
                got = _events(raw)[-1] if stream else json.loads(raw)
                # (the fakes answer a non-streamed request with ids 0..chunks-1)
                assert got["output_ids"] == (fake_answer(prompt, 4) if stream else [0, 1, 2, 3])
            w = next(w for w in router.workers if w.url == frozen.url)
            assert not w.healthy and "has not answered" in w.down_reason, w.down_reason
            assert router.metrics.stalls.labels(frozen.url, role)._value.get() == 1
            assert router.metrics.retries.labels(f"{role}_failed")._value.get() == 1
            assert not router._watched

    run(go())


def test_a_busy_prefill_worker_whose_http_server_answers_is_not_taken_for_stopped(monkeypatch):
    """Load polls time out (a CPU worker deep in a long forward answers them late) and
    the prefill takes longer than the stall timeout, but the worker's HTTP server
    answers the liveness probe: the request is left where it is."""
    import asyncio

    from bana_sglang.router import monitor

    monkeypatch.setattr(monitor, "LOADS_TIMEOUT_S", 0.2)
    monkeypatch.setattr(monitor, "LIVENESS_TIMEOUT_S", 0.5)

    async def go():
        busy = FakeWorker("prefill", ids=True, loads_delay_s=5.0, prefill_delay_s=2.0)
        async with running([busy], [FakeWorker("decode", ids=True)], stall_timeout_s=0.8) as (
            router,
            c,
        ):
            body = {"input_ids": [5, 5], "stream": True, "sampling_params": {"max_new_tokens": 2}}
            async with c.post("/generate", json=body) as r:
                raw = await asyncio.wait_for(r.text(), 20)
            assert _events(raw)[-1]["output_ids"] == fake_answer([5, 5], 2), raw
            assert len(busy.bodies) == 1 and router.prefill[0].healthy
            assert router.metrics.stalls.labels(busy.url, "prefill")._value.get() == 0

    run(go())


def test_a_slow_stream_from_a_worker_that_answers_is_not_cut():
    """Silence on a stream alone is not a stall: a decode worker whose tokens come
    slower than the stall timeout but that answers its load polls keeps the stream."""
    import asyncio

    async def go():
        slow = FakeWorker("decode", ids=True, chunk_delay_s=0.8)
        async with running([FakeWorker("prefill", ids=True)], [slow], stall_timeout_s=0.3) as (
            router,
            c,
        ):
            prompt = [2, 7, 1, 8]
            body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 3}}
            async with c.post("/generate", json=body) as r:
                events = _events(await asyncio.wait_for(r.text(), 20))
            assert events[-1]["output_ids"] == fake_answer(prompt, 3), events
            assert len(slow.bodies) == 1 and router.decode[0].healthy
            assert router.metrics.stalls.labels(slow.url, "decode")._value.get() == 0

    run(go())


def test_a_chat_stream_whose_decode_worker_dies_resumes_with_the_same_tokens():
    """A chat stream's ids come in the ``bana_ids`` events the router asks bana's workers
    for (SGLang streams none in a chat answer): its decode worker drops the connection
    after two tokens, and the client reads one chat answer with an unbroken run's tokens,
    no ids events; the continuation went to the healthy worker from the templated prompt
    plus the answer so far. A worker without the extension sends no ids: the stream cannot
    be resumed exactly and ends with an error event."""

    async def go():
        breaking = FakeWorker("decode", "break_stream", ids=True, chunks=8)
        ok = FakeWorker("decode", ids=True)
        async with running(
            [FakeWorker("prefill", ids=True)], [breaking, ok], policy="round_robin"
        ) as (router, c):
            prompt = [1, *b"hi"]  # the fakes' chat template
            want = "".join(f" {t}" for t in fake_answer(prompt, 6))
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            while not breaking.bodies:
                async with c.post("/v1/chat/completions", json=dict(body, max_tokens=6)) as r:
                    assert r.status == 200
                    raw = await r.text()
                events = _events(raw)
                got = "".join(ch["delta"].get("content", "") for e in events for ch in e["choices"])
                assert got == want, raw
                assert raw.endswith("data: [DONE]\n\n") and '"error"' not in raw
                assert "bana_ids" not in raw and "token_ids" not in raw
                assert all(e["object"] == "chat.completion.chunk" for e in events)
                assert len({e["id"] for e in events}) == 1
            assert router.metrics.stream_resumes.labels("resumed")._value.get() == 1
            cont = [b for b in ok.bodies if b.get("prompt") == [*prompt, *fake_answer(prompt, 2)]]
            assert cont and cont[-1]["max_tokens"] == 4
        async with running(
            [FakeWorker("prefill", ids=True)],
            [FakeWorker("decode", "break_stream", ids=True, chunks=8, chat_ids=False)],
        ) as (router, c):
            async with c.post("/v1/chat/completions", json=dict(body, max_tokens=6)) as r:
                raw = await r.text()
            assert "failed mid-stream" in _events(raw)[-1]["error"]["message"]
            assert router.metrics.stream_resumes.labels("not_resumable")._value.get() == 1

    run(go())


def test_a_streamed_n_gives_n_numbered_choices_in_one_stream():
    """``n: 3`` streamed: three PD requests of one choice (seed + i each), their events
    interleaved in one stream with choice indexes 0..2, one ``[DONE]``; a chat stream too."""

    async def go():
        decode = FakeWorker("decode", ids=True)
        async with running([FakeWorker("prefill", ids=True)], [decode]) as (router, c):
            body = {"prompt": [3, 4, 5], "max_tokens": 4, "stream": True, "n": 3, "seed": 7}
            async with c.post("/v1/completions", json=body) as r:
                assert r.status == 200
                raw = await r.text()
            assert raw.count("data: [DONE]") == 1 and raw.endswith("data: [DONE]\n\n")
            texts: dict[int, str] = {}
            for e in _events(raw):
                for ch in e["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            want = "".join(f" {t}" for t in fake_answer([3, 4, 5], 4))
            assert texts == {0: want, 1: want, 2: want}
            assert sorted(b["seed"] for b in decode.bodies) == [7, 8, 9]
            assert all(b["n"] == 1 for b in decode.bodies)
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}
            async with c.post("/v1/chat/completions", json=chat) as r:
                raw = await r.text()
            idx = {ch["index"] for e in _events(raw) for ch in e["choices"]}
            assert r.status == 200 and idx == {0, 1} and raw.count("data: [DONE]") == 1

    run(go())
