"""Shared fixtures and the order of the live tests.

Tests run on CPU by default; GPU tests are marked ``gpu`` and skipped without
CUDA; everything under ``tests/live/`` starts real SGLang processes and is
marked ``slow`` here (it still runs in CI: real parts, really run). The
helpers the test modules import live in ``tests/support/``.

Clusters shared by several live modules are session-scoped fixtures below, one
per configuration (``SHARED_CLUSTERS``). So that each one is up for a single
stretch of the run, the live modules that use it run one after another, where
the first of them stands in file order; a test marked ``stops_shared_cluster``
(it stops or breaks the cluster) runs after every other test on it; and the
cluster is stopped as soon as its last test is done.

``pd_1p1d_keyed`` (1 prefill + 1 decode worker behind the router, admin API
key ``support.migrate.KEY``, short migration timeouts): ``test_cluster.py``
(the OpenAI endpoint, clients, bad input, memory: nothing it does changes the
workers' state beyond their prefix caches) and ``test_migrate_live.py`` (every
layer migration ends recalled or restored, a frozen guest is resumed, and each
test checks the cluster still serves the plain tokens), then
``test_cluster.py``'s SIGTERM test, which stops it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.cluster import LaunchedCluster, launched_cluster, sglang_server
from support.migrate import KEY as MIGRATE_KEY

from bana_sglang import models
from bana_sglang.wire import security

# Every SGLang process of the suite (the plain reference server and the
# clusters' workers) computes with one OpenMP thread: the same floats whatever
# the machine's core count, and no oversubscription of a small CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# One cluster secret for the whole run: every cluster the suite starts (as a
# subprocess or in-process) and every ZMQ client the tests open use it, so every
# control channel runs CurveZMQ here as in production. A test that needs plain
# ZMQ or another secret sets the variable itself (monkeypatch).
_SECRET_DIR = tempfile.mkdtemp(prefix="bana-test-secret-")
os.environ.setdefault(
    "BANA_CLUSTER_SECRET_FILE",
    str(security.create_secret_file(Path(_SECRET_DIR) / "cluster.secret")),
)

LIVE = Path(__file__).resolve().parent / "live"
SHARED_CLUSTERS = ("pd_1p1d_keyed",)
STOPS = "stops_shared_cluster"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{STOPS}: stops or breaks the shared cluster it uses; runs after every other test on it",
    )


def _is_live(item) -> bool:
    return Path(str(item.fspath)).is_relative_to(LIVE)


def _live_order(items: list) -> list:
    """Modules sharing a cluster next to each other, each group where its first
    module stands; in a group, the tests marked ``stops_shared_cluster`` last."""
    modules: dict[Path, list] = {}
    for item in items:
        modules.setdefault(Path(str(item.fspath)), []).append(item)

    def shared(module: Path) -> set[str]:
        return {n for it in modules[module] for n in it.fixturenames if n in SHARED_CLUSTERS}

    out: list = []
    placed: set[Path] = set()
    for module in modules:
        if module in placed:
            continue
        names = shared(module)
        group = [m for m in modules if m not in placed and (m == module or shared(m) & names)]
        placed.update(group)
        grouped = [it for m in group for it in modules[m]]
        last = [it for it in grouped if it.get_closest_marker(STOPS)]
        out += [it for it in grouped if it.get_closest_marker(STOPS) is None] + last
    return out


def pytest_collection_modifyitems(config, items):
    for item in items:  # everything under tests/live/ starts real servers
        if _is_live(item):
            item.add_marker(pytest.mark.slow)
    where = [k for k, item in enumerate(items) if _is_live(item)]
    for k, item in zip(where, _live_order([items[k] for k in where])):
        items[k] = item
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ------------------------------------------------------------------ shared clusters
_OPEN: dict[str, contextlib.ExitStack] = {}  # shared cluster name -> what stops it
_LAST_USER: dict[str, str] = {}  # shared cluster name -> node id of the last test using it


def pytest_collection_finish(session):
    for item in session.items:  # the final order and selection
        for name in item.fixturenames:
            if name in SHARED_CLUSTERS:
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    for name, last in _LAST_USER.items():
        if last == item.nodeid and name in _OPEN:
            _OPEN.pop(name).close()  # its last test is done: free the machine for the next ones


def _shared(request, name: str, cm: contextlib.AbstractContextManager):
    stack = contextlib.ExitStack()
    value = stack.enter_context(cm)
    _OPEN[name] = stack
    request.addfinalizer(stack.close)  # a second close (after the early one) does nothing
    return value


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The embedded tiny Llama (built once, cached)."""
    return models.build("tiny")


@pytest.fixture(scope="session")
def single_server(tiny_model: Path, tmp_path_factory) -> Iterator[str]:
    """One plain SGLang server on the tiny model, shared by the whole session:
    the reference for every "same tokens as a plain run" check."""
    with sglang_server(
        tiny_model, log_dir=tmp_path_factory.getbasetemp() / "single-logs", name="single"
    ) as url:
        yield url


@pytest.fixture(scope="session")
def pd_1p1d_keyed(tiny_model: Path, tmp_path_factory, request) -> LaunchedCluster:
    """``python -m bana_sglang.launch --num-prefill 1 --num-decode 1 --api-key KEY``
    (``support.migrate.KEY``). A guest silent for 8 s (a step) or 10 s (a peer) is
    gone: the migration failure tests stop one with SIGSTOP."""
    return _shared(
        request,
        "pd_1p1d_keyed",
        launched_cluster(
            ["--num-prefill", "1", "--num-decode", "1", "--api-key", MIGRATE_KEY],
            tmp_path_factory.mktemp("pd-1p1d-keyed-logs"),
            env={"BANA_MIGRATE_STEP_TIMEOUT_S": "8", "BANA_MIGRATE_PEER_TIMEOUT_S": "10"},
        ),
    )


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(_SECRET_DIR, ignore_errors=True)
