"""The `autotune` command line: probe, plan, estimate, and the node's serve and devices.

Errors we expect (bad input, a probe that cannot answer) print one line and exit non-zero:
2 for bad input (a flag, an argument, an AUTOTUNE_* variable), 1 for a probe that failed; 130
(Ctrl-C) or 143 (SIGTERM) for a probe interrupted, once its processes have exited. No traceback
reaches the user; with `--json`, stdout gets a JSON error document as well.

Every flag is checked before anything slow starts: torch, the workload and the probe machinery are
imported inside the commands, after the checks, so `--help`, `--version` and bad input answer at
once, and an output path that cannot be written is refused before the probe, not after it.

    app        the typer app, the consoles, the JSON document of a run
    options    every flag, declared once
    checks     the flags' and variables' checks; the probe's flags made a request
    probe      `autotune probe`          progress  its run, shown as it goes
    plan       `autotune plan`           summary   the words of a result, a plan, an estimate
    estimate   `autotune estimate`       service   `autotune serve` and `autotune devices`
    inventory  the devices table

May import everything in `autotune`; `api` only in `serve` (it starts the service).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import typer
from rich.markup import escape

from autotune import __version__
from autotune.cli.app import app, debug_flag, emit_json, emitted, err, out
from autotune.cli.progress import ProbeInterrupted
from autotune.errors import AutotuneError, ConfigError, DeviceError, ProbeError, report

# The command modules register their commands on the app as they are imported, in the help's order.
# isort: off
from autotune.cli import probe, plan, service, estimate  # noqa: F401
# isort: on

__all__ = ["app", "main", "run"]


# Click's exception classes (recent typer vendors click, older typer uses click itself), found from a
# public name so that this works with both.
@app.command(short_help="Print the version.")
def version() -> None:
    """Print the version (as --version does)."""
    out.print(__version__, markup=False, highlight=False)


_CLICK_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _wants_json(args: Sequence[str]) -> bool:
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def _debugging() -> bool:
    if debug_flag:
        return True
    from autotune.settings import get_settings

    try:
        return get_settings().debug
    except (AutotuneError, ValueError):  # a bad AUTOTUNE_* variable: its own error says so
        return False


def _fail(
    message: str, code: int, label: str, data: dict[str, Any], as_json: bool, exc: BaseException | None = None
) -> int:
    if exc is not None and _debugging():
        import traceback

        # The user's code's traceback (a workload's error, maybe from the probe's process), or ours.
        text = getattr(exc, "traceback", None) or "".join(traceback.format_exception(exc))
        err.print(text.rstrip("\n"), highlight=False, markup=False)
    err.print(f"[red]{label}:[/] {escape(message)}", highlight=False)
    if as_json and not emitted:  # after the result (a plot or publish failed), stderr says it
        emit_json(json.dumps({"error": {**data, "exit_code": code}}, indent=2))
    return code


def run(args: Sequence[str]) -> int:
    """Run the CLI on `args` (without the program name) and return its exit code: 0, 1 when a probe
    (or the service, or a device) failed, 2 for bad input, 130/143 for a probe interrupted by
    SIGINT/SIGTERM. Messages go to stderr, one line each."""
    args = list(args)
    as_json = _wants_json(args)
    emitted.clear()
    debug_flag.clear()
    split = args.index("--") if "--" in args else len(args)
    if "--debug" in args[:split]:  # a root option, also taken after the command, where people type it
        args = [a for a in args[:split] if a != "--debug"] + args[split:]
        debug_flag.append(True)
    # "probe failed: ...", "estimate failed: ...": the command named, as the user typed it.
    command = next((a for a in (args[: args.index("--")] if "--" in args else args) if not a.startswith("-")), "")
    failed = f"{command} failed" if command == "estimate" else "probe failed"
    from autotune.workloads.usercode import telling_interrupts_apart

    with telling_interrupts_apart():
        return _run(args, as_json, failed)


def _run(args: list[str], as_json: bool, failed: str) -> int:
    try:
        code = typer.main.get_command(app).main(args, prog_name="autotune", standalone_mode=False)
    except (ConfigError, DeviceError) as exc:  # a device that does not exist here is bad input too
        return _fail(str(exc), 2, "error", report(exc), as_json, exc)
    except ProbeError as exc:
        return _fail(str(exc), 1, failed, report(exc), as_json, exc)
    except AutotuneError as exc:
        return _fail(str(exc), 1, "error", report(exc), as_json, exc)
    except _CLICK_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `autotune`: the help, as click prints it
            exc.show()  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", 2))
        message = " ".join(exc.format_message().split()).rstrip(".")  # type: ignore[attr-defined]
        context = getattr(exc, "ctx", None)
        where = f"; see '{context.command_path} --help'" if context is not None else ""
        data = {"type": "UsageError", "message": message}
        return _fail(message + where, int(getattr(exc, "exit_code", 2)), "error", data, as_json)
    except ProbeInterrupted as exc:  # its processes are gone: one line, and the JSON document
        err.print(exc.message, highlight=False, markup=False)
        if as_json and not emitted:
            document = {
                "type": "Interrupted",
                "message": exc.message,
                "signal": exc.signal_name,
                "trials": exc.trials,
                "exit_code": exc.code,
            }
            emit_json(json.dumps({"error": document}, indent=2))
        return exc.code
    except typer.Abort:
        err.print("aborted", highlight=False, markup=False)
        return 130
    except Exception as exc:  # noqa: BLE001 - nobody classified it (a workload's error with --in-process): one line
        from autotune.workloads.usercode import unexpected

        error = unexpected(exc)
        return _fail(str(error), 1, failed, report(error), as_json, error)
    return code if isinstance(code, int) else 0


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: exits with `run`'s code. Our errors and click's usage errors become one
    line on stderr (and a JSON error document on stdout with --json)."""
    sys.exit(run(sys.argv[1:] if argv is None else argv))
