"""Mooncake environment defaults: set where missing, never over an operator's value,
and handed to every SGLang worker the launcher starts."""

from __future__ import annotations

from bana_sglang import compat
from bana_sglang.mooncake_env import DEFAULTS, apply_defaults


def test_defaults_fill_gaps_and_keep_operator_values():
    env = {"MC_TCP_ADMISSION_TIMEOUT_MS": "5000"}
    apply_defaults(env)
    assert env["MC_TCP_ADMISSION_TIMEOUT_MS"] == "5000"
    assert int(env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"]) > 1024  # Mooncake's own default
    assert int(env["MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"]) > 1024
    assert set(DEFAULTS) <= set(env)


def test_worker_environment_carries_the_tcp_limits():
    env = compat.child_env({"PATH": "/usr/bin"})
    assert env["MC_TCP_ADMISSION_TIMEOUT_MS"] == DEFAULTS["MC_TCP_ADMISSION_TIMEOUT_MS"]
    assert int(env["MC_TCP_ADMISSION_TIMEOUT_MS"]) > 1000  # Mooncake's own default: 1 s
    assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
