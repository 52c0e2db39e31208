"""The typer application every command registers on, the two consoles, and what a run has said.

The app's help is plain (no rich markup before parsing) so that `--help` imports no torch and
answers at once. `err` takes every message for people, `out` the results; a JSON document goes to
stdout through `emit_json`, once per run.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from autotune import __version__

app = typer.Typer(
    name="autotune",
    help="Find the largest micro-batch that fits in GPU memory, exactly, and plan accumulation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: no `<bool>` column, no rich import before parsing
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
# emoji=False: a target like nwl:factory: would otherwise print a factory emoji. User text that
# goes through markup is escaped (rich.markup.escape), so `[batch, 16]` in a message survives.
err = Console(stderr=True, soft_wrap=True, emoji=False)
out = Console(soft_wrap=True, emoji=False)

emitted: list[bool] = []  # a JSON document went to stdout in this run (one document, never two)
debug_flag: list[bool] = []  # --debug was given in this run
command_started: list[float] = []  # when the command started (time.monotonic()): its process's start for `autotune`


def emit_json(text: str) -> None:
    sys.stdout.write(text + "\n")
    emitted.append(True)


def _version_callback(value: bool) -> None:
    if value:
        out.print(__version__, markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="On failure, print the full traceback (a workload's own error, from the probe's process too) "
            "before the one-line message.  " + "[default: AUTOTUNE_DEBUG, false]",
        ),
    ] = False,
) -> None:
    """Find the largest micro-batch that fits in GPU memory, exactly, and plan accumulation."""
    if debug:
        debug_flag.append(True)
