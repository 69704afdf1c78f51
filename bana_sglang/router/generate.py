"""``/generate`` specifics: batches fanned out per item, and logprob answers.

- :func:`split_generate` validates a body and splits a batch (list ``text`` or
  ``input_ids``) into one body per item; per-item fields given as lists are
  indexed, the rest shared.
- :func:`fix_logprob_window`: SGLang 0.5.23 returns ``None`` as the first
  logprob of a ``logprob_start_len`` window (the logit before the window is
  not kept). The router asks for one position more and drops it here; the
  prompt's very first token, which has no context, gets 0.0.
- :func:`merge_input_logprobs`: decode answers carry no prompt logprobs, so
  the prefill worker's are put in front.
"""

from __future__ import annotations

import orjson

from bana_sglang.router.requests import BadRequest, check_max_tokens

PER_ITEM_FIELDS = frozenset(
    {
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "stream",
        "lora_path",
        "custom_logit_processor",
        "return_hidden_states",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "data_parallel_rank",
    }
)


def split_generate(body: dict, max_tokens_limit: int) -> list[dict] | None:
    """Validate a /generate body; for a batch, the per-item bodies (else None)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' and 'input_ids'")
    sp = body.get("sampling_params")
    if sp is not None and not isinstance(sp, (dict, list)):
        raise BadRequest(
            "'sampling_params' must be an object (or a list of them)", param="sampling_params"
        )
    batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
    if isinstance(text, list) and not all(isinstance(t, str) for t in text):
        raise BadRequest("'text' must be a string or a list of strings", param="text")
    if text is not None and not isinstance(text, (str, list)):
        raise BadRequest("'text' must be a string or a list of strings", param="text")
    n = len(text if text is not None else ids) if batch else 1
    if batch and n == 0:
        raise BadRequest("empty batch")
    sps = sp if isinstance(sp, list) else [sp or {}] * n
    if len(sps) != n:
        raise BadRequest(f"{len(sps)} sampling_params for {n} prompts", param="sampling_params")
    for s in sps:
        if not isinstance(s, dict):
            raise BadRequest("each sampling_params must be an object", param="sampling_params")
        check_max_tokens(
            s.get("max_new_tokens"), name="max_new_tokens", limit=max_tokens_limit, allow_zero=True
        )
    if not batch:
        return None
    if body.get("stream"):
        raise BadRequest(
            "streaming a batch of prompts is not supported by this router; "
            "send one request per prompt",
            param="stream",
        )
    per_item = set()
    for k, v in body.items():
        if k not in PER_ITEM_FIELDS or not isinstance(v, list):
            continue
        if k == "token_ids_logprob" and not (v and isinstance(v[0], list)):
            continue  # one list of token ids, shared by every prompt
        if len(v) != n:
            raise BadRequest(f"'{k}' has {len(v)} entries for {n} prompts", param=k)
        per_item.add(k)
    out = []
    for i in range(n):
        item = {
            k: (v[i] if k in per_item else v)
            for k, v in body.items()
            if k not in ("text", "input_ids", "sampling_params")
        }
        if text is not None:
            item["text"] = text[i]
        else:
            item["input_ids"] = ids[i]
        item["sampling_params"] = sps[i]
        out.append(item)
    return out


def fix_logprob_window(meta: dict, *, shift: bool, from_start: bool) -> None:
    """Make every input logprob of the window a number (see module docstring)."""
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        vals = meta.get(key)
        if shift and isinstance(vals, list) and vals:
            meta[key] = vals[1:]
    vals = meta.get("input_token_logprobs")
    if (
        from_start
        and isinstance(vals, list)
        and vals
        and isinstance(vals[0], list)
        and vals[0][0] is None
    ):
        vals[0][0] = 0.0


def merge_input_logprobs(p_data: bytes, d_data: bytes) -> bytes:
    """Decode answers carry no prompt logprobs; take the prefill worker's."""
    try:
        p, d = orjson.loads(p_data), orjson.loads(d_data)
        pm, dm = p.get("meta_info", {}), d.get("meta_info", {})
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if key in pm:
                dm[key] = pm[key] + (dm.get(key) or [])
        return orjson.dumps(d)
    except (ValueError, AttributeError, TypeError):
        return d_data
