"""The CPU attention backend for SGLang (``--attention-backend bana_cpu``).

- :mod:`.backend`: ``BanaCpuAttnBackend``, an SGLang ``AttentionBackend`` whose
  extend cost follows the new tokens (math in :mod:`bana_sglang.kernels.cpu_attention`).
- :mod:`.registry`: :func:`register_backend`, called by the plugin in every
  SGLang process on CPU, so the name passes argparse and the model runner finds it.

Selected by default on CPU by :func:`bana_sglang.compat.server_args`;
``BANA_CPU_ATTENTION=stock`` selects SGLang's ``torch_native`` instead.
"""

from __future__ import annotations

from bana_sglang.attention.registry import BACKEND_NAME, register_backend

__all__ = ["BACKEND_NAME", "register_backend"]
