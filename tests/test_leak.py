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
    assert proc.returncode == 0, proc.stderr
    confirmation = json.loads(proc.stdout)["confirmation"]
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
