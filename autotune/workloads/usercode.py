"""Errors raised by a workload's own code: where they were raised, in one line, and the traceback
for `--debug` (`AUTOTUNE_DEBUG=1`).

A workload's error reaches the user as one line; without a place, `KeyError: 'labels'` says little.
So the message names the last frame of the traceback that is the user's code (not autotune's, not
the standard library's, not an installed package's: torch, transformers), for example
`KeyError: 'labels' (at my_job.py:42 in loss)`, and the formatted traceback travels with the error
(`AutotuneError.traceback`, across the isolated child's pipe too) for `--debug` to print.
Nothing here imports torch.

Called in the user's own process (an integration inside their training script), an error is raised
as Python prints it, so it must read as short: `for_the_caller` raises the exception the job's code
raised itself (its type, so `except KeyError` still works) with only the user's frames and the one
that raised it, and autotune's line as a note; autotune's own errors lose the frames inside
autotune (AUTOTUNE_DEBUG keeps every frame). `users_tracebacks` keeps those frames across
`autotune.engine.oom.release`, which drops the tracebacks to free a failed step's tensors.

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
from types import FrameType, TracebackType
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


def _frames(tb: TracebackType | None) -> list[TracebackType]:
    found = []
    while tb is not None:
        found.append(tb)
        tb = tb.tb_next
    return found


def users_traceback(tb: TracebackType | None) -> TracebackType | None:
    """`tb`'s frames in the user's code, and its innermost frame (where the error was raised, even in
    a library), linked anew: the traceback a person reads, without autotune's frames or a
    framework's between them."""
    frames = _frames(tb)
    kept = [t for t in frames[:-1] if _is_users(t.tb_frame.f_code.co_filename)] + frames[-1:]
    linked = None
    for t in reversed(kept):
        linked = TracebackType(linked, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return linked


def chain(exc: BaseException | None) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, outermost first."""
    found: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in found):
        found.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return found


def users_tracebacks(exc: BaseException) -> list[tuple[BaseException, TracebackType | None]]:
    """Each exception of `exc`'s chain with its `users_traceback`: taken before the frames are
    released, given back with `restore`."""
    return [(e, users_traceback(e.__traceback__)) for e in chain(exc)]


def restore(kept: list[tuple[BaseException, TracebackType | None]]) -> None:
    for exc, tb in kept:
        exc.__traceback__ = tb


def raised_by_the_job(exc: BaseException) -> bool:
    """Whether `exc` was raised by the job's code (the user's, or a library of theirs such as
    transformers) rather than autotune's: the innermost frame that is neither torch's nor the
    standard library's is not autotune's."""
    for tb in reversed(_frames(exc.__traceback__)):
        filename = tb.tb_frame.f_code.co_filename
        if filename.startswith("<"):
            continue
        path = Path(filename).resolve()
        if path.is_relative_to(_AUTOTUNE):
            return False
        if _is_users(filename):
            return True
        parts = path.parts
        packages = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
        if packages and packages[-1] + 1 < len(parts) and parts[packages[-1] + 1] != "torch":
            return True  # a library of the job's
    return False


def for_the_caller(error: AutotuneError, *notes: str, debug: bool = False) -> BaseException:
    """What an API running in the user's process raises for `error`: the exception the job's code
    raised, when `error` stands for one (its cause, outside autotune), with only the user's frames
    and the one that raised it, and `autotune: <error>` and `notes` as notes; otherwise `error`
    itself, with no frame inside autotune (and its cause's frames cut the same way). With `debug`
    (AUTOTUNE_DEBUG), every frame stays."""
    if debug:
        return error
    causes = chain(error)[1:]
    theirs = next((e for e in causes if not isinstance(e, AutotuneError)), None)
    if theirs is not None and raised_by_the_job(theirs):
        theirs.__traceback__ = users_traceback(theirs.__traceback__)
        for note in (f"autotune: {_innermost_ours(error, theirs)}", *notes):
            theirs.add_note(note)
        return theirs
    for cause in causes:
        cause.__traceback__ = users_traceback(cause.__traceback__)
    for note in notes:
        error.add_note(note)
    return error.with_traceback(None)


def _innermost_ours(error: AutotuneError, theirs: BaseException) -> AutotuneError:
    """The autotune error closest to the job's: the one that says what autotune was doing (collating
    sample 3) rather than the trial that ran it."""
    ours = error
    for e in chain(error):
        if e is theirs:
            break
        if isinstance(e, AutotuneError):
            ours = e
    return ours


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
