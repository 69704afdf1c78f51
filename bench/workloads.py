"""Workloads: real traces and generated cases, all as lists of token-id requests.

Every source yields a :class:`Workload`: a tuple of :class:`Request` sorted by
arrival time (seconds from the start of the run), each with its prompt as
token ids and an output length that the client enforces (``max_tokens`` with
``ignore_eos``).

Invariants:

- prompts are built as token ids, so a shared prefix is an exact shared
  prefix of ids (and, being stable words, of the text sent);
- in trace replay, equal ``hash_ids`` give identical token blocks and
  different ones give different blocks (each block is drawn from a generator
  seeded by ``(seed, hash_id)`` only), so the trace's prefix structure is
  preserved exactly; the block size is the trace's 512 tokens times the
  length scale;
- prompt ids are "stable words" (see :class:`TokenSpace`): never special
  tokens, and any sequence of them survives a decode/encode round trip, so
  prompts can travel as text through routers that take no token ids;
- ``prompt_len + max_tokens <= context_len - CONTEXT_MARGIN``: a longer request is clipped
  (prompt first, keeping its prefix) unless ``clip=False``, and the number
  clipped is stated in :attr:`Workload.notes`.

Sources are registered in :data:`WORKLOADS`; an unknown name raises
:class:`WorkloadError` listing the valid ones.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import functools
import json
import logging
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "bench" / "data" / "traces"  # shipped with the project (README there)
MOONCAKE_TRACE = TRACES / "mooncake_conversation_trace.jsonl"
AZURE_TRACE = TRACES / "azure_llm_2023_conv.csv"
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


Builder = Callable[[WorkloadSpec, TokenSpace], Workload]
WORKLOADS: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        WORKLOADS[name] = fn
        return fn

    return deco


def build(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    try:
        builder = WORKLOADS[spec.name]
    except KeyError:
        raise WorkloadError(
            f"unknown workload {spec.name!r}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
    if spec.trace is not None and spec.name in ("mooncake", "azure"):
        wl = builder(spec, space, Path(spec.trace))
    else:
        wl = builder(spec, space)
    logger.info("workload %s", wl.describe())
    return wl


# --------------------------------------------------------------------------- helpers


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


def _fit(
    prompt: list[int], max_tokens: int, space: TokenSpace, clip: bool
) -> tuple[list[int], int, bool]:
    """Clip so that prompt + output + margin fits the context (output kept >= 1)."""
    room = space.context_len - CONTEXT_MARGIN
    if not clip or len(prompt) + max_tokens <= room:
        return prompt, max_tokens, False
    max_tokens = min(max_tokens, max(1, room // 8))
    return prompt[: room - max_tokens], max_tokens, True


def _finish(
    name: str,
    reqs: list[Request],
    params: dict[str, object],
    clipped: int,
    extra_notes: tuple[str, ...] = (),
) -> Workload:
    reqs.sort(key=lambda r: (r.arrival_s, r.rid))
    notes = list(extra_notes)
    if clipped:
        notes.append(
            f"{clipped} of {len(reqs)} requests clipped to the "
            f"{params.get('context_len', '?')}-token context"
        )
    return Workload(name=name, requests=tuple(reqs), params=params, notes=tuple(notes))


# --------------------------------------------------------------------------- traces


@register("mooncake")
def mooncake_trace(spec: WorkloadSpec, space: TokenSpace, path: Path = MOONCAKE_TRACE) -> Workload:
    """Mooncake conversation trace rows ``[trace_offset, +num_requests)``.

    Arrivals: trace timestamps (ms) times ``time_scale``; with ``request_rate``
    the time scale is chosen so that the slice's mean rate equals it.
    Prompts: one block of ``round(512 * length_scale)`` tokens per hash id,
    cut to ``round(input_length * length_scale)`` tokens.
    """
    if not path.exists():
        raise WorkloadError(f"trace not found: {path}")
    rows: list[dict] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i < spec.trace_offset:
                continue
            if len(rows) >= spec.num_requests:
                break
            rows.append(json.loads(line))
    if not rows:
        raise WorkloadError(f"no rows at offset {spec.trace_offset} in {path}")
    block = max(1, round(MOONCAKE_BLOCK * spec.length_scale))
    t0 = rows[0]["timestamp"]
    span = (rows[-1]["timestamp"] - t0) / 1000.0
    time_scale = spec.time_scale
    if spec.request_rate is not None and span > 0:
        time_scale = (len(rows) - 1) / spec.request_rate / span
    reqs, clipped = [], 0
    for i, row in enumerate(rows):
        hashes = tuple(int(h) for h in row["hash_ids"])
        n_in = max(1, min(round(row["input_length"] * spec.length_scale), block * len(hashes)))
        prompt: list[int] = []
        for h in hashes:
            if len(prompt) >= n_in:
                break
            prompt.extend(block_tokens(spec.seed, ("mc", h), block, space))
        prompt = prompt[:n_in]
        out = max(1, round(row["output_length"] * spec.out_scale))
        prompt, out, c = _fit(prompt, out, space, spec.clip)
        clipped += c
        reqs.append(
            Request(
                rid=i,
                arrival_s=(row["timestamp"] - t0) / 1000.0 * time_scale,
                prompt=tuple(prompt),
                max_tokens=out,
                group=f"h{hashes[0]}" if hashes else "",
                prefix_ids=hashes,
            )
        )
    params = dict(
        trace=path.name,
        offset=spec.trace_offset,
        n=len(rows),
        time_scale=round(time_scale, 4),
        length_scale=spec.length_scale,
        output_scale=spec.out_scale,
        block_tokens=block,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return _finish("mooncake", reqs, params, clipped)


def _azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than fromisoformat takes on 3.11
    head, _, frac = text.strip().partition(".")
    base = dt.datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


@register("azure")
def azure_trace(spec: WorkloadSpec, space: TokenSpace, path: Path = AZURE_TRACE) -> Workload:
    """Azure LLM 2023 conversation trace: real bursty arrivals and lengths;
    prompts are unique random blocks (the trace has no prefix identity)."""
    if not path.exists():
        raise WorkloadError(f"trace not found: {path}")
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        for i, rec in enumerate(csv.DictReader(f)):
            if i < spec.trace_offset:
                continue
            if len(rows) >= spec.num_requests:
                break
            rows.append(
                (
                    _azure_time(rec["TIMESTAMP"]),
                    int(rec["ContextTokens"]),
                    int(rec["GeneratedTokens"]),
                )
            )
    if not rows:
        raise WorkloadError(f"no rows at offset {spec.trace_offset} in {path}")
    t0, span = rows[0][0], rows[-1][0] - rows[0][0]
    time_scale = spec.time_scale
    if spec.request_rate is not None and span > 0:
        time_scale = (len(rows) - 1) / spec.request_rate / span
    reqs, clipped = [], 0
    for i, (ts, n_in, n_out) in enumerate(rows):
        prompt = list(
            block_tokens(
                spec.seed,
                ("az", spec.trace_offset + i),
                max(1, round(n_in * spec.length_scale)),
                space,
            )
        )
        out = max(1, round(n_out * spec.out_scale))
        prompt, out, c = _fit(prompt, out, space, spec.clip)
        clipped += c
        reqs.append(
            Request(
                rid=i,
                arrival_s=(ts - t0) * time_scale,
                prompt=tuple(prompt),
                max_tokens=out,
                group="azure",
            )
        )
    params = dict(
        trace=path.name,
        offset=spec.trace_offset,
        n=len(rows),
        time_scale=round(time_scale, 4),
        length_scale=spec.length_scale,
        output_scale=spec.out_scale,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return _finish("azure", reqs, params, clipped)


# --------------------------------------------------------------------------- generators


def _rate(spec: WorkloadSpec) -> float:
    return spec.request_rate if spec.request_rate is not None else 1.0


@register("shared-prefix")
def shared_prefix(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """A few long system prompts (``num_groups`` x ``system_len`` tokens) shared
    by many requests, each adding a unique question of ``input_len`` tokens:
    the hotspot case. Groups uniform, or Zipf(``zipf_alpha``) when > 0."""
    rng = random.Random(f"shared-prefix:{spec.seed}")
    systems = [
        block_tokens(spec.seed, ("sys", g), spec.system_len, space) for g in range(spec.num_groups)
    ]
    weights = [1.0 / (g + 1) ** spec.zipf_alpha for g in range(spec.num_groups)]
    arrivals = poisson_arrivals(spec.num_requests, _rate(spec), rng)
    reqs, clipped = [], 0
    for i, t in enumerate(arrivals):
        g = (
            (i % spec.num_groups)
            if spec.zipf_alpha == 0
            else rng.choices(range(spec.num_groups), weights)[0]
        )
        prompt = list(systems[g]) + list(block_tokens(spec.seed, ("q", i), spec.input_len, space))
        prompt, out, c = _fit(prompt, spec.output_len, space, spec.clip)
        clipped += c
        reqs.append(
            Request(
                rid=i,
                arrival_s=t,
                prompt=tuple(prompt),
                max_tokens=out,
                group=f"sys{g}",
                prefix_ids=(g,),
            )
        )
    params = dict(
        rate=_rate(spec),
        groups=spec.num_groups,
        system_len=spec.system_len,
        question_len=spec.input_len,
        output_len=spec.output_len,
        zipf_alpha=spec.zipf_alpha,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return _finish("shared-prefix", reqs, params, clipped)


@register("long-context")
def long_context(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """Unique prompts of 70-95% of the context, short outputs, Poisson arrivals."""
    rng = random.Random(f"long-context:{spec.seed}")
    arrivals = poisson_arrivals(spec.num_requests, _rate(spec), rng)
    reqs = []
    for i, t in enumerate(arrivals):
        out = spec.output_len
        n_in = int(rng.uniform(0.70, 0.95) * (space.context_len - CONTEXT_MARGIN - out))
        reqs.append(
            Request(
                rid=i,
                arrival_s=t,
                prompt=block_tokens(spec.seed, ("lc", i), n_in, space),
                max_tokens=out,
                group="long",
            )
        )
    params = dict(
        rate=_rate(spec),
        input="70-95% of context",
        output_len=spec.output_len,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return _finish("long-context", reqs, params, 0)


@register("bursty")
def bursty(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """On/off Poisson: during ``burst_on_s`` seconds requests arrive at a rate
    chosen so that the long-run mean is ``request_rate``, then ``burst_off_s``
    seconds of silence. Prompt lengths uniform in [input_len/2, 3*input_len/2]."""
    rng = random.Random(f"bursty:{spec.seed}")
    mean = _rate(spec)
    on_rate = mean * (spec.burst_on_s + spec.burst_off_s) / spec.burst_on_s
    arrivals: list[float] = []
    t = 0.0
    while len(arrivals) < spec.num_requests:
        cycle = spec.burst_on_s + spec.burst_off_s
        phase = t % cycle
        if phase >= spec.burst_on_s:  # silence: jump to the next burst
            t += cycle - phase
        arrivals.append(t)
        t += rng.expovariate(on_rate)
    reqs, clipped = [], 0
    for i, at in enumerate(arrivals):
        n_in = rng.randint(max(1, spec.input_len // 2), max(1, 3 * spec.input_len // 2))
        prompt, out, c = _fit(
            list(block_tokens(spec.seed, ("b", i), n_in, space)), spec.output_len, space, spec.clip
        )
        clipped += c
        reqs.append(
            Request(rid=i, arrival_s=at, prompt=tuple(prompt), max_tokens=out, group="burst")
        )
    params = dict(
        mean_rate=mean,
        on_rate=round(on_rate, 3),
        on_s=spec.burst_on_s,
        off_s=spec.burst_off_s,
        input_len=spec.input_len,
        output_len=spec.output_len,
        seed=spec.seed,
        context_len=space.context_len,
    )
    return _finish("bursty", reqs, params, clipped)


@register("mixed")
def mixed(spec: WorkloadSpec, space: TokenSpace) -> Workload:
    """Half short-prompt/long-output (input_len/8 in, output_len*4 out), half
    long-prompt/short-output (input_len*4 in, output_len/4 out), interleaved
    at random, Poisson arrivals."""
    rng = random.Random(f"mixed:{spec.seed}")
    arrivals = poisson_arrivals(spec.num_requests, _rate(spec), rng)
    reqs, clipped = [], 0
    for i, t in enumerate(arrivals):
        if rng.random() < 0.5:
            kind, n_in, out = "short-in/long-out", max(1, spec.input_len // 8), spec.output_len * 4
        else:
            kind, n_in, out = "long-in/short-out", spec.input_len * 4, max(1, spec.output_len // 4)
        prompt, out, c = _fit(
            list(block_tokens(spec.seed, ("m", i), n_in, space)), out, space, spec.clip
        )
        clipped += c
        reqs.append(Request(rid=i, arrival_s=t, prompt=tuple(prompt), max_tokens=out, group=kind))
    params = dict(
        rate=_rate(spec),
        short=(max(1, spec.input_len // 8), spec.output_len * 4),
        long=(spec.input_len * 4, max(1, spec.output_len // 4)),
        seed=spec.seed,
        context_len=space.context_len,
    )
    return _finish("mixed", reqs, params, clipped)


def save_jsonl(wl: Workload, path: Path) -> None:
    """Write the workload (one request per line) so another tool can replay it."""
    with path.open("w") as f:
        for r in wl.requests:
            f.write(
                json.dumps(
                    dict(
                        rid=r.rid,
                        arrival_s=r.arrival_s,
                        prompt=list(r.prompt),
                        max_tokens=r.max_tokens,
                        group=r.group,
                    )
                )
                + "\n"
            )
