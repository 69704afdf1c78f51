"""Live request migration, fast parts: the router's splicer over SGLang's three
stream formats (fed the events SGLang 0.5.23 sends, split at awkward byte
boundaries), the continuation it builds, which requests are migratable, and
the worker side's choice of request. The real thing, on a live cluster, is in
``test_request_migrate_live.py``."""

from __future__ import annotations

import random
from types import SimpleNamespace

import orjson
import pytest

from bana_sglang.migrate.requests.handler import MIN_LEFT, pick, why_not_movable
from bana_sglang.router.splice import Splicer, mark, migratable, unmigratable_reason
from bana_sglang.wire.agent import MARK, PREFIX


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


def run(sp: Splicer, data: bytes, step: int = 7) -> list[dict | str]:
    """Feed ``data`` in ``step``-byte pieces; the client's events, parsed."""
    out = b""
    for i in range(0, len(data), step):
        out += b"".join(sp.feed(data[i : i + step]))
        if sp.migrated is not None:
            break
    return [
        e[6:].decode() if e.startswith(b"data: [") else orjson.loads(e[6:])
        for e in out.split(b"\n\n")
        if e
    ]


def gen_event(text, ids, done=None, prompt=5, rid="bana-m-1"):
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt,
            "completion_tokens": len(ids),
            "finish_reason": done,
        },
    }


def test_a_generate_stream_reads_as_one_answer_across_a_handoff():
    body = mark(
        {"input_ids": [1, 2, 3, 4, 5], "stream": True, "sampling_params": {"max_new_tokens": 10}},
        random.Random(0),
    )
    sp = Splicer("generate", body)
    first = (
        sse(gen_event("a", [10]))
        + sse(gen_event("ab", [10, 11]))
        + sse(gen_event("abc", [10, 11, 12], {"type": "abort", "matched": MARK + "m1"}))
        + sse(b"[DONE]")
    )
    seen = run(sp, first)
    assert [e["text"] for e in seen] == [
        "a",
        "ab",
    ]  # the handoff event is held back, [DONE] dropped
    assert sp.migrated == "m1"
    path, cont = sp.continuation([1, 2, 3, 4, 5], [10, 11, 12])
    assert path == "/generate" and cont["input_ids"] == [1, 2, 3, 4, 5, 10, 11, 12]
    assert cont["sampling_params"] == {"max_new_tokens": 7} and cont["rid"].startswith(PREFIX)
    # SGLang aborts by rid prefix: the continuation's rid must not extend the stopped one's
    assert not cont["rid"].startswith(body["rid"])
    assert "text" not in cont and sp.migrated is None
    second = (
        sse(gen_event("d", [13], prompt=8, rid="x"))
        + sse(
            gen_event("defg", [13, 14, 15, 16], {"type": "length", "length": 4}, prompt=8, rid="x")
        )
        + sse(b"[DONE]")
    )
    seen = run(sp, second, step=5)
    assert seen[-1] == "[DONE]"
    last = seen[-2]
    assert last["text"] == "abcdefg" and last["output_ids"] == [10, 11, 12, 13, 14, 15, 16]
    assert last["meta_info"]["id"] == "bana-m-1" and last["meta_info"]["prompt_tokens"] == 5
    assert (
        last["meta_info"]["completion_tokens"] == 7
        and last["meta_info"]["finish_reason"]["length"] == 7
    )


def test_a_chat_stream_continues_as_chat_chunks_with_the_first_id_and_whole_usage():
    body = mark(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 20,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            "tools": None,
        },
        random.Random(1),
    )
    sp = Splicer("chat", body)
    head = {"id": "bana-m-x", "created": 7, "model": "tiny", "object": "chat.completion.chunk"}

    def chunk(content=None, finish=None, matched=None):
        return {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": content},
                    "logprobs": None,
                    "finish_reason": finish,
                    "matched_stop": matched,
                }
            ],
        }

    first = (
        sse(chunk(""))
        + sse(chunk("Hel"))
        + sse(chunk("lo"))
        + sse(chunk(None, "abort", MARK + "m2"))
        + sse(
            {
                **head,
                "choices": [],
                "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
            }
        )
        + sse(b"[DONE]")
    )
    seen = run(sp, first, step=11)
    assert [c["choices"][0]["delta"]["content"] for c in seen] == [
        "",
        "Hel",
        "lo",
    ]  # the abort chunk is held
    path, cont = sp.continuation(list(range(9)), [50, 51, 52])
    assert path == "/v1/completions" and cont["prompt"] == list(range(9)) + [50, 51, 52]
    assert cont["max_tokens"] == 17 and cont["stream"] is True and cont["temperature"] == 0
    assert "messages" not in cont and "tools" not in cont
    comp = {"id": "other", "object": "text_completion", "created": 99, "model": "tiny"}
    second = (
        sse(
            {
                **comp,
                "choices": [
                    {
                        "index": 0,
                        "text": " world",
                        "logprobs": None,
                        "finish_reason": None,
                        "matched_stop": None,
                    }
                ],
            }
        )
        + sse(
            {
                **comp,
                "choices": [
                    {
                        "index": 0,
                        "text": "!",
                        "logprobs": None,
                        "finish_reason": "length",
                        "matched_stop": None,
                    }
                ],
            }
        )
        + sse(
            {
                **comp,
                "choices": [],
                "usage": {"prompt_tokens": 12, "completion_tokens": 17, "total_tokens": 29},
            }
        )
        + sse(b"[DONE]")
    )
    seen = run(sp, second, step=3)
    assert all(
        c["id"] == "bana-m-x" and c["created"] == 7 and c["object"] == "chat.completion.chunk"
        for c in seen[:-1]
    )
    assert "".join(c["choices"][0]["delta"]["content"] for c in seen[:2]) == " world!"
    assert seen[1]["choices"][0]["finish_reason"] == "length"
    assert seen[2]["usage"] == {"prompt_tokens": 9, "completion_tokens": 20, "total_tokens": 29}
    assert seen[3] == "[DONE]"


def test_a_completions_handoff_keeps_the_text_of_its_last_chunk():
    sp = Splicer(
        "completions", mark({"prompt": "x", "stream": True, "max_tokens": 8}, random.Random(2))
    )
    head = {"id": "c1", "object": "text_completion", "created": 3, "model": "tiny"}
    first = sse(
        {
            **head,
            "choices": [{"index": 0, "text": "ab", "finish_reason": None, "matched_stop": None}],
        }
    ) + sse(
        {
            **head,
            "choices": [
                {"index": 0, "text": "c", "finish_reason": "abort", "matched_stop": MARK + "m3"}
            ],
        }
    )
    seen = run(sp, first)
    assert [c["choices"][0]["text"] for c in seen] == ["ab", "c"]
    assert seen[1]["choices"][0]["finish_reason"] is None and sp.migrated == "m3"
    path, cont = sp.continuation([7, 8], [1, 2, 3])
    assert cont["max_tokens"] == 5 and cont["prompt"] == [7, 8, 1, 2, 3]


def test_a_request_can_move_twice():
    sp = Splicer(
        "generate",
        mark({"input_ids": [1], "stream": True, "sampling_params": {}}, random.Random(3)),
    )
    run(sp, sse(gen_event("a", [5], {"type": "abort", "matched": MARK + "m"}, prompt=1)))
    _, first = sp.continuation([1], [5])
    seen = run(sp, sse(gen_event("b", [6], {"type": "abort", "matched": MARK + "n"}, prompt=2)))
    assert seen == [] and sp.migrated == "n"
    path, cont = sp.continuation([1, 5], [6])
    assert cont["input_ids"] == [1, 5, 6] and cont["sampling_params"]["max_new_tokens"] == 128 - 2
    # every continuation has a rid of its own, none a prefix of another (SGLang aborts by prefix)
    rids = [sp.body["rid"], first["rid"], cont["rid"]]
    assert len(set(rids)) == 3 and not any(a != b and b.startswith(a) for a in rids for b in rids)
    (last,) = run(sp, sse(gen_event("c", [7], {"type": "stop"}, prompt=3)))
    assert (
        last["text"] == "abc"
        and last["output_ids"] == [5, 6, 7]
        and last["meta_info"]["completion_tokens"] == 3
    )


def test_error_events_and_foreign_lines_pass_through_untouched():
    sp = Splicer("generate", mark({"input_ids": [1], "stream": True}, random.Random(4)))
    err = sse({"error": {"message": "boom", "code": 503}})
    assert b"".join(sp.feed(err + b": keep-alive\n\n")) == err + b": keep-alive\n\n"
    assert sp.migrated is None


@pytest.mark.parametrize(
    "label,body,ok",
    [
        ("chat", {"stream": True, "messages": []}, True),
        ("chat", {"messages": []}, False),  # not streamed
        ("chat", {"stream": True, "n": 2}, False),
        ("chat", {"stream": True, "logprobs": True}, False),
        ("chat", {"stream": True, "tools": [{"type": "function"}]}, False),
        ("completions", {"stream": True, "prompt": "x"}, True),
        ("completions", {"stream": True, "echo": True}, False),
        ("generate", {"stream": True, "text": "x"}, True),
        ("generate", {"stream": True, "return_logprob": True}, False),
        ("generate", {"stream": True, "rid": "mine"}, False),  # the caller's rid is left alone
        # sampling state a continuation would lose
        ("generate", {"stream": True, "sampling_params": {"regex": "a+"}}, False),
        ("generate", {"stream": True, "sampling_params": {"json_schema": "{}"}}, False),
        ("generate", {"stream": True, "sampling_params": {"frequency_penalty": 0.5}}, False),
        ("generate", {"stream": True, "sampling_params": {"repetition_penalty": 1.0}}, True),
        ("generate", {"stream": True, "sampling_params": {"min_new_tokens": 4}}, False),
        ("generate", {"stream": True, "sampling_params": {"stop": ["\n\n"]}}, False),
        ("generate", {"stream": True, "sampling_params": {"stop_token_ids": [2]}}, True),
        (
            "generate",
            {"stream": True, "sampling_params": {"temperature": 0.8, "sampling_seed": 3}},
            False,
        ),
        ("generate", {"stream": True, "sampling_params": {"temperature": 0.8}}, True),
        ("generate", {"stream": True, "sampling_params": {"temperature": 0, "seed": 3}}, True),
        ("chat", {"stream": True, "response_format": {"type": "json_object"}}, False),
        ("chat", {"stream": True, "response_format": {"type": "text"}}, True),
        ("chat", {"stream": True, "presence_penalty": 0.2}, False),
        ("chat", {"stream": True, "temperature": 0.7, "seed": 1}, False),
        ("completions", {"stream": True, "ebnf": "root ::= 'a'"}, False),
        ("completions", {"stream": True, "min_tokens": 3}, False),
        ("completions", {"stream": True, "stop": "END"}, False),
    ],
)
def test_which_requests_are_marked_migratable(label, body, ok):
    assert migratable(label, body) is ok
    why = unmigratable_reason(label, body)
    assert (why is None) is ok
    if not ok:  # the reason names the field that prevents it
        fields = {*body, *body.get("sampling_params", {})}
        assert why in ("not streamed", "n > 1") or why.split(":")[0] in fields, why


def req(rid, out=5, max_new=100, prompt=10, finished=False):
    return SimpleNamespace(
        rid=rid,
        output_ids=[0] * out,
        origin_input_ids=[0] * prompt,
        to_finish=None,
        sampling_params=SimpleNamespace(max_new_tokens=max_new),
        finished=lambda: finished,
    )


def test_the_worker_moves_the_marked_request_with_the_most_tokens_left():
    a, b, c = req(PREFIX + "a", out=50), req(PREFIX + "b", out=10), req("plain", out=0)
    assert pick([a, b, c]) == (b, "")
    assert pick([a, b, c], PREFIX + "a") == (a, "")
    assert pick([a, b, c], moving=frozenset({b.rid})) == (a, "")  # another migration has b
    assert "being moved already" in pick([a, b], b.rid, moving=frozenset({b.rid}))[1]
    r, why = pick([a, b, c], "plain")
    assert r is None and "not sent by the router as migratable" in why
    r, why = pick([a], "nope")
    assert r is None and "not running here" in why
    assert "token(s) left" in why_not_movable(req(PREFIX + "z", out=100 - MIN_LEFT + 1))
    assert why_not_movable(req(PREFIX + "f", finished=True)) == "is finishing"
    r, why = pick([c])
    assert r is None and "none of the 1 running" in why


# ---------------------------------------------------------------- text across a cut
# A byte-level tokenizer: token i is byte i. "€" is three bytes (E2 82 AC), so three tokens.
def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", "replace")


EURO = [0xE2, 0x82, 0xAC]


def completion_event(text, ids, done=None, prompt=None, matched=None):
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": done}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    if matched is not None:
        choice["matched_stop"] = matched
    return {
        "id": "c9",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }


def texts(events) -> str:
    return "".join(
        (c.get("text") or (c.get("delta") or {}).get("content") or "")
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices") or []
    )


def test_a_character_cut_by_a_resume_reads_whole():
    sp = Splicer("completions", {"prompt": "x", "stream": True, "max_tokens": 8}, byte_decode)
    # SGLang holds back the first byte of the euro sign: an event with its id, no text
    first = sse(completion_event("A", [65], prompt=[1, 2])) + sse(completion_event("", EURO[:1]))
    seen = run(sp, first)
    path, body = sp.resume()  # the decode worker died here
    assert path == "/v1/completions" and body["prompt"] == [1, 2, 65, 0xE2]
    # the continuation's worker decodes only its own ids: two stray bytes, then "B"
    cont = (
        sse(completion_event("", EURO[1:2]))
        + sse(completion_event("", EURO[2:]))
        + sse(completion_event("\ufffd\ufffdB", [66], done="length"))
        + b"data: [DONE]\n\n"
    )
    seen += run(sp, cont)
    assert texts(seen) == "A€B"  # what one unbroken upstream writes
    assert all("token_ids" not in c for e in seen if isinstance(e, dict) for c in e["choices"])


def test_a_character_cut_by_a_generate_handoff_reads_whole():
    body = mark(
        {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 9}},
        random.Random(5),
    )
    sp = Splicer("generate", body, byte_decode)
    first = sse(gen_event("A", [65], prompt=2)) + sse(
        gen_event("A", [65, 0xE2], {"type": "abort", "matched": MARK + "m9"}, prompt=2)
    )
    seen = run(sp, first)
    assert sp.migrated == "m9"
    sp.continuation([1, 2], [65, 0xE2])
    cont = (
        sse(gen_event("\ufffd", EURO[1:2], prompt=4))
        + sse(
            gen_event("\ufffd\ufffdB", [*EURO[1:], 66], {"type": "length", "length": 3}, prompt=4)
        )
        + b"data: [DONE]\n\n"
    )
    seen += run(sp, cont)
    last = [e for e in seen if isinstance(e, dict)][-1]
    assert last["text"] == "A€B" and last["output_ids"] == [65, *EURO, 66]
    # cumulative text never shrinks and never shows a stray byte
    shown = [e["text"] for e in seen if isinstance(e, dict)]
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:])) and "\ufffd" not in "".join(shown)


def test_a_character_cut_by_a_chat_handoff_reads_whole():
    body = mark({"messages": [{"role": "user", "content": "hi"}], "stream": True}, random.Random(6))
    sp = Splicer("chat", body, byte_decode)
    head = {"id": "h1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(content, done=None, matched=None):
        c = {"index": 0, "delta": {"content": content}, "finish_reason": done}
        if matched:
            c["matched_stop"] = matched
        return {**head, "choices": [c]}

    seen = run(sp, sse(chunk("A")) + sse(chunk("", "abort", MARK + "m7")))
    path, cont_body = sp.continuation([1, 2, 3], [65, 0xE2])
    assert cont_body["return_token_ids"] is True  # the text across the cut is made from ids
    cont = (
        sse(completion_event("\ufffd\ufffdB", [*EURO[1:], 66], done="stop")) + b"data: [DONE]\n\n"
    )
    seen += run(sp, cont)
    assert texts(seen) == "A€B"
    assert all("token_ids" not in c for e in seen if isinstance(e, dict) for c in e["choices"])


def test_without_a_tokenizer_the_continuation_text_is_relayed_as_it_comes():
    sp = Splicer("completions", {"prompt": "x", "stream": True, "max_tokens": 8})
    seen = run(sp, sse(completion_event("A", [65], prompt=[1])) + sse(completion_event("", [0xE2])))
    sp.resume()
    seen += run(sp, sse(completion_event("\ufffdB", [0x82, 66], done="length")))
    assert texts(seen) == "A\ufffdB"
