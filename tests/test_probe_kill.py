"""Every process of a probe dies with the process that probes (issue 23): kill -9 of a CLI probe, or of
the service worker running the job, during the fresh-process confirmation leaves none of its
processes alive a second later (the fork server, the confirmation run), and the device's lock free
(for the service, to the node's other worker, which runs the job again: issue 38)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from autotune.engine import lock
from autotune.errors import DeviceBusyError
from tests.serving import ROOT, alive, children_of, descendants, start_server, wait_for

GRACE = 1.0  # seconds after the kill by which every process of the probe must be gone


def _confirming(marker: Path, timeout: float = 180) -> int:
    """The pid of the confirmation run, once it has started (the workload writes the marker)."""
    name: str = wait_for(lambda: next((p.name for p in marker.iterdir()), None), timeout, "the confirmation run")
    return int(name.removeprefix("confirm-"))


def _kill_and_watch(victim: int, family: set[int]) -> list[str]:
    """kill -9 `victim`; the processes of it and `family` still alive GRACE seconds later, by command.
    (The victim too: its device lock is free only once its exit has closed its files.)"""
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + GRACE
    left = {victim, *family}
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if alive(pid)}
        time.sleep(0.01)
    return [f"{pid}: {_command(pid)}" for pid in left if alive(pid)]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def _lock_is_free() -> bool:
    try:
        with lock.device_lock("cpu", wait=False):
            return True
    except DeviceBusyError:
        return False


def _lock_freed() -> bool:
    """Whether the device's lock comes free. A killed process with threads shows as a zombie once its
    main thread has exited, while its other threads may still be tearing down the files they share
    (the lock's among them): under load that took longer than the check (a loaded suite, 2026-11-27),
    so the lock may take a moment more than the processes."""
    return bool(wait_for(_lock_is_free, 10, "the device's lock to come free"))


def test_kill_9_of_a_cli_probe_during_confirmation_leaves_nothing(tmp_path: Path, locks: Path) -> None:
    marker = tmp_path / "marker"
    marker.mkdir()
    args = ["probe", "tests.lock_workloads:hangs_when_confirmed", "-o", f"marker={marker}"]
    args += ["--device", "cpu", "--memory", "4MiB", "--max-batch", "8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    try:
        confirming = _confirming(marker)
        family = descendants(cli.pid)
        assert confirming in family and len(family) >= 2  # the fork server and its confirmation run
        left = _kill_and_watch(cli.pid, family)
    finally:
        if cli.poll() is None:
            cli.kill()
        cli.wait()
    assert not left, left
    assert _lock_freed()


def test_kill_9_of_a_service_worker_during_confirmation_leaves_nothing(tmp_path: Path, locks: Path) -> None:
    marker = tmp_path / "marker"
    marker.mkdir()
    registry = (
        "[workloads.hangs]\n"
        'target = "tests.lock_workloads:hangs_when_confirmed"\n'
        f'options = {{ marker = "{marker}" }}\n'
        "max_batch = 8\n"
    )
    server = start_server(tmp_path / "node", workloads=registry, workers=2, startup_timeout=120)
    try:
        with server.client() as http:
            submitted = http.post("/v1/probes", json={"workload": "hangs", "device": "cpu"})
            assert submitted.status_code == 202, submitted.text
        confirming = _confirming(marker)
        (worker,) = [w for w in children_of(server.process.pid) if confirming in descendants(w)]
        family = descendants(worker)
        assert len(family) >= 2  # the fork server and its confirmation run
        left = _kill_and_watch(worker, family)
        assert not left, left
        # The node's other worker (or the killed one's successor) runs the job again: the lock is its.
        wait_for(lambda: (lock.holder("cpu-budget") or {}).get("pid") not in (None, worker), 60, "the re-run's lock")
        with server.client() as http:
            view = http.get(f"/v1/probes/{submitted.json()['id']}").json()
        assert (view["status"], view["interruptions"]) in {("waiting", 1), ("running", 1)}, view
    finally:
        server.stop()
