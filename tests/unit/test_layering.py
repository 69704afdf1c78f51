"""The package layering of bana_sglang, enforced.

``MAY_IMPORT`` is the rule (docs/ARCHITECTURE.md shows the same table, and a
test below keeps the two equal): each room of ``bana_sglang`` (a subpackage or
a top-level module) may import only the rooms listed for it (or, written
``room.module``, that one module of a room). Every import
counts, at any depth of a module (inside functions and ``TYPE_CHECKING``
blocks too), so a cycle cannot hide in a function body.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bana_sglang"

FOUNDATION = (
    "types",
    "envs",
    "registry",
    "counters",
    "_cli",
    "wire",
    "kernels",
    "models",
    "mooncake_env",
)
MAY_IMPORT: dict[str, frozenset[str]] = {
    **{room: frozenset({"envs"} - {room}) for room in FOUNDATION},
    "attention": frozenset({*FOUNDATION}),
    "radix_global": frozenset({*FOUNDATION}),
    "compat": frozenset({*FOUNDATION, "attention"}),
    "migrate": frozenset({*FOUNDATION, "attention", "radix_global"}),
    # the router asks agents for placements and forwards operators' commands (migrate.client is torch-free)
    "router": frozenset({*FOUNDATION, "radix_global", "migrate.client"}),
    "balancer": frozenset({*FOUNDATION}),
    "sim": frozenset({*FOUNDATION, "router", "balancer"}),
    "plugin": frozenset({*FOUNDATION, "attention", "compat", "radix_global", "migrate"}),
    "launch": frozenset({*FOUNDATION, "attention", "compat", "radix_global", "router", "balancer"}),
}
#: Processes that must never load torch (they start in milliseconds and serve many requests).
TORCH_FREE = (
    "bana_sglang.router.server",
    "bana_sglang.router.__main__",
    "bana_sglang.migrate.client",
    "bana_sglang.migrate.__main__",
    "bana_sglang.balancer.controller",
    "bana_sglang.balancer.server",
    "bana_sglang.wire.transport",
    "bana_sglang.wire.agent",
    "bana_sglang.wire.index",
    "bana_sglang.types",
    "bana_sglang.envs",
)


def room_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of bana_sglang in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                (node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "bana_sglang"
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "bana_sglang":
                continue
            if target == "bana_sglang":  # from bana_sglang import envs, wire: each name is a room
                out += [(node.lineno, f"bana_sglang.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return out


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "pypath" not in p.parts)


def test_every_room_is_in_the_rule():
    rooms = {room_of(p) for p in sources()} - {"__init__"}
    assert rooms == set(MAY_IMPORT), (
        f"rooms without a rule: {rooms - set(MAY_IMPORT)}; "
        f"rules without a room: {set(MAY_IMPORT) - rooms}"
    )


def test_no_import_runs_against_the_layering():
    bad = []
    for path in sources():
        room = room_of(path)
        if room == "__init__":
            continue
        for line, target in project_imports(path):
            parts = target.split(".")
            if len(parts) < 2:
                continue
            other = parts[1]
            if other.startswith("__"):  # the package's own metadata (__version__)
                continue
            allowed = MAY_IMPORT[room]
            if other != room and other not in allowed and ".".join(parts[1:3]) not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {target}")
    assert not bad, (
        "imports against the layering (tests/unit/test_layering.py MAY_IMPORT):\n" + "\n".join(bad)
    )


def test_the_layering_test_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: an upward import is found, relative imports are resolved."""
    fake = tmp_path / "bana_sglang"
    (fake / "wire").mkdir(parents=True)
    (fake / "wire" / "x.py").write_text("def f():\n    from ..router import server\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert project_imports(fake / "wire" / "x.py") == [(2, "bana_sglang.router")]
    with pytest.raises(AssertionError, match="wire imports bana_sglang.router"):
        test_no_import_runs_against_the_layering()


def test_torch_free_processes_do_not_import_torch():
    code = (
        "import importlib, sys\n"
        f"for m in {TORCH_FREE!r}: importlib.import_module(m)\n"
        "heavy = sorted(k for k in ('torch', 'sglang', 'mooncake') if k in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"these modules pull in {out.stdout.strip()}"


def test_architecture_doc_states_the_same_rule():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`[\w]+`", cells[0]):
            rows[cells[0].strip("`")] = frozenset(re.findall(r"`([\w.]+)`", cells[-1]))
    documented = {room: rows.get(room) for room in MAY_IMPORT}
    assert documented == dict(MAY_IMPORT), (
        "docs/ARCHITECTURE.md's package table differs from MAY_IMPORT"
    )
