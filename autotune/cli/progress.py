"""A probe run with its progress shown: which trial runs, its batch, step and micro-step, and the
seconds ticking, on a terminal (a live table and a spinner) or as plain lines for logs and CI (a
line per trial, per new step at most once a second, and a heartbeat while a step runs long).

Ctrl-C or SIGTERM ends the probe's processes first, then raises `ProbeInterrupted`, which `run`
turns into one line and exit 130 or 143 (and if that takes longer than a moment, as while the fork
server imports torch, the command's watchdog ends them and says the same line:
`autotune.cli.interrupts`). A KeyboardInterrupt that the workload's code raised, with no Ctrl-C, is
its error (`autotune.workloads.usercode.raised_by_code`), not an interrupt.

Piped, a probe that has said nothing a quarter second after it started (no trial yet, no wait for
the device, no failure) says that it is starting (`probing gpt: starting in a process of its own,
which imports torch and the workload`): its process needs seconds to import them.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.text import Text

from autotune.cli import interrupts
from autotune.cli.app import err
from autotune.cli.summary import trial_table
from autotune.units import format_bytes

if TYPE_CHECKING:
    from autotune.engine.lock import Wait
    from autotune.progress import TrialProgress
    from autotune.request import ProbeRequest
    from autotune.results import ProbeResult, TrialRecord

# A log gets a progress line for each trial's first report, then at most one a second.
LOG_INTERVAL_SECONDS = 1.0
HEARTBEAT_SECONDS = 30.0  # piped output: a step with no new report is said to be still running this often
# Piped output: a probe that has said nothing by then (no trial, no wait for the device, no failure:
# its process is starting) says that it is starting.
FIRST_LINE_SECONDS = 0.25


# SIGTERM during a probe, raised in the main thread (by `main()`'s handler, or the one
# `run_with_progress` installs where nobody handles SIGTERM).
_Terminated = interrupts.Terminated
_waited: list[float] = []  # the seconds the last probe waited for its device


class ProbeInterrupted(BaseException):
    """A probe stopped by Ctrl-C (exit 130) or SIGTERM (exit 143), its processes already ended:
    `run` prints `message` as one line (and the JSON error document with --json)."""

    def __init__(self, message: str, code: int, signal_name: str, trials: int) -> None:
        super().__init__(message)
        self.message, self.code, self.signal_name, self.trials = message, code, signal_name, trials
        self.signum = int(getattr(signal, signal_name))


def waited_seconds() -> float:
    """The seconds the last probe run here waited for its device (another probe held it)."""
    return _waited[-1] if _waited else 0.0


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _step_words(p: TrialProgress) -> str:
    if p.starting:
        return "starting a fresh process"
    return f"step {p.step}/{p.steps} · micro-step {p.micro_step}/{p.micro_steps}"


class ProgressView:
    """What a probe shows while it runs, on a terminal: the table of the trials so far and, under
    it, a spinner with the trial running (`trial 3 · batch 64 · step 2/2 · micro-step 1/3 · 3.4 s`,
    the seconds ticking between reports). A rich renderable: `rich.live.Live` redraws it."""

    def __init__(self, title: str, *, isolated: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.spinner import Spinner

        self.title = title
        self.isolated = isolated
        self.trials: list[TrialRecord] = []
        self.runs = 0  # fresh-process confirmation runs that finished
        self.current: TrialProgress | None = None
        self.waiting: str | None = None  # for the device, which another probe holds
        self.done = False
        self._clock = clock
        self._since = clock()  # when `current` arrived (or, with none, when the last change was)
        self._spinner = Spinner("dots", style="cyan")

    def progress(self, p: TrialProgress) -> None:
        self.current, self._since = p, self._clock()

    def trial(self, t: TrialRecord) -> None:
        self.trials.append(t)
        self.current, self._since = None, self._clock()

    def confirmed(self, t: TrialRecord) -> None:
        self.runs += 1
        self.current, self._since = None, self._clock()

    def wait(self, w: Wait) -> None:
        self.waiting, self._since = (None if w.done else w.line()), self._clock()

    def status(self) -> str:
        """The status line, in words."""
        elapsed = self._clock() - self._since
        p = self.current
        if p is None and self.waiting is not None:
            return f"{self.waiting} · {elapsed:.1f} s"
        if p is None:
            if self.runs:
                return f"confirming · {_count(self.runs, 'fresh-process run')} done · {elapsed:.1f} s"
            if not self.trials:
                return f"starting the probe{' process' if self.isolated else ''} · {elapsed:.1f} s"
            return f"searching · {_count(len(self.trials), 'trial')} done · {elapsed:.1f} s"
        seconds = p.seconds + elapsed
        if p.phase == "confirm":
            where = "" if p.starting else " in a fresh process"
            return f"confirming batch {p.batch}{where} · {_step_words(p)} · {seconds:.1f} s"
        return f"trial {len(self.trials) + 1} · batch {p.batch} · {_step_words(p)} · {seconds:.1f} s"

    def __rich__(self) -> Any:
        from rich.console import Group

        table = trial_table(self.trials, self.title)
        if self.done:
            return table
        self._spinner.update(text=escape(self.status()))
        return Group(table, self._spinner) if self.trials else self._spinner


def _progress_line(p: TrialProgress, trial: int) -> str:
    """A report as one plain line, for logs: `trial   3: batch     64 step 1/2 micro-step 1/1   2.10 s`."""
    if p.phase == "confirm":
        what = "starting a fresh process" if p.starting else _step_words(p).replace(" · ", " ")
        return f"confirm: batch {p.batch} {what} {p.seconds:.2f} s"
    return (
        f"trial {trial:3d}: batch {p.batch:6d} step {p.step}/{p.steps} micro-step {p.micro_step}/{p.micro_steps} "
        f"{p.seconds:6.2f} s"
    )


class ProgressLines:
    """Plain progress lines on stderr, for a log (and the confirmation's lines on a terminal too).

    It keeps the step running and when its report came (a step can run for minutes with no new
    report, and a log that stops moving looks like a hang), when a line was last said, and a lock
    that keeps the heartbeat's line from naming a step that has just ended."""

    def __init__(self, view: ProgressView, starting: str | None = None) -> None:
        self.view = view
        self.starting = starting  # the first line, when nothing was said by FIRST_LINE_SECONDS
        self.spoken = False
        self.latest: tuple[TrialProgress, float] | None = None
        self.said = time.monotonic()
        self.logged = -math.inf
        self.lock = threading.Lock()

    def say(self, line: str) -> None:
        # A Text, not markup=False: print's options would reach the live table's markup as well.
        err.print(Text(line), highlight=False)
        self.said = time.monotonic()
        self.spoken = True

    def confirmed(self, t: TrialRecord) -> None:
        with self.lock:
            self.latest = None
            self.view.confirmed(t)
            verdict = "fits" if t.fits else "OOM"
            loop = f"{t.micro_steps} micro-steps" if t.micro_steps > 1 else "1 micro-step"
            under = "" if t.limit_bytes is None else f"; at the allocator's edge, under {format_bytes(t.limit_bytes)}"
            self.say(
                f"confirm: batch {t.batch} in a fresh process ({loop} per optimizer step{under}): {verdict}, "
                f"peak {format_bytes(t.peak_reserved_bytes)}, {t.seconds:.2f} s"
            )

    def wait(self, w: Wait) -> None:
        with self.lock:
            self.view.wait(w)
            self.say(w.line())
            if w.done:
                _waited[:] = [w.seconds]

    def trial(self, t: TrialRecord) -> None:
        with self.lock:
            self.latest = None
            verdict = "fits" if t.fits else "OOM "
            self.say(
                f"trial {len(self.view.trials) + 1:3d}: batch {t.batch:6d} x{t.micro_steps} {verdict} "
                f"peak {format_bytes(t.peak_reserved_bytes):>10} {t.seconds:6.2f} s"
            )
            self.view.trial(t)

    def progress(self, p: TrialProgress) -> None:
        with self.lock:
            self.view.progress(p)
            now = time.monotonic()
            self.latest = (p, now)
            if p.first or now - self.logged >= LOG_INTERVAL_SECONDS:
                self.logged = now
                self.say(_progress_line(p, len(self.view.trials) + 1))

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """While the block runs: `starting` once FIRST_LINE_SECONDS have passed with nothing said, and
        a step with no new report for HEARTBEAT_SECONDS is said to be still running."""
        stopped = threading.Event()

        def beat() -> None:
            pause = min(FIRST_LINE_SECONDS, HEARTBEAT_SECONDS)
            while not stopped.wait(pause):
                pause = min(1.0, HEARTBEAT_SECONDS)
                with self.lock:
                    if self.starting is not None and not self.spoken:
                        self.say(self.starting)
                    running, now = self.latest, time.monotonic()
                    if now - self.said < HEARTBEAT_SECONDS:
                        continue
                    if running is not None:
                        p, received = running
                        still = p.model_copy(update={"seconds": p.seconds + now - received})
                        self.say(_progress_line(still, len(self.view.trials) + 1) + " (still running)")
                    elif not self.view.trials and self.view.current is None and self.view.waiting is None:
                        self.say(f"{self.view.status()} (still starting)")  # a slow import: not a hang

        beating = threading.Thread(target=beat, name="autotune-progress-heartbeat", daemon=True)
        beating.start()
        try:
            yield
        finally:
            stopped.set()
            beating.join()


_Lines = ProgressLines  # its former name


def _interrupted(exc: BaseException, trials: int, current: TrialProgress | None) -> ProbeInterrupted:
    terminated = isinstance(exc, _Terminated)
    done = _count(trials, "trial")
    if current is None:
        running = ""
    elif current.phase == "confirm":
        running = f" (confirming batch {current.batch} in a fresh process)"
    else:
        running = f" (batch {current.batch} was running, step {current.step}/{current.steps})"
    how = "SIGTERM" if terminated else "Ctrl-C (SIGINT)"
    message = f"interrupted after {done}{running} by {how}; the probe's processes have exited"
    return ProbeInterrupted(message, 143 if terminated else 130, "SIGTERM" if terminated else "SIGINT", trials)


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises _Terminated in the main thread while the block runs, unless the caller
    ignores or handles SIGTERM itself (then it is left as it is)."""
    handled = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if handled else None
    if previous is not signal.SIG_DFL:
        handled = False
    if handled:
        signal.signal(signal.SIGTERM, interrupts.raise_terminated)
    try:
        yield
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_with_progress(request: ProbeRequest, in_process: bool, timeout: float, *, wait: bool = True) -> ProbeResult:
    """Run the probe (and its confirmation), showing each trial as it finishes and the one running:
    a live table and a spinner on a terminal, plain lines otherwise (logs, CI). Ctrl-C or SIGTERM
    ends the probe's processes, then raises ProbeInterrupted. While another probe holds the
    device: a line saying who, then one when it is free (or, with `wait=False`, DeviceBusyError)."""
    view = ProgressView(f"probing {request.target}", isolated=not in_process)
    where = "in this process" if in_process else "in a process of its own, which imports torch and the workload"
    lines = ProgressLines(view, starting=f"probing {request.target}: starting {where}")
    _waited.clear()

    def run(on_trial: Callable[[TrialRecord], None], on_progress: Callable[[TrialProgress], None]) -> ProbeResult:
        from autotune.engine.confirm import probe_and_confirm

        return probe_and_confirm(
            request,
            timeout=timeout,
            in_process=in_process,
            on_trial=on_trial,
            on_run=lines.confirmed,
            on_progress=on_progress,
            wait_for_device=wait,
            on_wait=lines.wait,
        )

    def run_and_show() -> ProbeResult:
        if not err.is_terminal:
            with lines.heartbeat():
                return run(lines.trial, lines.progress)
        from rich.live import Live

        with Live(view, console=err, auto_refresh=True, refresh_per_second=8):
            try:
                return run(view.trial, view.progress)
            finally:
                view.done = True  # the last frame, drawn as Live stops: the table alone

    def how_far(signum: int) -> tuple[str, int]:  # for the watchdog, when it ends the probe itself
        said = _interrupted(
            _Terminated() if signum == signal.SIGTERM else KeyboardInterrupt(), len(view.trials), view.current
        )
        return said.message, said.trials

    with _sigterm_raises(), interrupts.saying(how_far):
        try:
            return run_and_show()
        except (KeyboardInterrupt, _Terminated) as exc:
            from autotune.workloads import usercode

            if usercode.raised_by_code(exc):  # the workload's `raise KeyboardInterrupt` (--in-process), no Ctrl-C
                raise usercode.unexpected(exc) from None
            raise _interrupted(exc, len(view.trials), view.current) from None
