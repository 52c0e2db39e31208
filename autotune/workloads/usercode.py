"""Errors raised by a workload's own code: where they were raised, in one line, and the traceback
for `--debug` (`AUTOTUNE_DEBUG=1`).

A workload's error reaches the user as one line; without a place, `KeyError: 'labels'` says little.
So the message names the last frame of the traceback that is the user's code (not autotune's, not
the standard library's, not an installed package's: torch, transformers), for example
`KeyError: 'labels' (at my_job.py:42 in loss)`, and the formatted traceback travels with the error
(`AutotuneError.traceback`, across the isolated child's pipe too) for `--debug` to print.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path
from typing import TypeVar

from autotune.errors import AutotuneError, ProbeError

E = TypeVar("E", bound=AutotuneError)

_AUTOTUNE = Path(__file__).resolve().parent.parent  # the autotune package, not this subpackage
_LIBRARIES = tuple(
    {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = Path(filename).resolve()
    if path.is_relative_to(_AUTOTUNE) or {"site-packages", "dist-packages"} & set(path.parts):
        return False
    return not any(path.is_relative_to(library) for library in _LIBRARIES)


def _shown(filename: str) -> str:
    """A path as the user wrote it: relative to the current directory when it is under it."""
    path = Path(filename).resolve()
    try:
        return str(path.relative_to(Path(os.getcwd()).resolve()))
    except ValueError:
        return str(path)


def where(exc: BaseException) -> str | None:
    """`file:line in function` of the last frame of `exc`'s traceback in the user's code, or None."""
    if isinstance(exc, SyntaxError) and exc.filename and _is_users(exc.filename):
        return f"{_shown(exc.filename)}:{exc.lineno}"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _is_users(frame.filename):
            return f"{_shown(frame.filename)}:{frame.lineno} in {frame.name}"
    return None


def describe(exc: BaseException) -> str:
    """`KeyError: 'labels' (at my_job.py:42 in loss)`: the error, and where the user's code raised it."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    at = where(exc)
    return f"{text} (at {at})" if at else text


def formatted(exc: BaseException) -> str:
    """The full traceback, as Python prints it."""
    return "".join(traceback.format_exception(exc))


def attach(error: E, exc: BaseException) -> E:
    """`error` carrying `exc`'s formatted traceback (for --debug)."""
    error.traceback = formatted(exc)
    return error


def unexpected(exc: BaseException) -> ProbeError:
    """An error nobody classified, as one line: a workload's (with where it was raised) or, when no
    frame is the user's, one inside autotune or a library, with the way to its traceback."""
    if where(exc) is not None:
        message = f"workload error: {describe(exc)}"
    else:
        message = f"{describe(exc)} (raised outside your code: rerun with --debug for the traceback)"
    return attach(ProbeError(message), exc)
