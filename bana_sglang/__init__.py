"""bana_sglang: BanaServe for SGLang 0.5.23.

A global KV cache store over the Mooncake Store, load-only prefill/decode
routing, and ZMQ-controlled layer- and attention-level migration between
SGLang prefill/decode workers. See README.md for the process picture.
"""

from __future__ import annotations

__version__ = "0.1.0"

SGLANG_VERSION = "0.5.23"

# torchvision from PyPI does not import beside the CPU torch build; the hook is
# lazy and does nothing where torchvision's compiled ops load (see compat/).
from bana_sglang.compat._torchvision import install as _install_torchvision_fix  # noqa: E402

_install_torchvision_fix()
