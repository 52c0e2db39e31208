"""Probes in a fresh child interpreter: crashes, abrupt exits and hangs become failed probes, never a dead caller."""

from __future__ import annotations

import select
import subprocess
import sys
import time

import pytest

from autotune.engine.isolation import run_isolated
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import NotAnOOMError, ProbeCrashedError, ProbeTimeoutError, WorkloadError
from autotune.results import TrialRecord
from tests.serving import ROOT, alive, children_of

MIB = 2**20


def _request(target: str, **kwargs: object) -> ProbeRequest:
    return ProbeRequest(target=target, device="cpu", memory=64 * MIB, **kwargs)  # type: ignore[arg-type]


def test_isolated_probe_matches_in_process_and_streams_trials() -> None:
    request = ProbeRequest(target="cnn", device="cpu", memory=16 * MIB, effective_batch=32)
    seen: list[TrialRecord] = []
    isolated = run_isolated(request, timeout=120, on_trial=seen.append)
    local = run_probe(request)
    assert isolated.max_micro_batch == local.max_micro_batch
    assert isolated.fingerprint == local.fingerprint
    assert [t.batch for t in seen] == [t.batch for t in isolated.trials] == [t.batch for t in local.trials]
    assert isolated.plan == local.plan


def test_a_segfault_is_a_failed_probe_with_the_signal() -> None:
    seen: list[TrialRecord] = []
    with pytest.raises(ProbeCrashedError, match=r"killed by SIGSEGV after 2 trial\(s\)"):
        # The plain search's order (1, 2, 4) is what makes "after 2 trials" certain.
        run_isolated(_request("tests.workloads:segfault", search="plain"), timeout=120, on_trial=seen.append)
    assert [t.batch for t in seen] == [1, 2]


def test_an_abrupt_exit_is_a_failed_probe_with_the_code() -> None:
    with pytest.raises(ProbeCrashedError, match="exited with code 7"):
        run_isolated(_request("tests.workloads:exits"), timeout=120)


def test_a_hang_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(ProbeTimeoutError, match=r"timeout of 2 s after \d trial\(s\)"):
        run_isolated(_request("tests.workloads:hangs"), timeout=2)
    assert time.monotonic() - started < 40


def test_errors_from_the_child_keep_their_type_and_message() -> None:
    with pytest.raises(NotAnOOMError, match="shape mismatch in my data pipeline") as info:
        run_isolated(_request("tests.workloads:broken"), timeout=120)
    assert info.value.batch == 4
    with pytest.raises(WorkloadError, match="unknown workload"):
        run_isolated(_request("no-such-example"), timeout=120)


CALLER = """\
from autotune.engine.isolation import run_isolated
from autotune.engine.probe import ProbeRequest

def trial(record):
    print("trial", record.batch, flush=True)

# The plain search tries 1 first, which returns; 2 hangs.
request = ProbeRequest(target="tests.workloads:hangs", device="cpu", memory=64 * 2**20, search="plain")
run_isolated(request, 60, on_trial=trial)
"""


def test_the_child_dies_with_its_caller() -> None:
    # A caller killed mid-probe (kill -9: no cleanup of its own) leaves no probe running.
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert caller.stdout is not None
        ready, _, _ = select.select([caller.stdout], [], [], 60)
        assert ready, "no trial in 60 s"
        assert caller.stdout.readline() == "trial 1\n"
        (child,) = children_of(caller.pid)
    finally:
        caller.kill()
        caller.communicate()
    started = time.monotonic()
    while alive(child) and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert not alive(child)
    assert time.monotonic() - started < 2  # its stdin closed with the caller, its parent changed
