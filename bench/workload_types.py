"""What every workload source builds with: :class:`TokenSpace` (the token ids a
prompt may use), :class:`Request`, :class:`Workload`, :class:`WorkloadSpec`, and
the helpers the sources share (token blocks, Poisson arrivals, clipping to the
context). The sources are :mod:`bench.traces` and :mod:`bench.generators`;
:mod:`bench.workloads` names them and states the invariants.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces


class WorkloadError(ValueError):
    """A workload could not be built: unknown name, bad parameter, missing trace."""


@dataclasses.dataclass(frozen=True)
class TokenSpace:
    """Which token ids a generated prompt may use, their text, and the model's context.

    ``ids`` are only "stable words": byte-level BPE tokens of the form
    ``" word"`` (a space then ASCII letters) whose text encodes back to
    exactly that one id. The byte-level pre-tokenizer splits text at spaces,
    so any sequence of them decodes to a text that tokenizes back to the same
    ids: prompts can be sent as text (the stock ``sglang_router`` accepts no
    token-id prompts) and the server still sees exactly these ids.
    """

    ids: tuple[int, ...]
    context_len: int
    pieces: tuple[str, ...] = ()  # pieces[k] is the text of ids[k]

    @classmethod
    def from_model(cls, model_dir: str | Path) -> TokenSpace:
        """Read the vocabulary (``tokenizer.json``, via ``tokenizers``) and the
        context (``config.json``) of an HF folder."""
        import tokenizers

        folder = Path(model_dir)
        cfg = json.loads((folder / "config.json").read_text())
        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        special = {
            int(t["id"])
            for t in json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
        }
        stable: list[tuple[int, str]] = []
        for piece, tid in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            word = piece[1:]
            if (
                piece.startswith("\u0120")
                and word.isascii()
                and word.isalpha()
                and tid not in special
            ):
                text = " " + word
                if tok.encode(text, add_special_tokens=False).ids == [tid]:
                    stable.append((tid, text))
        if len(stable) < 32:
            raise WorkloadError(
                f"only {len(stable)} stable word tokens in {folder}: too few for random prompts"
            )
        return cls(
            ids=tuple(i for i, _ in stable),
            pieces=tuple(t for _, t in stable),
            context_len=int(cfg.get("max_position_embeddings", 4096)),
        )

    @functools.cached_property
    def _text_of(self) -> dict[int, str]:
        return dict(zip(self.ids, self.pieces))

    def to_text(self, prompt: Sequence[int]) -> str:
        """The text that tokenizes to exactly ``prompt`` (ids from this space only)."""
        try:
            return "".join(self._text_of[i] for i in prompt)
        except KeyError as e:
            raise WorkloadError(
                f"token id {e.args[0]} is not a stable word token of this space"
            ) from None


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a workload."""

    rid: int
    arrival_s: float  # seconds after the run starts
    prompt: tuple[int, ...]  # token ids
    max_tokens: int  # enforced output length (ignore_eos)
    group: str = ""  # prefix group (system prompt id, trace conversation root, kind)
    prefix_ids: tuple[int, ...] = ()  # trace hash ids / block ids that built the prompt

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    params: dict[str, object]  # everything that determines the workload, for the report
    notes: tuple[str, ...] = ()  # clipping, scaling: stated in every report

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def offered_rate(self) -> float:
        """Mean arrival rate (req/s) over the arrival span."""
        n = len(self.requests)
        return (n - 1) / self.duration_s if n > 1 and self.duration_s > 0 else float("inf")

    def describe(self) -> str:
        n = len(self.requests)
        ins = sum(r.prompt_len for r in self.requests)
        outs = sum(r.max_tokens for r in self.requests)
        p = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return (
            f"{self.name}: {n} requests over {self.duration_s:.1f}s (offered "
            f"{self.offered_rate:.2f} req/s), mean input {ins / max(n, 1):.0f} tok, mean output "
            f"{outs / max(n, 1):.0f} tok; {p}"
        )


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Parameters shared by all sources; each source reads the ones it needs."""

    name: str = "shared-prefix"
    num_requests: int = 40
    request_rate: float | None = None  # req/s; None: the trace's own times (scaled) or 1.0
    seed: int = 0
    length_scale: float = 1 / 16  # trace token counts are multiplied by this
    output_scale: float | None = None  # None: same as length_scale
    time_scale: float = 1.0  # trace inter-arrival times are multiplied by this
    trace_offset: int = 0  # first trace row used
    trace: str | None = None  # traces: the file to read (None: the shipped copy)
    # generated workloads
    input_len: int = 512
    output_len: int = 32
    num_groups: int = 4  # shared-prefix: system prompts
    system_len: int = 1024
    zipf_alpha: float = 0.0  # shared-prefix: 0 = uniform over groups
    burst_on_s: float = 5.0  # bursty: seconds of arrivals at rate x burst_factor ...
    burst_off_s: float = 5.0  # ... then seconds of silence
    clip: bool = True

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError("num_requests must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise WorkloadError("request_rate must be positive (use a large value for a burst)")
        if not 0 < self.length_scale <= 1 or self.time_scale <= 0:
            raise WorkloadError("length_scale must be in (0, 1] and time_scale positive")

    @property
    def out_scale(self) -> float:
        return self.length_scale if self.output_scale is None else self.output_scale


def block_tokens(seed: int, key: object, size: int, space: TokenSpace) -> tuple[int, ...]:
    """The token block for ``key``: a pure function of (seed, key, size)."""
    rng = random.Random(f"bench-block:{seed}:{key}")  # str seeds hash with SHA-512: stable
    return tuple(rng.choice(space.ids) for _ in range(size))


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """``n`` Poisson arrival times (first at 0); ``rate=inf`` sends all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# SGLang stops a request a token or two before the context is full (4071 + 25
# tokens on a 4096 context gave 23 output tokens), so clipping leaves a margin.
CONTEXT_MARGIN = 8


def clip_to_context(
    prompt: list[int], max_tokens: int, space: TokenSpace, clip: bool
) -> tuple[list[int], int, bool]:
    """Clip so that prompt + output + margin fits the context (output kept >= 1)."""
    room = space.context_len - CONTEXT_MARGIN
    if not clip or len(prompt) + max_tokens <= room:
        return prompt, max_tokens, False
    max_tokens = min(max_tokens, max(1, room // 8))
    return prompt[: room - max_tokens], max_tokens, True


def assemble(
    name: str,
    reqs: list[Request],
    params: dict[str, object],
    clipped: int,
    extra_notes: tuple[str, ...] = (),
) -> Workload:
    """The workload of ``reqs`` sorted by arrival, with the number clipped stated in its notes."""
    reqs.sort(key=lambda r: (r.arrival_s, r.rid))
    notes = list(extra_notes)
    if clipped:
        notes.append(
            f"{clipped} of {len(reqs)} requests clipped to the "
            f"{params.get('context_len', '?')}-token context"
        )
    return Workload(name=name, requests=tuple(reqs), params=params, notes=tuple(notes))
