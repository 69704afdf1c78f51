"""The embedded default models: real HF-format Llama checkpoints built locally.

No model can be downloaded on the machines this project targets, so it builds
its own: a ``LlamaForCausalLM`` checkpoint (``config.json`` + safetensors) with
random weights drawn from a fixed seed, and a byte-level BPE tokenizer trained
locally on a synthetic corpus, wrapped as ``PreTrainedTokenizerFast`` with a
chat template. SGLang and HF transformers both load the folder as is.

Invariant: a build is a pure function of (spec, package version of
``tokenizers``/``transformers``): the same spec always gives byte-identical
weights and tokenizer files, so tests and benchmarks on different machines see
the same model. ``MODEL_FORMAT`` is part of the cache folder name; bump it when
the recipe changes.

CLI::

    python -m bana_sglang.models build tiny      # prints the folder
    python -m bana_sglang.models path small      # where it is (or would be)
    python -m bana_sglang.models list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from bana_sglang import envs

logger = logging.getLogger(__name__)

MODEL_FORMAT = 1
DEFAULT_MODEL = "tiny"

# The chat template: plain role tags, one special token per tag, so that
# templated prompts tokenize the same way on every path (HF, SGLang, router).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape of one embedded model. Frozen: it names a cache folder."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_target: int  # BPE vocabulary target; the real size is what training reaches
    max_position: int
    init_std: float
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{self.name}: hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads must be a multiple of num_kv_heads (GQA)")


# init_std is large on purpose: with the usual 0.02 the logits of a random
# model are nearly flat, and greedy decoding would hinge on float rounding.
SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=192,
        vocab_target=1024,
        max_position=4096,
        init_std=0.15,
    ),
    "small": ModelSpec(
        name="small",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        vocab_target=8192,
        max_position=16384,
        init_std=0.05,
    ),
}


class ModelBuildError(RuntimeError):
    """A model could not be built or found; the message names the spec and the folder."""


def cache_root() -> Path:
    """Where built models live: ``$BANA_MODEL_CACHE`` or ``~/.cache/bana_sglang/models``."""
    env = envs.BANA_MODEL_CACHE.get()
    return Path(env) if env else Path.home() / ".cache" / "bana_sglang" / "models"


def model_dir(name: str, root: Path | None = None) -> Path:
    spec = _spec(name)
    return (root or cache_root()) / f"bana-{spec.name}-v{MODEL_FORMAT}"


def _spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ModelBuildError(
            f"unknown model {name!r}; known: {', '.join(sorted(SPECS))}"
        ) from None


# --------------------------------------------------------------------------- corpus

_ONSETS = [
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "pr",
    "sh",
    "st",
    "th",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt"]
_COMMON = (
    "the of and to in is it you that he was for on are as with his they at be this "
    "have from or one had by word but not what all were we when your can said there use "
    "an each which she do how their if will up other about out many then them these so "
    "some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get "
    "come made may part cache prefix token model layer decode prefill worker request"
).split()


def synthetic_corpus(seed: int, n_words: int) -> str:
    """Deterministic English-like text: common words plus syllable-built words,
    numbers and punctuation, so that BPE learns realistic merges."""
    rng = random.Random(seed)
    lexicon = list(_COMMON)
    for _ in range(6000):
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.choice([1, 1, 2, 2, 3]))
        )
        lexicon.append(word)
    out: list[str] = []
    sentence_len = 0
    for _ in range(n_words):
        r = rng.random()
        if r < 0.55:
            w = rng.choice(_COMMON)
        elif r < 0.97:
            w = rng.choice(lexicon)
        else:
            w = str(rng.randrange(0, 10000))
        if sentence_len == 0:
            w = w.capitalize()
        out.append(w)
        sentence_len += 1
        if sentence_len > 4 and rng.random() < 0.12:
            out[-1] += rng.choice([".", ".", ".", "?", "!"])
            out.append("\n" if rng.random() < 0.2 else "")
            sentence_len = 0
        elif rng.random() < 0.05:
            out[-1] += ","
    return " ".join(w for w in out if w)


# --------------------------------------------------------------------------- build


def _train_tokenizer(spec: ModelSpec, out: Path) -> int:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_corpus(spec.seed, n_words=60_000 if spec.vocab_target <= 2048 else 300_000)
    lines = corpus.split("\n")
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        model_max_length=spec.max_position,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)


def _write_weights(spec: ModelSpec, vocab_size: int, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
                p + "mlp.up_proj.weight": (spec.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, spec.intermediate_size),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab_size, h)

    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):  # fixed order: the draw sequence defines the weights
        shape = shapes[name]
        if len(shape) == 1:  # RMSNorm gains
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * spec.init_std
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _write_config(spec: ModelSpec, vocab_size: int, out: Path, bos_id: int, eos_id: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "initializer_range": spec.init_std,
        "use_cache": True,
        "bana_model": {"name": spec.name, "format": MODEL_FORMAT, "seed": spec.seed},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(
        json.dumps(gen_cfg, indent=2, sort_keys=True) + "\n"
    )


def build(name: str = DEFAULT_MODEL, root: Path | None = None, force: bool = False) -> Path:
    """Build model ``name`` into its cache folder (atomically) and return the folder.

    Reuses an existing complete build unless ``force``.
    """
    spec = _spec(name)
    dest = model_dir(name, root)
    if (dest / "config.json").exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        logger.info("building model %s into %s", name, dest)
        vocab = _train_tokenizer(spec, tmp)
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(tmp))
        vocab_size = -(-vocab // 64) * 64  # round up: SGLang and HF pad the embedding anyway
        _write_weights(spec, vocab_size, tmp)
        _write_config(spec, vocab_size, tmp, tok.bos_token_id, tok.eos_token_id)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def resolve(model: str | None) -> Path:
    """A ``--model-path`` value: an embedded model name (built on first use) or a folder."""
    if model is None or model in SPECS:
        return build(model or DEFAULT_MODEL)
    path = Path(model)
    if not (path / "config.json").exists():
        raise ModelBuildError(
            f"--model-path {model!r} is neither an embedded model ({', '.join(SPECS)}) "
            "nor a folder with a config.json"
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bana_sglang.models", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a model (reuses a finished build) and print its folder")
    b.add_argument("name", choices=sorted(SPECS))
    b.add_argument(
        "--root",
        type=Path,
        default=None,
        help="cache folder (default: $BANA_MODEL_CACHE or ~/.cache/bana_sglang/models)",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if present")
    p = sub.add_parser("path", help="print where a model is (or would be) built")
    p.add_argument("name", choices=sorted(SPECS))
    sub.add_parser("list", help="list the embedded models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "build":
        print(build(args.name, args.root, args.force))
    elif args.cmd == "path":
        print(model_dir(args.name))
    else:
        for spec in SPECS.values():
            print(
                f"{spec.name:6s} hidden={spec.hidden_size} layers={spec.num_layers} "
                f"heads={spec.num_heads}/{spec.num_kv_heads} ctx={spec.max_position}  {model_dir(spec.name)}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
