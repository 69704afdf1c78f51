"""Fixtures of the fast migration tests."""

from __future__ import annotations

import pytest
from support.agents import Running


@pytest.fixture
def pair():
    """Two agents in this process: prefill-0 (seed 1) and decode-0 (seed 2)."""
    x, y = Running("prefill-0", "prefill", 1), Running("decode-0", "decode", 2)
    yield x, y
    x.close()
    y.close()
