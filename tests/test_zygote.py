"""The fork server: a probe's processes forked from one interpreter that imported torch once, each
still a process of its own, none outliving the caller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autotune.engine import zygote

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], env: dict[str, str], given: bytes = b"") -> tuple[dict[str, object], int, bytes]:
    read_end, write_end = os.pipe()
    child, parent = zygote.spawn(
        ["tests.zygote_child", str(write_end), *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(write_end,),
    )
    os.close(write_end)
    _, stderr = child.communicate(given, timeout=120)
    with os.fdopen(read_end) as answer:
        said = json.loads(answer.read())
    assert said["ppid"] == parent
    return said, int(child.returncode or 0), stderr


def test_children_of_one_probe_are_forked_from_one_server_that_imported_torch(tmp_path: Path) -> None:
    env = {**os.environ, "ZYGOTE_TEST_MARKER": "first", "PYTHONPATH": str(ROOT)}
    os.chdir(tmp_path)
    try:
        with zygote.serving():
            first, code, stderr = _run(["3"], env, b"the request")
            second, _, _ = _run(["0"], {**env, "ZYGOTE_TEST_MARKER": "second"})
    finally:
        os.chdir(ROOT)
    assert code == 3 and stderr == b"said\n"
    assert first["preloaded"] and second["preloaded"]  # torch came with the server
    assert first["ppid"] == second["ppid"] != os.getpid()  # one server forked both
    assert first["pid"] != second["pid"] and first["sid"] == first["pid"]  # each its own process and session
    assert (first["marker"], second["marker"]) == ("first", "second")  # the environment of each call
    assert first["stdin"] == "the request" and first["cwd"] == str(tmp_path)


def test_without_a_server_a_child_is_a_new_interpreter() -> None:
    said, code, _ = _run(["0"], {**os.environ, "PYTHONPATH": str(ROOT)})
    assert code == 0 and said["ppid"] == os.getpid() and not said["preloaded"]


def test_a_probe_of_a_gpu_starts_an_interpreter_per_child_even_where_a_nested_probe_would_fork() -> None:
    """CUDA cannot run in a child forked from a process whose torch asked the driver anything (seen on
    the H100: "Cannot re-initialize CUDA in forked subprocess"): only the budget device's probes fork."""
    assert zygote.forks_for("cpu-budget")
    assert not zygote.forks_for("cuda-GPU-0d4b2a7e")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with zygote.serving(zygote.forks_for("cuda-GPU-0d4b2a7e")), zygote.serving():  # run_isolated's, inside
        said, code, _ = _run(["0"], env)
    assert code == 0 and said["ppid"] == os.getpid() and not said["preloaded"]


def _sleeping_child(write_end: int, *, stderr: int) -> tuple[subprocess.Popen[bytes] | zygote.Forked, int]:
    """A child that says who it is on `write_end` (closed here once passed) and then sleeps."""
    spawned = zygote.spawn(
        ["tests.zygote_child", str(write_end), "sleep"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        pass_fds=(write_end,),
    )
    os.close(write_end)
    return spawned


def test_a_killed_child_reports_its_signal() -> None:
    read_end, write_end = os.pipe()
    with zygote.serving():
        child, _ = _sleeping_child(write_end, stderr=subprocess.PIPE)
        with pytest.raises(subprocess.TimeoutExpired):
            child.communicate(b"", timeout=0.5)
        child.kill()
        child.communicate()
    os.close(read_end)
    assert child.returncode == -signal.SIGKILL


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_server_and_its_child_die_with_the_caller() -> None:
    """kill -9 of the probe's process: its server sees its stdin end, kills the child and exits."""
    script = (
        "import json, os, subprocess, sys, time\n"
        "from autotune.engine import zygote\n"
        "read_end, write_end = os.pipe()\n"
        "with zygote.serving():\n"
        "    child, server = zygote.spawn(['tests.zygote_child', str(write_end), 'sleep'], env=dict(os.environ),\n"
        "        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None, pass_fds=(write_end,))\n"
        "    child.stdin.close()\n"
        "    said = json.loads(os.fdopen(read_end).readline())\n"
        "    print(json.dumps([server, said['pid']]), flush=True)\n"
        "    time.sleep(3600)\n"
    )
    caller = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert caller.stdout is not None
    server, child = json.loads(caller.stdout.readline())
    caller.kill()
    caller.wait()
    caller.stdout.close()
    deadline = time.monotonic() + 30
    while not (_gone(server) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(server) and _gone(child)


def test_a_long_environment_reaches_the_child() -> None:
    """A request longer than one socket read (a cluster's environment of 100 KB) keeps its pipes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZYGOTE_TEST_PADDING": "x" * 100_000, "ZYGOTE_TEST_MARKER": "long"}
    with zygote.serving():
        said, code, _ = _run(["0"], env)
    assert code == 0 and said["preloaded"] and said["marker"] == "long"


def test_when_the_server_dies_the_next_child_is_a_new_interpreter() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with zygote.serving():
        first, _, _ = _run(["0"], env)
        os.kill(int(first["ppid"]), signal.SIGKILL)  # the server
        second, code, _ = _run(["0"], env)
    assert code == 0 and second["ppid"] == os.getpid() and not second["preloaded"]


# Between probes ----------------------------------------------------------------------------------
def _probe_in_a_thread(env: dict[str, str]) -> dict[str, object]:
    """One probe's block in a thread of its own, which then ends (as a service's job threads do)."""
    said: list[dict[str, object]] = []

    def probe() -> None:
        with zygote.serving():
            said.append(_run(["0"], env)[0])

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(timeout=120)
    assert said, "the probe's thread did not finish"
    return said[0]


def test_the_next_probe_of_the_process_forks_from_the_same_server_unless_its_environment_changed() -> None:
    zygote.close_idle()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = _probe_in_a_thread(env)
    second = _probe_in_a_thread({**env, "ZYGOTE_TEST_MARKER": "second"})
    # The first probe's thread has ended: the server it took lives on, idle, for the next probe.
    assert first["preloaded"] and first["ppid"] == second["ppid"] != os.getpid()
    assert second["marker"] == "second"  # each child still gets the environment of its call
    os.environ["AUTOTUNE_ZYGOTE_TEST"] = "changed"  # read by nothing, but a server's imports may read AUTOTUNE_*
    try:
        other = _probe_in_a_thread(env)
    finally:
        del os.environ["AUTOTUNE_ZYGOTE_TEST"]
    again = _probe_in_a_thread(env)
    assert other["ppid"] != first["ppid"] and other["preloaded"]
    assert again["ppid"] == first["ppid"]  # the first one was kept for its environment


def _interrupted_probe(write_end: int, read_end: int) -> tuple[int, int]:
    """A probe that an interrupt ends while its child runs: (its server, its child)."""
    started: list[int] = []
    with zygote.serving():
        child, server = _sleeping_child(write_end, stderr=subprocess.DEVNULL)
        assert child.stdin is not None
        child.stdin.close()
        with os.fdopen(read_end) as answer:
            started += [server, int(json.loads(answer.readline())["pid"])]
        raise KeyboardInterrupt(started)


def test_a_probe_that_ends_with_its_child_running_takes_its_server_and_child_down() -> None:
    read_end, write_end = os.pipe()
    with pytest.raises(KeyboardInterrupt) as interrupt:
        _interrupted_probe(write_end, read_end)
    server, child = interrupt.value.args[0]
    deadline = time.monotonic() + 30
    while not (_gone(server) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(server) and _gone(child)
    assert server not in [kept.pid for _, kept in zygote._idle]


def test_probes_that_failed_keep_their_server_for_the_next_probe() -> None:
    """The workload's error and a child's abrupt exit are the probe's failures, not the server's:
    the next isolated probe of the process forks from the same server."""
    from autotune.engine.isolation import run_isolated
    from autotune.engine.probe import ProbeRequest
    from autotune.errors import NotAnOOMError, ProbeCrashedError

    zygote.close_idle()
    memory = 64 * 2**20
    with pytest.raises(NotAnOOMError, match="shape mismatch"):
        run_isolated(ProbeRequest(target="tests.workloads:broken", device="cpu", memory=memory), timeout=120)
    kept = [server.pid for _, server in zygote._idle]
    assert len(kept) == 1
    with pytest.raises(ProbeCrashedError, match="exited with code 7"):
        run_isolated(ProbeRequest(target="tests.workloads:exits", device="cpu", memory=memory), timeout=120)
    assert [server.pid for _, server in zygote._idle] == kept
