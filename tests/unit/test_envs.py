"""The settings registry: one typed place for every BANA_* environment variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bana_sglang import envs

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_outside_envs_reads_a_bana_variable():
    reads = re.compile(
        r"""(environ\.get|getenv|environ\.setdefault)\(\s*["']BANA_|environ\[\s*["']BANA_\w+["']\s*\](?!\s*=)"""
    )
    bad = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in sorted((ROOT / "bana_sglang").rglob("*.py"))
        if "envs" not in p.relative_to(ROOT).parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert not bad, "read these through bana_sglang.envs:\n" + "\n".join(bad)


def test_every_bana_name_in_the_package_is_registered():
    names = set()
    for p in (ROOT / "bana_sglang").rglob("*.py"):
        names |= set(re.findall(r"\bBANA_[A-Z][A-Z0-9_]*\b", p.read_text()))
    names -= {"BANA_STANDIN"}  # an attribute of the CPU layer's sgl_kernel stand-in, not a variable
    assert names <= set(envs.REGISTRY), (
        f"not in bana_sglang/envs.py: {sorted(names - set(envs.REGISTRY))}"
    )


def test_the_readme_holds_the_current_table():
    assert envs.markdown_table() in (ROOT / "README.md").read_text(), (
        "README.md's settings table is stale: paste `python -m bana_sglang.envs`"
    )


def test_values_are_typed_and_defaulted_when_unset(monkeypatch):
    monkeypatch.delenv("BANA_INDEX_TIMEOUT_S", raising=False)
    assert envs.BANA_INDEX_TIMEOUT_S.get() == 0.5
    monkeypatch.setenv("BANA_INDEX_TIMEOUT_S", " 2.5 ")
    assert envs.BANA_INDEX_TIMEOUT_S.get() == 2.5
    monkeypatch.setenv("BANA_INDEX_TIMEOUT_S", "")
    assert envs.BANA_INDEX_TIMEOUT_S.get() == 0.5 and not envs.BANA_INDEX_TIMEOUT_S.is_set
    monkeypatch.setenv("BANA_MERGE_TRITON", "0")
    assert envs.BANA_MERGE_TRITON.get() is False
    monkeypatch.setenv("BANA_DEVICE", "CUDA")
    assert envs.BANA_DEVICE.get() == "cuda"


@pytest.mark.parametrize(
    "name, raw, words",
    [
        ("BANA_IDLE_POLL_MS", "fast", "an integer"),
        ("BANA_IDLE_POLL_MS", "-1", ">= 0"),
        ("BANA_DEVICE", "tpu", "cpu, cuda"),
        ("BANA_MERGE_TRITON", "maybe", "0 or 1"),
        ("BANA_INDEX_RETRY_S", "soon", "a number"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, name, raw, words):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name) as e:
        envs.REGISTRY[name].get()
    assert words in str(e.value)


def test_override_sets_and_restores(monkeypatch):
    monkeypatch.setenv("BANA_IDLE_POLL_MS", "7")
    with envs.override(BANA_IDLE_POLL_MS=0, BANA_MERGE_TRITON=False):
        assert envs.BANA_IDLE_POLL_MS.get() == 0 and envs.BANA_MERGE_TRITON.get() is False
    assert envs.BANA_IDLE_POLL_MS.get() == 7
    with pytest.raises(KeyError, match="unknown setting"), envs.override(BANA_NOPE=1):
        pass


def test_names_are_unique_and_prefixed():
    with pytest.raises(ValueError, match="registered twice"):
        envs.EnvVar("BANA_DEVICE", str, "", "again")
    with pytest.raises(ValueError, match="BANA_"):
        envs.EnvVar("OTHER", str, "", "no prefix")
