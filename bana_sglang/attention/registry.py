"""Registration of the ``bana_cpu`` attention backend with SGLang 0.5.23.

SGLang picks the attention backend by name in two places, and both must know
ours in every process where they run:

1. ``--attention-backend`` is an argparse option whose ``choices`` is the list
   ``sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES`` (the same list
   object the parser is built from, built at parse time).
   ``sglang.launch_server`` calls ``load_plugins()`` *before*
   ``prepare_server_args(sys.argv)``, and so do ``Engine`` and ``sglang serve``,
   so extending the list from the plugin (SGLang's own
   ``add_attention_backend_choices``) makes the name valid on the CLI.
2. The model runner (in the scheduler process, which calls ``load_plugins()``
   first thing) looks the name up in ``attention_registry.ATTENTION_BACKENDS``;
   ``register_attention_backend`` adds our factory there.

Why a new name rather than replacing ``torch_native``'s factory: the choice is
visible on the command line and in logs, the stock path stays one flag away
(``BANA_CPU_ATTENTION=stock`` in :mod:`bana_sglang.compat`), and no SGLang
behaviour changes for a user who asks for ``torch_native``.

The cost of a new name: SGLang special-cases the string ``torch_native`` in a
few places. On CPU: CUDA-graph disabling (irrelevant: the CPU runner logs
``cpu graph: False`` either way) and ``support_triton()`` (false on CPU for any
name, it asks the platform). One is not covered: with ``--page-size > 1``,
``mem_cache.allocation.get_last_loc`` picks its Triton kernel for any backend
name other than ``torch_native``/``ascend``, so ``bana_cpu`` needs
``--page-size 1`` (the CPU default) until SGLang keys that on the platform.

Idempotent; cheap after the first call.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

BACKEND_NAME = "bana_cpu"


def _create_backend(runner: ModelRunner) -> AttentionBackend:
    if runner.use_mla_backend:
        raise ValueError(
            f"the {BACKEND_NAME} attention backend does not support MLA models; "
            "use --attention-backend torch_native"
        )
    from bana_sglang.attention.backend import BanaCpuAttnBackend

    return BanaCpuAttnBackend(runner)


def register_backend() -> bool:
    """Make ``--attention-backend bana_cpu`` valid and buildable; True if newly registered."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    new = False
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
        new = True
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(_create_backend)
        new = True
    return new
