"""`autotune serve` (the service on this node) and `autotune devices` (the GPUs NVML sees).

`serve` stops gracefully on Ctrl-C (SIGINT) and SIGTERM and exits 0: the service finishes what it
was answering (uvicorn's graceful shutdown) and says it stopped; a second Ctrl-C cuts that short.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from autotune.cli.app import app, emit_json, err, out
from autotune.cli.checks import load_settings
from autotune.errors import ConfigError


@app.command(short_help="List the GPUs NVML sees, with memory and processes.")
def devices(
    json_output: Annotated[bool, typer.Option("--json", help="Print the inventory as one JSON document.")] = False,
) -> None:
    """List the GPUs NVML sees: memory (v2 with reserved where the driver has it), compute processes
    and MIG instances. Exits 1 when NVML cannot be read (the reason says why)."""
    from autotune.cli.inventory import print_inventory
    from autotune.devices.nvml import inventory

    inv = inventory()
    if json_output:
        emit_json(inv.model_dump_json(indent=2))
    else:
        print_inventory(inv, out, err)
    if not inv.available:
        sys.exit(1)  # not typer.Exit: main() runs click with standalone_mode=False, which drops its code


@app.command(short_help="Run the autotune service (needs the server extra).")
def serve(
    host: Annotated[str, typer.Option("--host", metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", metavar="PORT", min=1, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            metavar="N", min=1, max=64, help="Server processes on this node; they share the store (AUTOTUNE_DB)."
        ),
    ] = 1,
) -> None:
    """Run the autotune service (AUTOTUNE_* settings; needs the `server` extra).

    Exit codes: 0 when stopped (Ctrl-C, SIGTERM: it finishes what it is answering, then stops; a
    second Ctrl-C cuts that short); 2 for bad input: a flag, an AUTOTUNE_* variable, the workloads
    file or the database, a --host or --port it cannot listen on (not an address of this machine, a
    port in use), or the server extra missing."""
    with _stopping_gracefully() as stopped:
        try:
            load_settings()
            # Before the service's imports (seconds: FastAPI, the store, torch), so a bad flag answers at
            # once. Another process may take the port between this check and uvicorn's bind; that one
            # race keeps uvicorn's own words (exit 3 or 1).
            check_listen(host, port, workers)
            try:
                from api.server import serve as run_server
            except ImportError as exc:
                raise ConfigError(
                    f"the service needs autotune's server extra (fastapi, uvicorn, prometheus-client): {exc}"
                ) from None
            run_server(host=host, port=port, workers=workers)
        except _Stopped as stop:
            stopped.append(stop.signum)
    if stopped:
        err.print(f"autotune serve: stopped by {_WORDS[signal.Signals(stopped[0])]}", highlight=False, markup=False)


_WORDS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class _Stopped(BaseException):
    """SIGINT or SIGTERM for the service: before uvicorn runs (its start-up), or as uvicorn, having
    stopped gracefully, raises the signal it caught again (for the handler it found, this one)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def _stopping_gracefully() -> Iterator[list[int]]:
    """SIGINT and SIGTERM stop the service, exit 0: in the main thread, where a signal can be handled.
    uvicorn installs its own handlers while it serves (a graceful shutdown, then the signal raised
    again for the handler it found: this one, which turns it into the end of `serve`); with several
    workers, its supervisor stops them and returns."""
    stopped: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    previous = {number: signal.signal(number, _stop) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def check_listen(host: str, port: int, workers: int) -> None:
    """Refuse a --host or --port that the service could not listen on, before it starts (uvicorn
    would log its own words and exit 3): bind where uvicorn will bind, as it binds (SO_REUSEADDR, so
    that a port left in TIME_WAIT passes), and let go. One worker binds every address the host
    resolves to (asyncio's create_server); several share one socket of the host's family."""
    import errno
    import socket

    try:
        addresses: list[tuple[socket.AddressFamily, Any]]
        if workers > 1:  # uvicorn's Config.bind_socket
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            addresses = [(family, (host, port))]
        else:
            found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            addresses = list(dict.fromkeys((info[0], info[4]) for info in found))
        for family, address in addresses:
            with socket.socket(family, socket.SOCK_STREAM) as trial:
                trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    trial.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                trial.bind(address)
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host {host}: not an IP address or a name that resolves ({exc.strerror}); give one of this "
            "machine's addresses, 127.0.0.1 (this machine alone) or 0.0.0.0 (every interface)"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port {port}: address already in use on {host}; pick another port with --port or stop the "
                "process using it"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"--host {host}: not an address of this machine ({exc.strerror}); give one of its addresses, "
                "127.0.0.1 (this machine alone) or 0.0.0.0 (every interface)"
            ) from None
        if exc.errno == errno.EACCES and port < 1024:
            raise ConfigError(
                f"--port {port}: permission denied (ports below 1024 need privileges); pick a port from 1024 up "
                "with --port"
            ) from None
        raise ConfigError(
            f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick another --host or --port"
        ) from None
