"""Environment defaults for every process that starts a Mooncake transfer engine.

Mooncake reads these at engine start-up; an operator's own values win
(``setdefault``). The TCP transport admits each slice of a transfer into a
per-peer queue of at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default
1024) slices and fails a slice that waits longer than
``MC_TCP_ADMISSION_TIMEOUT_MS`` (default 1 s) for a connection lane. One
publish of a prefill's pages is one batched put of up to ~60 pages x 17
slices (a header and K/V of each layer), more than 1024 slices; and on the
2-core CPU machine, where the receiving storage process competes with two
model workers, a slice often waits longer than 1 s. Those puts failed (their
pages were not published) and, now and then, a batch never completed: the
store client then polls it without sleeping for Mooncake's fixed 60 s
transfer timeout, taking a whole core from the workers. Raised limits let
slow slices queue instead of fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import MutableMapping
from pathlib import Path

DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",  # glog is very chatty otherwise
    "MC_TCP_ADMISSION_TIMEOUT_MS": "30000",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16384",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "16384",
}


def apply_defaults(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set each default in ``env`` (``os.environ`` when None) unless already set."""
    target = os.environ if env is None else env
    for k, v in DEFAULTS.items():
        target.setdefault(k, v)
    return target


def master_binary() -> str:
    """The ``mooncake_master`` executable: the one inside the installed ``mooncake``
    package (found without importing it), else one next to this interpreter, else on
    ``PATH``. A ``pip install --target`` puts neither the package's entry point next
    to ``sys.executable`` nor on ``PATH``, hence the package first."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin:
        inside = Path(spec.origin).parent / "mooncake_master"
        if inside.is_file() and os.access(inside, os.X_OK):
            return str(inside)
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file():
        return str(beside)
    return shutil.which("mooncake_master") or str(beside)
