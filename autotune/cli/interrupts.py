"""Ctrl-C and SIGTERM for the command line: a command answers either within a second, wherever it
is, with one line and no traceback (exit 130 for SIGINT, 143 for SIGTERM), and a second signal ends
it at once.

    guard_start()  the first thing `autotune.cli` runs in an `autotune` command's process: a signal
                   while the command line's own modules import (a second or more on a loaded
                   machine) ends the command with one line, where Python would print a traceback
    watched()      `main()`'s, for the whole command: SIGTERM raises as Ctrl-C does (the command
                   ends its processes and says how far it got), and a watchdog thread hears every
                   signal as it arrives (`signal.set_wakeup_fd`: whatever Python handler runs, one
                   that holds it too). A second signal, or a first one that the command has not
                   answered within GRACE_SECONDS (a probe's start-up, while its fork server imports
                   torch and the signal is held), ends the command's processes and the command,
                   with the same line.
    saying()       what the line says while a probe runs (its trials, the one running)

`serve` is not watched: it stops as the service stops, gracefully (`autotune.cli.service`).
Nothing here imports more than the standard library: it runs before the command line's imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

GRACE_SECONDS = 0.5  # a first signal not answered by then is answered by the watchdog
_REAP_SECONDS = 0.3  # the forced end waits this long for the processes it killed
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Terminated(BaseException):
    """SIGTERM during a command, raised in the main thread (a BaseException: no `except Exception`
    in a trial may take it for the workload's error)."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


# Where the command is, for the line (the probe's own says its trials: `saying`).
Describe = Callable[[int], tuple[str, int]]  # signal -> (the line, trials done)
_state: dict[str, Any] = {"where": "", "describe": None, "json": False, "dog": None, "answered": None}


def where(words: str) -> None:
    """Where the command is, in the line an interrupt prints: "before the probe started"."""
    _state["where"] = words


def json_wanted(wanted: bool) -> None:
    _state["json"] = wanted


def reset() -> None:
    _state.update(where="", describe=None, json=False, answered=None)


def answered(code: int) -> None:
    """The command has answered (its output is complete, `code` its exit code): from now an
    interrupt ends what is left (its processes) and keeps the code, with no line."""
    _state["answered"] = code


def ignore() -> None:
    """SIGINT and SIGTERM ignored, for the interpreter's exit after the command: Python puts back
    the default actions as it finalizes (a Ctrl-C there would kill it), but leaves an ignored one.
    Only in the `autotune` command's own process (not a program that calls `main()`)."""
    if threading.current_thread() is threading.main_thread() and _invoked_as_command():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def saying(describe: Describe) -> Iterator[None]:
    """While the block runs, an interrupt's line is `describe(signal)`'s (a probe: its trials)."""
    _state["describe"] = describe
    try:
        yield
    finally:
        _state["describe"] = None


def line(signum: int) -> tuple[str, int]:
    """The line an interrupt by `signum` prints now, and the trials done."""
    describe = _state["describe"]
    if describe is not None:
        return describe(signum)
    at = f" {_state['where']}" if _state["where"] else ""
    return f"interrupted by {WORDS.get(signal.Signals(signum), signal.Signals(signum).name)}{at}", 0


def error_document(message: str, signum: int, trials: int) -> str:
    """The JSON error document of an interrupt (`--json`)."""
    document = {
        "type": "Interrupted",
        "message": message,
        "signal": signal.Signals(signum).name,
        "trials": trials,
        "exit_code": CODES.get(signal.Signals(signum), 128 + signum),
    }
    return json.dumps({"error": document}, indent=2)


# Before the imports -------------------------------------------------------------------------------
def _invoked_as_command() -> bool:
    """Whether this process is the `autotune` command (its script, or `python -m autotune.cli`),
    not a program that imports autotune.cli (a test, a script calling `autotune.cli.run`)."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv[1:-1]:
        return argv[argv.index("-m", 1) + 1] in ("autotune.cli", "autotune.cli.__main__")
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return os.path.basename(script) == "autotune"


def _ended_while_starting(signum: int, frame: object) -> None:
    words = WORDS.get(signal.Signals(signum), signal.Signals(signum).name)
    if next((a for a in sys.argv[1:] if not a.startswith("-")), "") == "serve":  # the service stops: exit 0
        os.write(2, f"autotune serve: stopped by {words} before it started\n".encode())
        os._exit(0)
    os.write(2, f"interrupted by {words} while the command was starting: nothing had run\n".encode())
    os._exit(CODES.get(signal.Signals(signum), 128 + signum))


def guard_start() -> None:
    """In the `autotune` command's process, from now until `watched()`: SIGINT or SIGTERM ends it at
    once with one line (nothing has started that would need ending)."""
    if threading.current_thread() is not threading.main_thread() or not _invoked_as_command():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _ended_while_starting)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _ended_while_starting)


# While the command runs ---------------------------------------------------------------------------
class _Watchdog:
    """Hears every SIGINT and SIGTERM from the wakeup pipe; ends the command when a second comes, or
    when the first has not been answered within GRACE_SECONDS."""

    def __init__(self, read_end: int, write_end: int) -> None:
        self.read_end, self.write_end = read_end, write_end
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.said = False  # the interrupt's line has been printed (by the command, or here)
        self.thread = threading.Thread(target=self._watch, name="autotune-interrupts", daemon=True)

    def _watch(self) -> None:
        import select

        heard: list[int] = []
        deadline: float | None = None
        poll = select.poll()
        poll.register(self.read_end, select.POLLIN)
        while not self.finished.is_set():
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if poll.poll(None if wait is None else wait * 1000):
                try:
                    data = os.read(self.read_end, 64)
                except OSError:
                    return
                heard += [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
                if len(heard) >= 2:
                    self._end(heard[0])
                elif heard and deadline is None:
                    deadline = time.monotonic() + GRACE_SECONDS
            elif deadline is not None and time.monotonic() >= deadline:
                self._end(heard[0])

    def _end(self, signum: int) -> None:
        code = CODES.get(signal.Signals(signum), 128 + signum)
        with self.lock:
            if self.finished.is_set():  # the command has ended meanwhile
                return
            if _state["answered"] is not None:  # its output is complete: it keeps its code, and says nothing
                code, self.said = _state["answered"], True
            try:
                said = None if self.said else line(signum)  # first: the main thread moves on as its processes die
                self.said = True
                kill_children()
                if said is not None:
                    _say_here(signum, *said)
            finally:
                os._exit(code)


def _say_here(signum: int, message: str, trials: int) -> None:
    """The interrupt's line (and --json's document), written past every buffer and lock: the main
    thread may be anywhere."""
    text = message + "\n"
    if os.isatty(2):
        text = "\x1b[?25h\n" + text  # a live table hid the cursor and may be mid-line
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
    if not _state["json"]:
        return
    from autotune.cli.app import emitted

    if not emitted:
        with contextlib.suppress(OSError):
            os.write(1, (error_document(message, signum, trials) + "\n").encode())
    else:  # the result's document: out of the buffer before the end
        with contextlib.suppress(Exception):
            sys.stdout.flush()


def last_word() -> None:
    """Called by the command before it prints an interrupt's line: from now the watchdog prints
    none. If the watchdog has printed it already, this waits for it to end the process."""
    dog: _Watchdog | None = _state.get("dog")
    if dog is None:
        return
    with dog.lock:
        if not dog.said:
            dog.said = True
            return
    threading.Event().wait()  # the watchdog said it and is ending the process


def kill_children() -> None:
    """SIGKILL every child process of this one (a probe's fork server, its search or confirmation
    run), with its process group when it leads one, and reap them; what the fork server forked dies
    with it (its parent-death signal)."""
    me = os.getpid()
    children = [pid for pid, parent in _processes() if parent == me]
    for pid in children:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _REAP_SECONDS
    left = set(children)
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by the thread that waits on it
                done = pid
            if done:
                left.discard(pid)
        if left:
            time.sleep(0.01)


def _processes() -> Iterator[tuple[int, int]]:
    """(pid, parent pid) of every process, from /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # the command may hold spaces and parentheses
        if fields[0] != b"Z":
            yield int(name), int(fields[1])


@contextlib.contextmanager
def watched(*, watchdog: bool = True) -> Iterator[None]:
    """For the command's run (`main()`), in the main thread: SIGTERM raises `Terminated` (where
    nobody handles it), Ctrl-C raises KeyboardInterrupt (Python's own), and with `watchdog` a second
    signal, or a first not answered within GRACE_SECONDS, ends the command at once (see the module)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is _ended_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    term = signal.getsignal(signal.SIGTERM)
    if term in (signal.SIG_DFL, _ended_while_starting):
        signal.signal(signal.SIGTERM, raise_terminated)
    dog: _Watchdog | None = None
    previous = -1
    if watchdog:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        dog = _state["dog"] = _Watchdog(read_end, write_end)
        dog.thread.start()
    try:
        yield
    finally:
        if dog is not None:
            with dog.lock:  # not while the watchdog is ending the process: then this waits for the end
                dog.finished.set()
            _state["dog"] = None
            signal.set_wakeup_fd(previous)
            with contextlib.suppress(OSError):
                os.write(dog.write_end, b"\0")  # wake the watchdog to see it is finished
            dog.thread.join(timeout=1)
            os.close(dog.write_end)
            if not dog.thread.is_alive():
                os.close(dog.read_end)
        if term in (signal.SIG_DFL, _ended_while_starting):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _forget_in_fork() -> None:
    # A fork of the command (an in-process probe's DataLoader worker, which gets the terminal's
    # Ctrl-C too) must not write its signals into the command's watchdog.
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_forget_in_fork)
