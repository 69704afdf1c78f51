"""The worker side of a chat stream's token ids (``bana_sglang.plugin.chat_ids``): the
hooks on SGLang's chat stream and tokenizer manager, over fakes of both. The live test
(``tests/live/test_request_migrate_live.py``) runs them in real SGLang workers."""

from __future__ import annotations

import asyncio
import json
import types

from bana_sglang.plugin.chat_ids import (
    HEADER,
    IdsSink,
    chat_stream_hook,
    generate_request_hook,
)


class FakeTokenizerManager:
    """Yields SGLang's output dicts: cumulative ids (or, ``incremental``, the new ones)."""

    def __init__(self, incremental: bool, outputs: list[list[int]], prompt: list[int]):
        self.incremental_streaming_output = incremental
        self.outputs, self.prompt = outputs, prompt

    async def generate_request(self, obj, request=None):
        for ids in self.outputs:
            out = {"output_ids": ids, "meta_info": {"completion_tokens": None}}
            if obj.return_prompt_token_ids:
                out["prompt_token_ids"] = self.prompt
            yield out


class FakeChat:
    """SGLang's chat handler: one SSE chunk per output dict, then [DONE]."""

    def __init__(self, tm):
        self.tokenizer_manager = tm

    async def stream(self, adapted, request, raw_request):
        gen = generate_request_hook(
            FakeTokenizerManager.generate_request, self.tokenizer_manager, adapted
        )
        async for content in gen:
            yield f"data: {json.dumps({'n': len(content['output_ids'])})}\n\n"
        yield "data: [DONE]\n\n"


def _run(hooked) -> list[str]:
    async def go():
        return [c async for c in hooked]

    return asyncio.run(go())


def _raw(headers: dict):
    return types.SimpleNamespace(headers=headers)


def _adapted():
    return types.SimpleNamespace(return_prompt_token_ids=False)


def _ids_events(chunks: list[str]) -> list[dict]:
    return [json.loads(c.split("data: ", 1)[1]) for c in chunks if c.startswith("event: bana_ids")]


def test_a_chat_stream_asked_for_ids_gets_them_before_each_chunk_and_the_prompt_once():
    tm = FakeTokenizerManager(False, [[5], [5, 6], [5, 6, 7]], prompt=[1, 2, 3])
    chat = FakeChat(tm)
    req = types.SimpleNamespace(n=1)
    chunks = _run(chat_stream_hook(FakeChat.stream, chat, _adapted(), req, _raw({HEADER: "1"})))
    assert _ids_events(chunks) == [
        {"prompt_ids": [1, 2, 3], "ids": [5]},
        {"ids": [6]},
        {"ids": [7]},
    ]
    # each ids event comes right before the chunk of its tokens; the stream is otherwise SGLang's
    plain = [c for c in chunks if not c.startswith("event:")]
    assert plain == [
        'data: {"n": 1}\n\n',
        'data: {"n": 2}\n\n',
        'data: {"n": 3}\n\n',
        "data: [DONE]\n\n",
    ]
    assert chunks[0].startswith("event: bana_ids") and chunks[1] == plain[0]


def test_incremental_output_counts_each_new_id_once_and_an_abort_repeat_is_capped():
    sink = IdsSink()
    sink.take({"output_ids": [4, 5], "meta_info": {"completion_tokens": 2}}, incremental=True)
    sink.take({"output_ids": [6], "meta_info": {"completion_tokens": 3}}, incremental=True)
    # an abort's last output repeats the last token: completion_tokens says how many are new
    sink.take({"output_ids": [6], "meta_info": {"completion_tokens": 3}}, incremental=True)
    sink.take({"output_ids": [9], "index": 1}, incremental=True)  # another choice: not ours
    assert json.loads(sink.event().split("data: ", 1)[1]) == {"ids": [4, 5, 6]}
    assert sink.event() is None


def test_without_the_header_nothing_changes():
    tm = FakeTokenizerManager(False, [[5], [5, 6]], prompt=[1])
    chat = FakeChat(tm)
    adapted = _adapted()
    chunks = _run(
        chat_stream_hook(FakeChat.stream, chat, adapted, types.SimpleNamespace(n=1), _raw({}))
    )
    assert not any(c.startswith("event:") for c in chunks) and len(chunks) == 3
    assert adapted.return_prompt_token_ids is False
    # n > 1 is never resumed: no ids either
    chunks = _run(
        chat_stream_hook(
            FakeChat.stream, chat, _adapted(), types.SimpleNamespace(n=2), _raw({HEADER: "1"})
        )
    )
    assert not any(c.startswith("event:") for c in chunks)
    # any other generate request goes straight to SGLang's generator
    gen = generate_request_hook(FakeTokenizerManager.generate_request, tm, _adapted())
    assert gen.__qualname__ == "FakeTokenizerManager.generate_request"
