"""The `autotune` command line: probe, plan, estimate, and the node's serve and devices.

Errors we expect (bad input, a probe that cannot answer) print one line and exit non-zero:
2 for bad input (a flag, an argument, an AUTOTUNE_* variable), 1 for a probe that failed, 4 for an
answer a fresh process did not confirm; 130 (Ctrl-C) or 143 (SIGTERM) for a command interrupted,
once its processes have exited: within a second wherever it is, and at once on a second signal
(`interrupts`); `serve` stops gracefully on either and exits 0. No traceback reaches the user; with
`--json`, stdout gets a JSON error document as well.

Every flag is checked before anything slow starts: torch, the workload and the probe machinery are
imported inside the commands, after the checks, so `--help`, `--version` and bad input answer at
once, and an output path that cannot be written is refused before the probe, not after it.

    app        the typer app, the consoles, the JSON document of a run
    options    every flag, declared once
    checks     the flags' and variables' checks; the probe's flags made a request
    outputs    the files a command writes (--save, --plot), checked before the probe
    probe      `autotune probe`          progress  its run, shown as it goes
    plan       `autotune plan`           summary   the words of a result, a plan, an estimate
    estimate   `autotune estimate`       service   `autotune serve` and `autotune devices`
    inventory  the devices table         interrupts  Ctrl-C and SIGTERM, for the whole command
    checkpointing  the words of --checkpointing auto's choice: each setting compared, and why

May import everything in `autotune`; `api` only in `serve` (it starts the service).
"""

from __future__ import annotations

# isort: off
# First: in the `autotune` command's process a signal during the imports below (a second or more on
# a loaded machine) ends it with one line, not a traceback; main() takes over from there.
from autotune.cli import interrupts

interrupts.guard_start()
# isort: on

import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import typer  # noqa: E402
from rich.markup import escape  # noqa: E402

from autotune import __version__  # noqa: E402
from autotune.cli.app import app, command_started, debug_flag, emit_json, emitted, err, out  # noqa: E402
from autotune.cli.progress import ProbeInterrupted  # noqa: E402
from autotune.errors import AutotuneError, ConfigError, DeviceError, ProbeError, report  # noqa: E402

# The command modules register their commands on the app as they are imported, in the help's order.
# isort: off
from autotune.cli import probe, plan, service, estimate  # noqa: F401, E402
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


def run(args: Sequence[str], *, started: float | None = None) -> int:
    """Run the CLI on `args` (without the program name) and return its exit code: 0, 1 when a probe
    (or the service, or a device) failed, 2 for bad input, 4 for an answer a fresh process did not
    confirm, 130/143 for a command interrupted by SIGINT/SIGTERM. Messages go to stderr, one line
    each. `started`: when the command started (time.monotonic()), for the summary's "in all"; by
    default, now."""
    args = list(args)
    as_json = _wants_json(args)
    emitted.clear()
    debug_flag.clear()
    command_started[:] = [time.monotonic() if started is None else started]
    interrupts.reset()
    interrupts.json_wanted(as_json)
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
        return _say_interrupted(exc.message, exc.trials, signum=exc.signum, as_json=as_json)
    except typer.Abort:
        err.print("aborted", highlight=False, markup=False)
        return 130
    except interrupts.Terminated:
        return _say_interrupted(*interrupts.line(signal.SIGTERM), signum=signal.SIGTERM, as_json=as_json)
    except Exception as exc:  # noqa: BLE001 - nobody classified it (a workload's error with --in-process): one line
        from autotune.workloads.usercode import unexpected

        error = unexpected(exc)
        return _fail(str(error), 1, failed, report(error), as_json, error)
    if code == interrupts.CODES[signal.SIGINT]:  # typer's answer to a KeyboardInterrupt outside a probe
        return _say_interrupted(*interrupts.line(signal.SIGINT), signum=signal.SIGINT, as_json=as_json)
    return code if isinstance(code, int) else 0


def _say_interrupted(message: str, trials: int = 0, *, signum: int, as_json: bool) -> int:
    """An interrupt's one line (and its JSON document), once its processes are gone."""
    interrupts.last_word()  # not the watchdog's too
    err.print(message, highlight=False, markup=False)
    if as_json and not emitted:
        emit_json(interrupts.error_document(message, signum, trials))
    return interrupts.CODES[signal.Signals(signum)]


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: exits with `run`'s code. Our errors and click's usage errors become one
    line on stderr (and a JSON error document on stdout with --json). Ctrl-C and SIGTERM are
    answered within a second wherever the command is, and a second one ends it at once
    (`autotune.cli.interrupts`); `serve` stops as the service stops (exit 0)."""
    args = list(sys.argv[1:] if argv is None else argv)
    started = _process_started()
    try:
        with interrupts.watched(watchdog=_command(args) != "serve"):
            code = run(args, started=started)
            # The answer is out: a signal from now on ends what is left at once and keeps its exit code.
            interrupts.answered(code)
            zygote = sys.modules.get("autotune.engine.zygote")  # a probe ran: its fork server waits
            if zygote is not None:
                with contextlib.suppress(KeyboardInterrupt, interrupts.Terminated):
                    zygote.close_idle()  # here, not at exit, where a Ctrl-C would print a traceback
    except KeyboardInterrupt:  # between run's own handlers: before or after them
        code = _say_interrupted(*interrupts.line(signal.SIGINT), signum=signal.SIGINT, as_json=_wants_json(args))
    except interrupts.Terminated:
        code = _say_interrupted(*interrupts.line(signal.SIGTERM), signum=signal.SIGTERM, as_json=_wants_json(args))
    interrupts.ignore()  # the interpreter's exit: a signal there would kill it (Python restores SIG_DFL)
    sys.exit(code)


def _command(args: Sequence[str]) -> str:
    words = args[: list(args).index("--")] if "--" in args else args
    return next((a for a in words if not a.startswith("-")), "")


def _process_started() -> float:
    """When this process started, on time.monotonic()'s clock: the interpreter's start and the
    imports count in the command's time. Now, where /proc cannot say."""
    import os

    now = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
            up = float(uptime.read().split()[0])
        age = up - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age if 0 <= age < 3600 else now
