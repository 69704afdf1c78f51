"""SGLang's frontend from the project's virtual environment, as a user runs it: a
fresh interpreter with a clean environment (no PYTHONPATH, nothing of the suite's)
imports ``sglang`` and runs an ``sgl.function`` with ``select`` and ``gen``
against a plain server; the answer equals the same program run in this process.

On CPU this needs the torchvision import fix in every interpreter of the venv
(``scripts/setup.sh`` installs it as a ``.pth`` start-up line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROGRAM = """
import json, sys
import sglang as sgl

@sgl.function
def pick(s):
    s += "Question: is a prefix cache useful? Answer: "
    s += sgl.select("choice", choices=["yes", "no", "maybe"])
    s += " because " + sgl.gen("why", max_tokens=8, temperature=0)

state = pick.run(backend=sgl.RuntimeEndpoint(sys.argv[1]))
print(json.dumps({"choice": state["choice"], "why": state["why"]}))
"""


def fresh(code: str, *args: str) -> str:
    """``code`` in a fresh interpreter of the venv with a clean environment; its last line."""
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_import_sglang_in_a_fresh_interpreter():
    assert fresh("import sglang; print(sglang.__version__)") == "0.5.23"


def test_a_frontend_program_from_the_venv_matches_one_run_here(single_server):
    got = json.loads(fresh(PROGRAM, single_server))
    scope: dict = {}
    sys_argv, sys.argv = sys.argv, ["program", single_server]
    try:
        exec(compile(PROGRAM.replace("print(", "result = ("), "program", "exec"), scope)
    finally:
        sys.argv = sys_argv
    assert got["choice"] in ("yes", "no", "maybe")
    assert got == json.loads(scope["result"])
