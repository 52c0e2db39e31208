"""Steps that do not repeat are caught: a leak fails the probe with the bytes per step, and a fresh-process
confirmation whose peak is not the probe's is flagged, not passed.

Issue 22: a loss that kept every step's outputs answered 64 / 2048 in 38 trials with exit 0, and its
confirmation "passed" at a fresh-process peak of 178.5 KiB against the probe's 3.7 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from autotune.devices.budget import BudgetDevice
from autotune.engine.confirm import peak_mismatch
from autotune.engine.trial import LEAK_EVIDENCE_STEPS, TrialRunner
from autotune.errors import LeakError
from tests import leak_workloads
from tests.serving import ROOT

AUTOTUNE = str(Path(sys.executable).parent / "autotune")
CPU = ("--device", "cpu")


@pytest.mark.parametrize("allocator", ["exact", "cuda"], ids=["exact-counting", "allocator-model"])
def test_a_leaking_loss_fails_the_trial_with_the_bytes_per_step(allocator: Literal["exact", "cuda"]) -> None:
    # With the model of CUDA's caching allocator too: trials there run to the allocator's steady
    # state, and the leak is read from the live bytes all the same.
    runner = TrialRunner(leak_workloads.leak(), BudgetDevice(4 << 20, allocator=allocator))
    with pytest.raises(LeakError) as caught:
        runner(4)
    # Each step keeps one float32[4, 10] output: 160 bytes, one 512-byte block on the budget device.
    assert caught.value.bytes_per_step == 512
    assert "512 B per step" in str(caught.value)
    assert "float32[4, 10], grad_fn AddmmBackward0" in str(caught.value)
    assert runner.steps_run == LEAK_EVIDENCE_STEPS  # no settle step past the evidence: the leak ends the trial


def test_a_cache_built_once_is_not_a_leak() -> None:
    runner = TrialRunner(leak_workloads.cache_once(), BudgetDevice(4 << 20))
    record = runner(4)
    assert record.fits
    # Memory grew at step 2, so the trial ran one step more to see whether it grows again: it did not.
    assert record.steps == LEAK_EVIDENCE_STEPS
    assert runner(4).steps == 2  # the cache exists now: nothing grows, the usual two steps


def test_the_cli_probe_of_a_leaking_workload_fails_naming_the_leak() -> None:
    proc = subprocess.run(
        [AUTOTUNE, "probe", "tests.leak_workloads:leak", "--device", "cpu", "--memory", "4MiB", "--no-confirm"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "probe failed" in line]
    assert "leaks memory" in line and "per step" in line, line


def test_a_fresh_run_at_a_fraction_of_the_probes_peak_is_flagged_not_passed() -> None:
    proc = subprocess.run(
        [
            AUTOTUNE,
            "probe",
            "tests.leak_workloads:lighter_when_confirmed",
            "--device",
            "cpu",
            "--memory",
            "16MiB",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    # Answered, not confirmed: its own exit code, the JSON's verdict says the same, one line on stderr.
    assert proc.returncode == 4, proc.stderr
    document = json.loads(proc.stdout)
    assert document["verdict"]["status"] == "not-confirmed" and document["verdict"]["exit_code"] == 4
    assert all(a["confirmed"] is False for a in document["verdict"]["answers"])
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("answered, not confirmed (exit 4)")]
    assert "the fresh process peaked at" in line
    confirmation = document["confirmation"]
    assert confirmation["status"] == "mismatch" and confirmation["passed"] is False
    flagged = [c for c in confirmation["checks"] if c["mismatch"]]
    assert flagged and all(c["probe_peak_bytes"] > c["runs"][0]["peak_allocated_bytes"] for c in flagged)
    assert "the fresh process peaked at" in confirmation["note"]


def test_the_tolerance() -> None:
    mib = 1 << 20
    assert peak_mismatch("plan", 8, 100 * mib, 105 * mib) is None  # 5% apart
    assert peak_mismatch("plan", 8, 100 * mib, 120 * mib) is not None  # 17% apart
    assert peak_mismatch("plan", 8, 200 << 10, 900 << 10) is None  # under the 1 MiB slack
    assert peak_mismatch("plan", 8, 178 << 10, 3800 << 10) is not None  # the case
    assert peak_mismatch("plan", 8, 100 * mib, None) is None  # no probe trial at that size


class _Ran:
    """What the CLI's entry point returned and printed, run in this process: its probe forks from the
    server this process's probes share (the CLI as a process of its own: the tests above)."""

    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = code, stdout, stderr


def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> _Ran:
    from autotune import cli

    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    code = cli.run(list(args))
    printed = capsys.readouterr()
    return _Ran(code, printed.out, printed.err)


def _one_line(proc: _Ran, starts: str) -> str:
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith(starts)]
    return line


def test_memory_kept_by_a_trial_fails_the_probe_naming_the_trial_and_what_it_kept(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 36: a cache per batch size answered 51 / 1054 in 44 trials with exit 0.
    proc = _cli(capsys, monkeypatch, "probe", "tests.leak_workloads:cache_per_size", *CPU, "--memory", "4MiB", "--json")
    assert proc.returncode == 1
    line = _one_line(proc, "probe failed: memory kept between trials")
    # The predictor's second timeline trial (batch 2) left its cache; the first trial's cache (batch
    # 4) joined the baseline, as a cache built once would.
    assert "trial 2 (micro-batch 2" in line and "512 B more live" in line, line
    assert "float32[2, 10], allocated by aten.ones.default" in line, line
    error = json.loads(proc.stdout)["error"]
    assert error["type"] == "KeptMemoryError" and error["exit_code"] == 1


def test_a_runner_tells_memory_kept_between_trials_from_a_cache_built_once() -> None:
    from autotune.errors import KeptMemoryError

    runner = TrialRunner(leak_workloads.cache_once(), BudgetDevice(4 << 20))
    for size in (4, 8, 2, 4):  # built once, in the first trial: part of the job's memory, every later trial
        assert runner(size).fits
    assert runner.kept_once is not None and "left by trial 1 (batch 4)" in runner.kept_once
    per_size = TrialRunner(leak_workloads.cache_per_size(), BudgetDevice(4 << 20))
    assert per_size(4).fits
    with pytest.raises(KeptMemoryError) as caught:
        per_size(8)
    assert (caught.value.trial, caught.value.batch, caught.value.kept_bytes) == (2, 8, 512)


def test_a_leak_that_starts_late_fails_the_probe(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 36: memory that grows from the 7th step on answered "none fits with accumulation", exit 0.
    proc = _cli(
        capsys,
        monkeypatch,
        "probe",
        "tests.leak_workloads:late_leak",
        *CPU,
        "--memory",
        "4MiB",
        "--effective-batch",
        "64",
    )
    assert proc.returncode == 1
    line = _one_line(proc, "probe failed: memory kept between trials")
    assert "grad_fn AddmmBackward0" in line  # the kept output, with its graph


def test_a_leak_that_starts_late_in_a_trial_is_named_with_its_first_step() -> None:
    # Outputs kept from the 4th loss call: steps 1-3 flat, then growth at every step. A trial's
    # steps after the second must not grow: two increases make a leak, wherever they start.
    runner = TrialRunner(leak_workloads.late_leak(start=4), BudgetDevice(4 << 20), steps=6)
    with pytest.raises(LeakError) as caught:
        runner(4)
    assert caught.value.started_at_step == 4
    assert "grew from step 4 on by 512 B per step" in str(caught.value)


def test_a_fresh_process_confirmation_sees_a_leak_that_starts_within_its_steps() -> None:
    # A confirmation run is one trial of --confirm-steps optimizer steps in a new process (here the
    # function that process runs): a leak that starts at its 4th step is seen there.
    from autotune.engine.confirm import FreshRunRequest, _one_trial
    from autotune.request import ProbeRequest
    from autotune.results import LoopShape

    job = FreshRunRequest(
        probe=ProbeRequest(target="tests.leak_workloads:late_leak", options={"start": 4}, device="cpu"),
        batch=4,
        loop=LoopShape(micro_steps=1, steps=5),
        device_kind="cpu-budget",
        device_index=None,
        total_bytes=4 << 20,
        limit_bytes=4 << 20,
    )
    with pytest.raises(LeakError, match="from step 4 on"):
        _one_trial(job)
    # Starting after its last step (and the one that tells a leak from a cache): not seen.
    assert _one_trial(job.model_copy(update={"loop": LoopShape(micro_steps=1, steps=2)})).fits


def test_a_workload_whose_batch_is_not_repeatable_is_refused_by_probe_and_estimate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 36: `estimate` of a workload whose shape changes on every call answered 70 / 297, exit 0.
    flags = {"probe": CPU, "estimate": ("--overhead", "0")}
    for command, extra in flags.items():
        proc = _cli(capsys, monkeypatch, command, "tests.leak_workloads:shape_changes", "--memory", "4MiB", *extra)
        assert proc.returncode == 2, (command, proc.stderr)
        line = _one_line(proc, "error: make_batch(")
        assert "is not repeatable" in line and "float32[" in line, line


def test_a_cache_built_once_answers_and_the_result_says_what_the_first_trial_left() -> None:
    from autotune.engine.probe import ProbeRequest, run_probe

    result = run_probe(ProbeRequest(target="tests.leak_workloads:cache_once", device="cpu", memory="4MiB"))
    assert result.max_micro_batch is not None
    assert result.notes == [
        "memory kept from the first trials: 64.0 KiB left by trial 1 (batch 4); counted as the job's own from then "
        "on (a cache built once, cuBLAS's workspaces), and no later trial kept more"
    ]
