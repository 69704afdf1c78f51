"""A real SGLang worker with the extension loaded is exact: greedy float32
tokens equal HF transformers ``generate``."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The prefix cache of the model",
    "Hello there, how are you doing today? I am fine.",
    "a b c d e f g",
    "Decode workers publish the pages of finished requests.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(hf, prompt: str, n: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    tok, model = hf
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


def sglang_greedy(url: str, input_ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    r = httpx.post(
        f"{url}/generate",
        timeout=120,
        json={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        },
    )
    r.raise_for_status()
    return r.json()["output_ids"]


def test_greedy_tokens_equal_hf_transformers(single_server, hf):
    for prompt in PROMPTS:
        ids, expected = hf_greedy(hf, prompt)
        assert sglang_greedy(single_server, ids) == expected, prompt


def test_extension_is_loaded_in_the_worker(single_server):
    models = httpx.get(f"{single_server}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "bana-tiny-v1"
    info = httpx.get(f"{single_server}/bana/info", timeout=30).json()
    assert info["sglang"] == "0.5.23"
    assert info["cpu_layer"] is True
    assert "MooncakeKVSender.supports_host_tensor_indices=False" in info["cpu_fixes"]
    assert info["pd_fixes"] == ["MooncakeKVManager.transfer_worker survives a finished room"]
