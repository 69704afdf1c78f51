"""This repository's ``kernels`` modules, whatever ``import kernels`` resolves to.

Our top-level package ``kernels/`` shares its name with Hugging Face's
``kernels`` (a dependency of SGLang, installed in site-packages). The editable
install puts our package *behind* site-packages on the import path, so in a
process whose working directory is not the repository root (or where SGLang
imported HF's ``kernels`` first) ``import kernels.cpu_attention`` fails. Until
the package is renamed, this module loads our files by path when the normal
import does not find them. Invariant: each module is loaded once per process.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


def load(name: str) -> ModuleType:
    """``kernels.<name>`` from this repository (``import`` first, then by path)."""
    try:
        mod = importlib.import_module(f"kernels.{name}")
    except ImportError:
        mod = None
    if mod is not None and Path(mod.__file__ or "").resolve().parent == KERNELS_DIR:
        return mod
    alias = f"bana_sglang._repo_kernels.{name}"
    if alias in sys.modules:
        return sys.modules[alias]
    spec = importlib.util.spec_from_file_location(alias, KERNELS_DIR / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {KERNELS_DIR / (name + '.py')}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    logger.info("loaded kernels.%s by path (another 'kernels' package shadows ours)", name)
    return mod


cpu_attention = load("cpu_attention")
merge = load("merge")
