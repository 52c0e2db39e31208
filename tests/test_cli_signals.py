"""Signals and exit codes as documented (issue 38): a probe answers Ctrl-C within a second wherever it
is (its start-up while the fork server imports torch, the import of the user's module, a trial, the
confirmation, the command line's own imports), never with a traceback, and a second Ctrl-C ends it
at once; `autotune serve` stops gracefully on SIGINT and SIGTERM and exits 0.

The probes here are real commands in processes of their own, sent real signals at a random moment
inside each part of the probe (a failure says the moment); the watchdog that ends a command whose
first signal is held is tested in this process, with its end replaced."""

from __future__ import annotations

import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autotune.cli import interrupts
from tests.serving import ROOT, alive, descendants, start_server

AUTOTUNE = str(Path(sys.executable).parent / "autotune")
PROBE = ("probe", "tests.signal_workloads:slow", "--device", "cpu", "--memory", "64MiB", "--max-batch", "2")
PROBE += ("--search", "plain")
# "Within a second": the command answers in half a second (GRACE_SECONDS); the rest is what a loaded
# two-core machine takes to run the test and the command's end.
ANSWERED_WITHIN = 1.5


class _Command:
    """`autotune ARGS...` with its stderr read line by line against a deadline."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [AUTOTUNE, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            # A shell's background job has SIGINT ignored, and then Python raises no KeyboardInterrupt.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert self.proc.stderr is not None
        self.fd = self.proc.stderr.fileno()
        self.text = ""

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text, re.M):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.fd], [], [], left)[0], f"no {pattern!r} in {self.text[-3000:]!r}"
            chunk = os.read(self.fd, 1 << 16)
            assert chunk, f"stderr closed without {pattern!r}: {self.text[-3000:]!r}"
            self.text += chunk.decode(errors="replace")

    def descendants(self) -> set[int]:
        return descendants(self.proc.pid)

    def interrupt(self, *signals: signal.Signals, apart: float = 0.05) -> float:
        """Send the signals (`apart` seconds between them); the seconds from the first to the exit."""
        sent = time.monotonic()
        for n, number in enumerate(signals):
            if n:
                time.sleep(apart)
            self.proc.send_signal(number)
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        took = time.monotonic() - sent
        out, rest = self.proc.communicate(timeout=30)
        self.out = out.decode(errors="replace")
        self.text += rest.decode(errors="replace")
        return took


def _gone(pids: set[int], timeout: float = 2.0) -> set[int]:
    """Those of `pids` still alive after `timeout` (killed processes take a moment to be reaped)."""
    deadline = time.monotonic() + timeout
    left = set(pids)
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if alive(pid)}
        time.sleep(0.02)
    return left


# (part of the probe, the stderr line that says it has begun, the longest delay after it, signals)
PARTS = [
    # the fork server importing torch (a few seconds here, 15-30 s on a loaded machine); Ctrl-C twice
    ("start-up", r"^probing tests.signal_workloads:slow: starting", 1.0, (signal.SIGINT, signal.SIGINT)),
    ("import", r"^signal-workloads: importing", 0.5, (signal.SIGINT,)),
    ("trial", r"^trial +2: batch +2 step 1/2", 0.15, (signal.SIGTERM,)),
    ("confirmation", r"^confirm: batch 2 starting a fresh process", 0.8, (signal.SIGINT,)),
]


@pytest.mark.parametrize(("part", "begun", "within", "signals"), PARTS, ids=[p[0] for p in PARTS])
def test_a_signal_at_a_random_moment_of_each_part_of_a_probe_is_answered_within_a_second(
    part: str, begun: str, within: float, signals: tuple[signal.Signals, ...], locks: Path
) -> None:
    delay = random.uniform(0, within)  # each run its own moment; a failure names it
    command = _Command(*PROBE)
    try:
        command.wait_for(begun)
        time.sleep(delay)
        family = command.descendants()
        took = command.interrupt(*signals)
    finally:
        if command.proc.poll() is None:
            command.proc.kill()
            command.proc.wait()
    text = command.text
    moment = f"{part}, {delay:.2f} s in"
    code = {signal.SIGINT: 130, signal.SIGTERM: 143}[signals[0]]
    assert command.proc.returncode == code, f"{moment}: exit {command.proc.returncode}\n{text}"
    assert "Traceback" not in text, f"{moment}:\n{text}"
    said = [line for line in text.splitlines() if line.startswith("interrupted")]
    assert len(said) == 1 and said[0] == text.splitlines()[-1], f"{moment}:\n{text}"
    how = "SIGTERM" if signals[0] == signal.SIGTERM else r"Ctrl-C \(SIGINT\)"
    pattern = rf"interrupted after \d+ trials?( \(.*\))? by {how}; the probe's processes have exited"
    assert re.fullmatch(pattern, said[0]), f"{moment}: {said[0]}"
    assert took < ANSWERED_WITHIN, f"{moment}: answered after {took:.2f} s"
    assert family or part == "start-up", f"{moment}: no process of the probe was running"
    assert not _gone(family), f"{moment}: the probe's processes outlived the command"


def test_ctrl_c_while_the_command_line_imports_is_one_line() -> None:
    """Python's imports of the command line itself (typer, rich: a second or more on a loaded machine)
    printed a traceback of 6 to 43 lines. The moment is found from Python's own import log."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    command = _Command(*PROBE, env=env)
    try:
        command.wait_for(r"\|\s+(typer|click|rich)\b")
        took = command.interrupt(signal.SIGINT)
    finally:
        if command.proc.poll() is None:
            command.proc.kill()
            command.proc.wait()
    lines = [line for line in command.text.splitlines() if not line.startswith("import time:")]
    assert command.proc.returncode == 130, command.text[-3000:]
    assert "Traceback" not in command.text and "KeyboardInterrupt" not in command.text, lines
    assert len(lines) == 1 and lines[0].startswith("interrupted by Ctrl-C (SIGINT)"), lines
    assert took < ANSWERED_WITHIN


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_gracefully_and_exits_0(number: signal.Signals, tmp_path: Path, locks: Path) -> None:
    server = start_server(tmp_path / "node", startup_timeout=120)
    code = server.stop(number)
    output = server.output()
    assert code == 0, output
    assert "Traceback" not in output and "Application shutdown complete" in output
    words = "SIGTERM" if number == signal.SIGTERM else "Ctrl-C (SIGINT)"
    assert output.rstrip().splitlines()[-1] == f"autotune serve: stopped by {words}"


# The watchdog, in this process ---------------------------------------------------------------------
class _Ended(BaseException):
    pass


@pytest.fixture
def watchdog(monkeypatch: pytest.MonkeyPatch) -> tuple[interrupts._Watchdog, threading.Event, list[int]]:
    """A watchdog on a pipe of its own whose end (killing this process's children, the line, the exit)
    records the exit code instead."""
    ended, codes = threading.Event(), []

    def end(code: int) -> None:
        codes.append(code)
        ended.set()
        raise _Ended

    monkeypatch.setattr(interrupts, "kill_children", lambda: None)
    monkeypatch.setattr(interrupts, "_say_here", lambda *args: None)
    monkeypatch.setattr(interrupts.os, "_exit", end)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's _Ended
    read_end, write_end = os.pipe()
    dog = interrupts._Watchdog(read_end, write_end)
    dog.thread.start()
    yield dog, ended, codes
    dog.finished.set()
    os.write(write_end, b"\0")
    dog.thread.join(timeout=5)
    os.close(read_end)
    os.close(write_end)


def test_a_second_signal_ends_the_command_at_once(watchdog: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    dog, ended, codes = watchdog
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 60.0)
    os.write(dog.write_end, bytes([signal.SIGINT]))
    assert not ended.wait(0.3)  # the command has its grace to answer the first
    os.write(dog.write_end, bytes([signal.SIGINT]))
    assert ended.wait(10) and codes == [130]


def test_a_first_signal_not_answered_in_time_ends_the_command(watchdog: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    dog, ended, codes = watchdog
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 0.2)
    os.write(dog.write_end, bytes([signal.SIGTERM]))
    assert ended.wait(10) and codes == [143]


def test_a_command_that_answers_in_time_is_left_to_end_itself(watchdog: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    dog, ended, _ = watchdog
    monkeypatch.setattr(interrupts, "GRACE_SECONDS", 0.5)
    os.write(dog.write_end, bytes([signal.SIGINT]))
    interrupts._state["dog"] = dog
    try:
        interrupts.last_word()  # the command says its own line
    finally:
        interrupts._state["dog"] = None
    with dog.lock:
        dog.finished.set()  # and ends
    assert not ended.wait(1.0)


def test_a_second_signal_while_a_child_starts_is_not_held() -> None:
    """`hold_interrupts` holds Ctrl-C while a probe's child starts (the seconds its fork server takes to
    import torch); a second Ctrl-C there went unheard. Now the second runs its handler at once. In this
    process's main thread, with Python's own SIGINT handler."""
    from autotune.engine.isolation import hold_interrupts

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    caught: list[str] = []
    release = hold_interrupts()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # held: nothing raised
        try:
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except KeyboardInterrupt:
            caught.append("second")
    finally:
        try:
            release()
        except KeyboardInterrupt:
            caught.append("release")
    assert caught == ["second"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
