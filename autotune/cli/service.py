"""`autotune serve` (the service on this node) and `autotune devices` (the GPUs NVML sees)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from autotune.cli.app import app, emit_json, err, out
from autotune.cli.checks import check_listen, load_settings
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
    host: Annotated[str, typer.Option(metavar="HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", min=1, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            metavar="N", min=1, max=64, help="Server processes on this node; they share the store (AUTOTUNE_DB)."
        ),
    ] = 1,
) -> None:
    """Run the autotune service (AUTOTUNE_* settings; needs the `server` extra).

    Exit codes: 0 when stopped (Ctrl-C, SIGTERM); 2 for bad input: a flag, an AUTOTUNE_* variable,
    the workloads file or the database, a --host or --port it cannot listen on (not an address of
    this machine, a port in use), or the server extra missing."""
    load_settings()
    try:
        from api.server import serve as run_server
    except ImportError as exc:
        raise ConfigError(
            f"the service needs autotune's server extra (fastapi, uvicorn, prometheus-client): {exc}"
        ) from None
    # Another process may take the port between this check and uvicorn's bind; that one race keeps
    # uvicorn's own words (exit 3 or 1).
    check_listen(host, port, workers)
    run_server(host=host, port=port, workers=workers)
