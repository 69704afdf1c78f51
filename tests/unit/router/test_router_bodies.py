"""No input makes the router answer 5xx or hang: property-based bodies (hypothesis)
against a live router (real HTTP on 127.0.0.1) in front of fake PD workers.

Every body at ``/v1/completions``, ``/v1/chat/completions`` and ``/generate`` (wrong
types, nesting, huge integers, odd unicode, lists where scalars go and back) gets a
status below 500; a refusal is a JSON error in OpenAI's format that names what was
wrong. The named classes seen before (``"prompt": [1, "a"]``, ``"input_ids": 5``,
``"n": 2`` hanging) are pinned as examples.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bana_sglang.router.config import RouterConfig
from bana_sglang.router.server import Router
from bench.fake_pd import MODEL, FakeWorker, free_port

ODD = st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e", "\ufeff", "é" * 3, "🙂", ""])
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    ODD,
)
VALUE = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
TOKENS = st.lists(st.integers(0, 1000), min_size=1, max_size=6)


def body_of(fields: dict) -> st.SearchStrategy:
    """A body whose known fields take either a plausible value or anything at all."""
    return st.fixed_dictionaries(
        {}, optional={k: st.one_of(good, VALUE) for k, good in fields.items()}
    )


COMPLETIONS = body_of(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(st.text(max_size=20), TOKENS, st.lists(TOKENS, max_size=2)),
        "max_tokens": st.integers(1, 8),
        "stream": st.booleans(),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 10),
        "logprobs": st.integers(0, 3),
        "echo": st.booleans(),
        "stream_options": st.just({"include_usage": True}),
    }
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
)
CHAT = body_of(
    {
        "model": st.just(MODEL),
        "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "max_tokens": st.integers(1, 8),
        "max_completion_tokens": st.integers(1, 8),
        "stream": st.booleans(),
        "n": st.integers(1, 3),
        "logprobs": st.booleans(),
    }
)
GENERATE = body_of(
    {
        "text": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3)),
        "input_ids": st.one_of(TOKENS, st.lists(TOKENS, max_size=3)),
        "sampling_params": st.fixed_dictionaries(
            {}, optional={"max_new_tokens": st.integers(0, 8), "temperature": VALUE}
        ),
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "logprob_start_len": st.integers(-1, 5),
        "rid": st.text(max_size=8),
    }
)


@pytest.fixture(scope="module")
def router_url():
    """A router and one fake prefill and decode worker on a loop of their own."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port = free_port()
    box: dict = {}

    async def start() -> None:
        fakes = [FakeWorker("prefill", chunks=2), FakeWorker("decode", chunks=2)]
        for f in fakes:
            await f.start()
        router = Router(
            RouterConfig(
                prefill=((fakes[0].url, fakes[0].boot),),
                decode=(fakes[1].url,),
                port=port,
                poll_interval_s=0.05,
                max_tokens_limit=64,
                max_body_bytes=1 << 20,
            )
        )
        runner = web.AppRunner(router.build_app())
        await runner.setup()
        await router.site(runner, "127.0.0.1", port).start()
        box.update(runner=runner, fakes=fakes)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(30)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):  # until it knows the model
        if httpx.get(url + "/health", timeout=5).status_code == 200:
            break
        threading.Event().wait(0.05)
    yield url

    async def stop() -> None:
        await box["runner"].cleanup()
        for f in box["fakes"]:
            await f.stop()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)


def send(url: str, path: str, body) -> httpx.Response:
    raw = json.dumps(body, ensure_ascii=True)  # huge ints and lone surrogates as JSON allows
    return httpx.post(
        url + path, content=raw, headers={"content-type": "application/json"}, timeout=20
    )


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"]


SETTINGS = settings(
    max_examples=int(os.environ.get("ROUTER_FUZZ_EXAMPLES", "150")),
    derandomize="ROUTER_FUZZ_EXAMPLES" not in os.environ,  # CI: the same bodies every run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(body=st.one_of(COMPLETIONS, VALUE))
@example(body={"prompt": [1, "a"]})
@example(body={"prompt": [[1, 2], [3, "x"]]})
@example(body={"prompt": "hi", "n": 2, "max_tokens": 2})
@example(body={"prompt": "hi", "stream": "yes"})
@example(body={"prompt": "hi", "max_tokens": 2**70})
def test_completions_never_5xx(router_url, body):
    check(send(router_url, "/v1/completions", body))


@SETTINGS
@given(body=st.one_of(CHAT, VALUE))
@example(body={"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
@example(body={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2})
def test_chat_never_5xx(router_url, body):
    check(send(router_url, "/v1/chat/completions", body))


@SETTINGS
@given(body=st.one_of(GENERATE, VALUE))
@example(body={"input_ids": 5})
@example(body={"input_ids": []})
@example(body={"input_ids": [[1], [2, "a"]]})
@example(body={"text": "hi", "sampling_params": {"max_new_tokens": "3"}})
@example(body={"text": "hi", "logprob_start_len": "x", "return_logprob": True})
def test_generate_never_5xx(router_url, body):
    check(send(router_url, "/generate", body))


def test_n_choices_are_numbered_and_n_with_a_prompt_list_is_refused_by_name(router_url):
    r = send(router_url, "/v1/completions", {"prompt": "hi", "n": 3, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = send(router_url, "/v1/completions", {"prompt": "hi", "n": 2, "stream": True})
    assert r.status_code == 200 and r.text.count("data: [DONE]") == 1, r.text
    r = send(router_url, "/v1/completions", {"prompt": ["a", "b"], "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    for bad, field in (
        ({"prompt": [1, "a"]}, "prompt[1]"),
        ({"prompt": "x", "n": 0}, "'n'"),
        ({"prompt": "x", "stream": 1}, "'stream'"),
    ):
        r = send(router_url, "/v1/completions", bad)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    r = send(router_url, "/generate", {"input_ids": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
