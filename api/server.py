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
import socket
import tempfile

from autotune.errors import ConfigError, StoreError
from autotune.settings import get_settings
from autotune.store import Store
from autotune.workloads.registry import load_registry


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
    from uvicorn.supervisors import Multiprocess

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
    os.environ["AUTOTUNE_LOG_LEVEL"] = log_level  # workers are spawned: they configure their own logging
    config = uvicorn.Config("api.app:create_app", factory=True, workers=workers, **options)  # type: ignore[arg-type]
    bound = config.bind_socket()
    # uvicorn binds with protocol 0, so asyncio never sets TCP_NODELAY on the connections the
    # workers accept, and every keep-alive answer written in two pieces waits ~40 ms for the
    # client's delayed ACK (uvicorn issue 3149): the same socket, re-made as IPPROTO_TCP.
    listener = socket.socket(bound.family, bound.type, socket.IPPROTO_TCP, fileno=bound.detach())
    try:
        Multiprocess(config, sockets=[listener]).run()
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
        shutil.rmtree(shared, ignore_errors=True)
