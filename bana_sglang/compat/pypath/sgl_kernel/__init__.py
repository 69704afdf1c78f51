"""CPU stand-in for SGLang's ``sgl_kernel`` extension (bana_sglang.compat).

Only on a machine without CUDA does ``bana_sglang`` put this folder first on
``PYTHONPATH`` (it must be importable in SGLang's ``spawn``-ed children, which
import ``sgl_kernel`` at module level before any plugin runs). SGLang 0.5.23's
CPU engine *calls* one kernel, ``assign_req_to_token_pool_cpu``; it only
imports the others because, without AMX, its layers fall back to native torch.
Any other name resolves to a function that raises a clear error when called,
so a code path that really needs a native kernel fails loudly, never silently.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+bana-cpu-standin"
BANA_STANDIN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_context_len: int,
) -> None:
    """Write each request's new KV slot ids into its row of ``req_to_token``.

    For request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` gets
    the next ``end[i] - start[i]`` entries of ``out_cache_loc`` (packed in
    request order).
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n <= 0:
            continue
        if e > max_context_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end {e} > context {max_context_len}")
        req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in in bana_sglang.compat; this SGLang "
            "code path needs the native kernel (a CUDA or AMX build of sgl_kernel)"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
