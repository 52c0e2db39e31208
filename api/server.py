"""`autotune serve`: check the configuration, then run the app under uvicorn.

The checks run before uvicorn starts so that a bad workloads file or an unusable database is one
line on stderr and exit code 2, not a traceback from inside the server's start-up.
"""

from __future__ import annotations

import logging

from autotune.errors import ConfigError
from autotune.registry import load_registry
from autotune.settings import get_settings
from autotune.store import Store, StoreError


def preflight() -> None:
    """Load the workloads file and open the database once. Raises ConfigError."""
    settings = get_settings()
    load_registry(settings.workloads)
    try:
        Store(settings.db, recover=False).close()
    except StoreError as exc:
        raise ConfigError(str(exc)) from None


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the service until interrupted. One process: jobs and caches live in its memory."""
    import uvicorn

    from api.app import create_app

    preflight()
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    # No access log: it costs more than a plan query itself; /metrics counts the requests.
    uvicorn.run(create_app(), host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
