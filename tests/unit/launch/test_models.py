"""The embedded models: deterministic, real HF Llama checkpoints with a chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bana_sglang import models


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_build_is_deterministic(tmp_path):
    a = models.build("tiny", root=tmp_path / "a")
    b = models.build("tiny", root=tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_digest(a))


def test_tiny_model_shape_and_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_model / "config.json").read_text())
    spec = models.SPECS["tiny"]
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]  # GQA
    assert cfg["num_hidden_layers"] == spec.num_layers
    assert cfg["torch_dtype"] == "float32"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) <= cfg["vocab_size"]
    text = "The prefix cache of worker 42, reused!"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"


def test_resolve_rejects_unknown_names_and_folders(tmp_path):
    with pytest.raises(models.ModelBuildError, match="neither an embedded model"):
        models.resolve(str(tmp_path / "missing"))
    with pytest.raises(models.ModelBuildError, match="unknown model"):
        models.build("huge")


def test_small_spec_is_tens_of_millions_with_8k_context():
    s = models.SPECS["small"]
    h, kv = s.hidden_size, s.num_kv_heads * s.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * s.intermediate_size
    params = s.num_layers * per_layer + 2 * s.vocab_target * h
    assert 10e6 < params < 100e6
    assert s.max_position >= 8192
