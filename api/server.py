"""`autotune serve`: listen, check the configuration, then run the app under uvicorn.

The port is bound and listening first: from then on a client that connects waits in the kernel's
backlog rather than being refused, and a refused connection is what a client takes for a service
that is down (the one case where it may probe on its own, `autotune.client`). Then the checks:
a bad workloads file or an unusable database (a damaged or empty SQLite file, an unreachable
PostgreSQL, a schema newer than this autotune) is one line on stderr and exit code 2, not a
traceback from inside the server's start-up. The schema is migrated by the server itself
(`api.app.create_served_app`), in the background, under the database's lock (once, whatever the
number of workers and nodes starting): `/healthz` answers meanwhile and `/readyz` says what it is
waiting for.

With `workers > 1` uvicorn runs that many processes on one port. They share everything that
matters through the store (jobs, leases, results); their Prometheus counts go to a fresh
directory that /metrics sums (PROMETHEUS_MULTIPROC_DIR).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile

BACKLOG = 2048  # uvicorn's default: connections that wait while the server starts


def preflight() -> None:
    """Open and check the database (no migration), load the workloads file. Raises ConfigError.
    The database first: it needs no torch, which the workloads' imports take seconds to load."""
    from autotune.errors import ConfigError, StoreError
    from autotune.settings import get_settings
    from autotune.store import Store

    settings = get_settings()
    try:
        Store(settings.db, migrate=False).close()
    except StoreError as exc:
        raise ConfigError(str(exc)) from None
    from autotune.workloads.registry import load_registry

    load_registry(settings.workloads)


def listen(host: str, port: int, workers: int) -> list[socket.socket]:
    """The listening sockets uvicorn will serve: every address of the host for one worker (as
    uvicorn binds by itself), one socket of the host's family for several (as uvicorn's
    supervisor binds), each listening now. TCP sockets made as IPPROTO_TCP: uvicorn binds with
    protocol 0, so asyncio never sets TCP_NODELAY on the connections they accept, and every
    keep-alive answer written in two pieces waits ~40 ms for the client's delayed ACK (uvicorn
    issue 3149)."""
    if workers > 1:  # as uvicorn's Config.bind_socket, without importing uvicorn first
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(BACKLOG)
        except OSError:
            listener.close()
            raise
        listener.set_inheritable(True)
        return [listener]
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            if any(s.family == family and s.getsockname()[:2] == address[:2] for s in sockets):
                continue
            sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def serve(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", workers: int = 1) -> None:
    """Run the service until interrupted."""
    listeners = listen(host, port, workers)  # first: from now on a connection waits, not refused
    shared = None
    try:
        import uvicorn
        from uvicorn.supervisors import Multiprocess

        preflight()
        logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
        # No access log: it costs more than a plan query itself; /metrics counts the requests.
        options = {
            "host": host,
            "port": port,
            "log_level": log_level,
            "access_log": False,
            "timeout_graceful_shutdown": 5,
            "backlog": BACKLOG,
        }
        if workers == 1:
            from api.app import create_served_app

            server = uvicorn.Server(uvicorn.Config(create_served_app(), **options))  # type: ignore[arg-type]
            server.run(sockets=listeners)
            return
        shared = tempfile.mkdtemp(prefix="autotune-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared
        os.environ["AUTOTUNE_LOG_LEVEL"] = log_level  # workers are spawned: they configure their own logging
        config = uvicorn.Config("api.app:create_served_app", factory=True, workers=workers, **options)  # type: ignore[arg-type]
        with contextlib.suppress(KeyboardInterrupt):
            Multiprocess(config, sockets=listeners).run()
    finally:
        for listener in listeners:
            listener.close()
        if shared is not None:
            shutil.rmtree(shared, ignore_errors=True)
