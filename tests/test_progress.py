"""Progress a person can watch (the step inside each trial), and interrupts: Ctrl-C or SIGTERM
ends the probe's processes before the command exits, 130 or 143, with one line and no traceback."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from autotune import cli
from autotune.cli import progress as cli_progress
from autotune.cli.progress import ProgressView
from autotune.devices.budget import BudgetDevice
from autotune.engine.trial import TrialRunner
from autotune.progress import TrialProgress, throttled
from autotune.results import LoopShape, TrialRecord
from tests.serving import ROOT, alive, children_of
from tests.workloads import tiny

AUTOTUNE = str(Path(sys.executable).parent / "autotune")
TINY = ("--device", "cpu", "--memory", "64MiB", "--max-batch", "2", "--search", "plain")


def test_the_runner_reports_each_micro_step_as_it_begins() -> None:
    seen: list[TrialProgress] = []
    runner = TrialRunner(tiny, BudgetDevice(2**26), on_progress=seen.append)
    assert runner.run(4, LoopShape(micro_steps=2, steps=2)).fits
    assert [(p.batch, p.step, p.steps, p.micro_step, p.micro_steps) for p in seen] == [
        (4, 1, 2, 1, 2),
        (4, 1, 2, 2, 2),
        (4, 2, 2, 1, 2),
        (4, 2, 2, 2, 2),
    ]
    assert seen[0].first and not seen[1].first and seen[0].phase == "search"
    assert [p.seconds for p in seen] == sorted(p.seconds for p in seen)


def test_throttled_passes_each_trial_s_first_report_then_one_per_interval() -> None:
    now = [0.0]
    passed: list[TrialProgress] = []
    relay = throttled(passed.append, interval=0.1, clock=lambda: now[0])

    def report(step: int, micro: int) -> TrialProgress:
        return TrialProgress(batch=8, step=step, steps=2, micro_step=micro, micro_steps=3, seconds=now[0])

    for step, micro, at in [(1, 1, 0.0), (1, 2, 0.05), (1, 3, 0.12), (2, 1, 0.13), (1, 1, 0.14), (2, 1, 0.3)]:
        now[0] = at
        relay(report(step, micro))
    assert [(p.step, p.micro_step) for p in passed] == [(1, 1), (1, 3), (1, 1), (2, 1)]


def _render(view: ProgressView) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, color_system=None, width=120)
    console.print(view)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return str(text)


def test_the_terminal_view_shows_the_table_and_the_running_step_with_a_spinner() -> None:
    now = [100.0]
    view = ProgressView("probing gpt", clock=lambda: now[0])
    assert "starting the probe process · 0.0 s" in _render(view)
    view.trial(TrialRecord(batch=32, fits=True, seconds=1.25, peak_reserved_bytes=3 * 2**20))
    view.progress(TrialProgress(batch=64, step=2, steps=2, micro_step=1, micro_steps=3, seconds=3.0))
    now[0] += 0.4  # the seconds tick between reports
    shown = _render(view)
    assert "probing gpt" in shown and "3.0 MiB" in shown and "1.25" in shown  # the table of trials so far
    status = shown.splitlines()[-1]
    assert re.fullmatch(r"\S trial 2 · batch 64 · step 2/2 · micro-step 1/3 · 3\.4 s", status), status
    view.progress(TrialProgress(batch=48, step=0, steps=2, micro_step=0, micro_steps=3, seconds=0, phase="confirm"))
    now[0] += 1.5
    assert "confirming batch 48 · starting a fresh process · 1.5 s" in _render(view)
    view.done = True  # the last frame: the table alone
    assert "batch 48" not in _render(view) and "probing gpt" in _render(view)


def test_piped_output_has_a_step_line_before_each_trial_s_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the CLI's entry point in this process, whose stderr is captured, not a terminal: its
    probe forks from the server this process's probes share (the CLI as a process of its own is
    test_cli's, and the interrupt tests' below)."""
    monkeypatch.chdir(ROOT)
    code = cli.run(["probe", "tests.workloads:tiny", *TINY, "--no-confirm"])
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    lines = stderr.splitlines()
    verdicts = [i for i, line in enumerate(lines) if re.match(r"trial +\d+: batch +\d+ x\d (fits|OOM)", line)]
    # max-batch 2: the one-micro-step loop tries 1 and 2; the accumulating loop starts at that answer (2).
    assert len(verdicts) == 3, stderr
    for n, i in enumerate(verdicts, 1):
        batch = lines[i].split()[3]
        assert re.fullmatch(rf"trial +{n}: batch +{batch} step 1/2 micro-step 1/[12] +\d+\.\d\d s", lines[i - 1]), lines


class _Stderr:
    """A running command's stderr, line by line, with a deadline (no buffered reader to block on)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        self.fd = proc.stderr.fileno()
        self.text = ""

    def wait_for(self, pattern: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.fd], [], [], left)[0], f"no {pattern!r} in {self.text!r}"
            chunk = os.read(self.fd, 1 << 16)
            assert chunk, f"stderr closed without {pattern!r}: {self.text!r}"
            self.text += chunk.decode()


@pytest.mark.parametrize(
    ("sig", "code", "target", "running", "message"),
    [
        # Ctrl-C in the middle of a trial of the search: batch 2 hangs in the isolated child.
        (
            signal.SIGINT,
            130,
            "tests.workloads:hangs",
            r"trial +2: batch +2 step 1/2",
            "(batch 2 was running, step 1/2)",
        ),
        # SIGTERM during the fresh-process confirmation, which hangs.
        (
            signal.SIGTERM,
            143,
            "tests.progress_workloads:hangs_when_confirmed",
            r"confirm: batch 2 step 1/2 micro-step 1/3",
            "(confirming batch 2 in a fresh process)",
        ),
    ],
    ids=["sigint-in-a-trial", "sigterm-in-confirmation"],
)
def test_an_interrupt_ends_the_probe_s_processes_then_says_so(
    sig: signal.Signals, code: int, target: str, running: str, message: str
) -> None:
    proc = subprocess.Popen(
        [AUTOTUNE, "probe", target, *TINY, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        # A shell's background job has SIGINT ignored, and then Python raises no KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        stderr = _Stderr(proc)
        stderr.wait_for(running + ".*\n")
        (child,) = children_of(proc.pid)
        assert alive(child)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert not alive(child), "the probe's process outlived the command"
    finally:
        if proc.poll() is None:
            proc.kill()
        out, rest = proc.communicate(timeout=30)
    text = stderr.text + rest.decode()
    assert proc.returncode == code, text
    assert "Traceback" not in text
    (last,) = [line for line in text.splitlines() if "interrupted" in line]
    assert re.fullmatch(rf"interrupted after \d+ trials? {re.escape(message)} by .*SIG.*; .*", last), last
    assert last == text.splitlines()[-1]
    error = json.loads(out)["error"]
    assert error["type"] == "Interrupted" and error["exit_code"] == code and error["signal"] == sig.name


def test_piped_output_says_a_long_step_is_still_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step that runs long sends no new report; in a log, a line every _HEARTBEAT_SECONDS says it
    is still running, with its time so far (batch 2 hangs here until the probe's timeout)."""
    monkeypatch.setattr(cli_progress, "HEARTBEAT_SECONDS", 0.25)
    monkeypatch.chdir(ROOT)
    code = cli.run(["probe", "tests.workloads:hangs", *TINY, "--no-confirm", "--timeout", "2"])
    stderr = capsys.readouterr().err
    assert code == 1 and "ran past its timeout of 2 s" in stderr, stderr
    still = re.findall(r"trial +2: batch +2 step 1/2 micro-step 1/1 +(\d+\.\d\d) s \(still running\)", stderr)
    assert len(still) >= 2, stderr
    seconds = [float(s) for s in still]
    assert seconds == sorted(seconds) and seconds[-1] > seconds[0]


def _raised_at(marker: str) -> str:
    """`tests/progress_workloads.py:LINE`, the line of the workload's `raise KeyboardInterrupt  # marker`."""
    source = (ROOT / "tests" / "progress_workloads.py").read_text().splitlines()
    (line,) = [n for n, text in enumerate(source, 1) if text.strip() == f"raise KeyboardInterrupt  # {marker}"]
    return f"tests/progress_workloads.py:{line}"


LOSS_ERROR = "batch 2 failed with an error that is not out-of-memory: KeyboardInterrupt (at {loss} in loss)"
BUILD_ERROR = "workload error: KeyboardInterrupt (at {build} in build)"


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (("probe", "-o", "where=loss", *TINY), "probe failed: " + LOSS_ERROR),
        (("probe", "-o", "where=loss", *TINY, "--in-process"), "probe failed: " + LOSS_ERROR),
        (("probe", "-o", "where=build", *TINY), "probe failed: " + BUILD_ERROR),
        (("probe", "-o", "where=build", *TINY, "--in-process"), "probe failed: " + BUILD_ERROR),
        (("probe", "-o", "where=confirm", *TINY), "probe failed: confirmation in a fresh process: " + LOSS_ERROR),
        (("estimate", "-o", "where=build", "--memory", "64MiB", "--overhead", "0"), "estimate failed: " + BUILD_ERROR),
    ],
    ids=["loss", "loss-in-process", "build", "build-in-process", "confirmation", "estimate"],
)
def test_a_keyboard_interrupt_the_workload_raises_is_its_error_not_a_signal(
    command: tuple[str, ...], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No signal was sent: one line naming the file and line where the workload raised it, exit 1,
    no traceback, and not 'interrupted ... by Ctrl-C'. Through the CLI's entry point in this process,
    where SIGINT raises KeyboardInterrupt as in a terminal's command (a real Ctrl-C to the CLI's
    process is the tests' above and below); its probes fork from the server this process's share."""
    name, *flags = command
    monkeypatch.chdir(ROOT)
    try:
        code = cli.run([name, "tests.progress_workloads:interrupts_itself", *flags, "--json"])
    except KeyboardInterrupt as exc:  # not pytest's Ctrl-C: the workload's, which the CLI let through
        pytest.fail(f"the workload's KeyboardInterrupt left the CLI: {exc!r}")
    out, err = capsys.readouterr()
    expected = said.format(loss=_raised_at("in the loss"), build=_raised_at("while building"))
    assert code == 1, err
    assert "Traceback" not in err and "interrupted" not in err, err
    assert err.splitlines()[-1] == expected
    error = json.loads(out)["error"]
    assert error["exit_code"] == 1 and error["message"] == expected.split(" failed: ", 1)[1]


def test_ctrl_c_during_an_in_process_trial_is_still_an_interrupt() -> None:
    """The trial runs in the command's own process: a real SIGINT there is Ctrl-C, not the workload's error."""
    proc = subprocess.Popen(
        [AUTOTUNE, "probe", "tests.workloads:hangs", *TINY, "--in-process"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        stderr = _Stderr(proc)
        stderr.wait_for(r"trial +2: batch +2 step 1/2.*\n")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, rest = proc.communicate(timeout=30)
    text = stderr.text + rest.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    assert text.splitlines()[-1] == (
        "interrupted after 1 trial (batch 2 was running, step 1/2) by Ctrl-C (SIGINT); "
        "the probe's processes have exited"
    )


def test_a_piped_probe_says_it_is_starting_at_once_and_its_time_in_all_is_the_commands(locks: Path) -> None:
    """Issue 38: a piped probe printed nothing for the 15-24 s its process took to start, and its
    summary's "in all" left that start out (45.5 s of wall time printed as 28.1 s)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [AUTOTUNE, "probe", "tests.workloads:tiny", *TINY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        stderr = _Stderr(proc)
        stderr.wait_for(r".*\n")
        first = time.monotonic() - started
        out, rest = proc.communicate(timeout=300)
        wall = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = stderr.text + rest.decode()
    assert proc.returncode == 0, text
    assert text.splitlines()[0] == (
        "probing tests.workloads:tiny: starting in a process of its own, which imports torch and the workload"
    )
    assert first < 2.0, f"the first line came after {first:.1f} s"
    said = re.search(r"; (\d+\.\d) s in all from the command's start \(starting its processes included\)", out.decode())
    assert said is not None, out.decode()
    # From the process's start: the wall time the test saw, but for the process's exec and its exit (and
    # the figure's rounding to 0.1 s); the search and confirmation here take 0.3 s of it.
    assert wall - 1.5 <= float(said.group(1)) <= wall + 0.05, (said.group(0), wall)
