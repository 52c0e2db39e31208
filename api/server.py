"""`autotune serve`: check the configuration, prepare the store, then run the app under uvicorn.

The checks run before uvicorn starts so that a bad workloads file or an unusable database (a
damaged or empty SQLite file, an unreachable PostgreSQL) is one line on stderr and exit code 2,
not a traceback from inside the server's start-up. The schema is migrated here, once, before any
worker starts; workers then find it current.

With `workers > 1` uvicorn runs that many processes on one port. They share everything that
matters through the store (jobs, leases, results); their Prometheus counts go to a fresh
directory that /metrics sums (PROMETHEUS_MULTIPROC_DIR).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from autotune.errors import ConfigError, StoreError
from autotune.registry import load_registry
from autotune.settings import get_settings
from autotune.store import Store


def preflight() -> None:
    """Load the workloads file, open and migrate the database once. Raises ConfigError."""
    settings = get_settings()
    load_registry(settings.workloads)
    try:
        Store(settings.db).close()
    except StoreError as exc:
        raise ConfigError(str(exc)) from None


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", workers: int = 1) -> None:
    """Run the service until interrupted."""
    import uvicorn

    preflight()
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    # No access log: it costs more than a plan query itself; /metrics counts the requests.
    options = {"host": host, "port": port, "log_level": log_level, "access_log": False, "timeout_graceful_shutdown": 5}
    if workers == 1:
        from api.app import create_app

        uvicorn.run(create_app(), **options)  # type: ignore[arg-type]
        return
    shared = tempfile.mkdtemp(prefix="autotune-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared
    try:
        uvicorn.run("api.app:create_app", factory=True, workers=workers, **options)  # type: ignore[arg-type]
    finally:
        shutil.rmtree(shared, ignore_errors=True)
