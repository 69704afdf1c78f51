"""One very large request body never stalls the router's other streams.

The router tokenizes a prompt to route it. A 16 MiB prompt took the tiny model's
tokenizer about 16 s, and ``Tokenizer.encode`` holds the GIL all along, so running
it in a thread alone still froze the event loop for that long. These tests stream answers through the
router (fake PD workers, real HTTP) while one body at the size limit arrives, and
measure the longest pause between the other streams' chunks.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from support.fake_router import run, running

from bana_sglang.router.requests import PromptView
from bench.fake_pd import MODEL, FakeWorker

CHUNK_DELAY_S = 0.02
STREAMS = 6
#: the longest pause between two chunks of a stream that the big body may cause; the
#: chunks come every 20 ms and tokenizing the body on the loop took about 16 s here
MAX_PAUSE_S = 1.0


def _big_text(nbytes: int) -> str:
    words = "the quick brown fox jumps over the lazy dog while routers route "
    return (words * (nbytes // len(words) + 1))[:nbytes]


def test_a_long_text_is_tokenized_with_the_gil_released(tiny_model: Path):
    view = PromptView(tiny_model)
    text = _big_text(1 << 20)
    assert view.count_and_ids(text, 1 << 30) == (view.tokens(text), len(view.tokens(text)))
    exact = len(view.tokens(text))
    # over the limit: the exact count only
    assert view.count_and_ids(text, exact - 1) == ([], exact)
    # far over it (more characters than the limit's tokens can hold): not tokenized at all
    assert view.count_and_ids(text, 10) == ([], len(text) // 4)

    ticks, done = [], threading.Event()
    worker = threading.Thread(target=lambda: (view.count_and_ids(text, 1 << 30), done.set()))
    worker.start()
    last = time.perf_counter()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        ticks.append(now - last)
        last = now
    worker.join()
    # this thread kept running: many ticks, none longer than a few GIL switch intervals
    assert len(ticks) > 20, f"the tokenizer held the GIL: {len(ticks)} ticks"
    assert max(ticks) < 0.3, f"longest pause {max(ticks):.3f} s"


def test_byte_estimate_counts_without_ids_past_the_limit():
    view = PromptView()  # no tokenizer: 4 bytes a token
    assert view.count_and_ids("x" * 40, 100) == (view.tokens("x" * 40), 10)
    assert view.count_and_ids("x" * 41, 5) == ([], 11)


async def _stream_pauses(client, body: dict) -> tuple[float, list[int]]:
    """Longest pause between chunks of one streamed answer, and the chunks' numbers."""
    pauses, got = [], []
    async with client.post("/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        last = None
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                pauses.append(now - last)
            last = now
            got.append(json.loads(line[6:])["i"])
    return max(pauses), got


@pytest.mark.parametrize(
    ("endpoint", "nbytes"),
    [
        ("/v1/completions", None),  # the body limit: too long to tokenize, routed by its size
        ("/generate", 2 << 20),  # tokenized (about 2 s here) in a thread, the GIL released
    ],
)
def test_a_huge_prompt_does_not_stall_other_streams(
    tiny_model: Path, endpoint: str, nbytes: int | None
):
    async def go():
        prefill = [FakeWorker("prefill")]
        decode = [FakeWorker("decode", chunks=60, chunk_delay_s=CHUNK_DELAY_S)]
        async with running(prefill, decode, tokenizer_path=str(tiny_model)) as (router, client):
            small = {"model": MODEL, "prompt": "hello there", "stream": True, "max_tokens": 60}
            streams = [asyncio.create_task(_stream_pauses(client, small)) for _ in range(STREAMS)]
            await asyncio.sleep(10 * CHUNK_DELAY_S)  # the streams are flowing
            # by default just under the body limit, once wrapped in JSON
            text = _big_text(nbytes or router.cfg.max_body_bytes - 1024)
            big = (
                {"model": MODEL, "prompt": text, "max_tokens": 1}
                if endpoint == "/v1/completions"
                else {"text": text, "sampling_params": {"max_new_tokens": 1}}
            )
            t0 = time.perf_counter()
            async with client.post(endpoint, json=big) as r:
                status = r.status
                await r.read()
            big_s = time.perf_counter() - t0
            results = await asyncio.gather(*streams)
            return status, big_s, results

    status, big_s, results = run(go(), timeout=120)
    assert status == 200
    worst = max(p for p, _ in results)
    assert all(got == list(range(60)) for _, got in results)  # every chunk, in order
    # the big request took far longer than any pause it caused the others
    assert worst < MAX_PAUSE_S, (
        f"a stream paused {worst:.2f} s while a {big_s:.1f} s body was routed"
    )
