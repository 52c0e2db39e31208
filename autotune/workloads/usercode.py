"""Errors raised by a workload's own code: where they were raised, in one line, and the traceback
for `--debug` (`AUTOTUNE_DEBUG=1`).

A workload's error reaches the user as one line; without a place, `KeyError: 'labels'` says little.
So the message names the last frame of the traceback that is the user's code (not autotune's, not
the standard library's, not an installed package's: torch, transformers), for example
`KeyError: 'labels' (at my_job.py:42 in loss)`, and the formatted traceback travels with the error
(`AutotuneError.traceback`, across the isolated child's pipe too) for `--debug` to print.
Nothing here imports torch.

A `KeyboardInterrupt` is such an error too when the workload's code raised it: only a SIGINT
(Ctrl-C) is an interrupt. `telling_interrupts_apart()` remembers whether one arrived, so that
`raised_by_code` can tell them apart.
"""

from __future__ import annotations

import os
import signal
import sysconfig
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
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


def shown(filename: str) -> str:
    """A path as the user wrote it: relative to the current directory when it is under it."""
    path = Path(filename).resolve()
    try:
        return str(path.relative_to(Path(os.getcwd()).resolve()))
    except ValueError:
        return str(path)


def where(exc: BaseException) -> str | None:
    """`file:line in function` of the last frame of `exc`'s traceback in the user's code, or None."""
    if isinstance(exc, SyntaxError) and exc.filename and _is_users(exc.filename):
        return f"{shown(exc.filename)}:{exc.lineno}"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _is_users(frame.filename):
            return f"{shown(frame.filename)}:{frame.lineno} in {frame.name}"
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


class _Interrupts:
    watching = 0  # 1 inside the outermost telling_interrupts_apart() that watches
    signalled = False  # a SIGINT arrived while watching


def _remember_then_raise(signum: int, frame: FrameType | None) -> None:
    _Interrupts.signalled = True
    signal.default_int_handler(signum, frame)


@contextmanager
def telling_interrupts_apart() -> Iterator[None]:
    """While the block runs, SIGINT still raises KeyboardInterrupt, and is remembered: a
    KeyboardInterrupt with no SIGINT behind it was raised by code (`raised_by_code`).

    Only where Python's own SIGINT handling is in force (or SIGINT is ignored, or kills the process,
    so that no KeyboardInterrupt comes from a signal): a caller's own handler may raise it for
    reasons we cannot see, and outside the main thread no handler can be set. There, every
    KeyboardInterrupt stays an interrupt."""
    current = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if _Interrupts.watching or current not in (signal.default_int_handler, signal.SIG_IGN, signal.SIG_DFL):
        yield  # nested (the outer block watches), a caller's own handler, or not the main thread
        return
    if current is signal.default_int_handler:
        signal.signal(signal.SIGINT, _remember_then_raise)
    _Interrupts.watching, _Interrupts.signalled = 1, False
    try:
        yield
    finally:
        _Interrupts.watching, _Interrupts.signalled = 0, False
        if current is signal.default_int_handler:
            signal.signal(signal.SIGINT, current)


def raised_by_code(exc: BaseException) -> bool:
    """Whether `exc` is a KeyboardInterrupt that code raised (a workload's `raise KeyboardInterrupt`),
    not a Ctrl-C: inside `telling_interrupts_apart()`, with no SIGINT arrived."""
    return isinstance(exc, KeyboardInterrupt) and _Interrupts.watching > 0 and not _Interrupts.signalled
