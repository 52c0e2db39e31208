"""One probe per device on a node (issue 23): every probe holds its device's lock, whoever runs it.

A service's probe, a CLI probe and a client's local fallback of one device take turns, never two
at once (seen from the lock's holder and from the process listings); a probe waits, saying who
holds the device, or with --no-wait fails at once naming it; the lock is re-entrant for the
holding thread and for the holder's own child processes, and free again the moment its holder
is killed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.engine import lock, zygote
from autotune.errors import DeviceBusyError
from tests.serving import ROOT, alive, finished_probe, free_port, start_server, wait_for

PROBE_MODULES = ("autotune.engine.zygote", "autotune.engine.isolation", "autotune.engine.confirm")
FORK_SERVER = "-m autotune.engine.zygote"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def held_elsewhere(locks: Path) -> Iterator[int]:
    """The budget device's lock held by another process until the test ends; yields its pid."""
    code = (
        "import sys\n"
        "from autotune.engine.lock import device_lock\n"
        "with device_lock('cpu'):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(), cwd=ROOT
    )
    assert holder.stdout is not None and holder.stdin is not None
    assert holder.stdout.readline() == b"held\n"
    yield holder.pid
    holder.stdin.close()
    holder.stdout.close()
    holder.wait(timeout=30)


# The lock itself ---------------------------------------------------------------------------------
def test_a_second_thread_waits_hearing_who_holds_it_and_goes_on_when_it_is_free(locks: Path) -> None:
    heard: list[lock.Wait] = []
    waiting = threading.Event()
    took = threading.Event()

    def second() -> None:
        def on_wait(w: lock.Wait) -> None:
            heard.append(w)
            waiting.set()

        with lock.device_lock("cpu", on_wait=on_wait):
            took.set()

    with lock.device_lock("cpu") as key, lock.device_lock("cpu"):  # re-entrant in the holding thread
        record = lock.holder(key) or {}
        assert (key, record.get("pid"), record.get("device")) == ("cpu-budget", os.getpid(), "cpu")
        thread = threading.Thread(target=second)
        thread.start()
        assert waiting.wait(30)
        assert not took.is_set()
        with pytest.raises(DeviceBusyError, match=f"pid {os.getpid()} "):
            threading_result(lambda: lock.device_lock("cpu", wait=False).__enter__())
    thread.join(30)
    assert took.is_set()
    assert f"pid {os.getpid()} (" in heard[0].line() and not heard[0].done
    assert heard[-1].done and "is free after" in heard[-1].line()


def threading_result(call: object) -> None:
    """Run `call` in another thread (the lock is the holding thread's alone); re-raise its error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]


def test_the_holder_s_children_probe_under_its_lock_and_others_do_not(locks: Path) -> None:
    """A child started with the probe's environment takes its ancestor's lock as its own at once;
    the same variable in a process that is not the holder's descendant opens nothing."""
    code = (
        "from autotune.engine.lock import device_lock\n"
        "from autotune.errors import DeviceBusyError\n"
        "try:\n"
        "    with device_lock('cpu', wait=False):\n"
        "        print('ran', flush=True)\n"
        "except DeviceBusyError:\n"
        "    print('busy', flush=True)\n"
    )
    # Forked, and its parent gone: re-parented away from the holder, with the holder's environment.
    orphan = (
        "import os, time\n"
        "parent = os.getpid()\n"
        "if os.fork():\n"
        "    os._exit(0)\n"
        "while os.getppid() == parent:\n"
        "    time.sleep(0.01)\n"
    ) + code
    with lock.device_lock("cpu"):
        env = {**zygote.child_env(), "PYTHONPATH": str(ROOT)}
        assert lock.HELD_ENV in env
        for program, said in ((code, "ran\n"), (orphan, "busy\n")):
            child = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
            assert child.stdout == said, child.stderr
    assert lock.HELD_ENV not in zygote.child_env()


def test_a_gpu_s_lock_is_its_uuid_however_cuda_visible_devices_numbers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.devices import nvml
    from tests.nvml_standin import FakeGpu, FakeNvml

    mig = FakeGpu(uuid="MIG-dddd-0000", total=2**30, reserved=0)
    gpus = [FakeGpu(uuid=f"GPU-{c * 8}-0000", total=2**30, reserved=0) for c in "abc"]
    gpus.append(FakeGpu(uuid="GPU-eeee", mig_mode=1, mig_slots=[mig]))
    read = nvml.inventory
    monkeypatch.setattr(nvml, "inventory", lambda module=None: read(FakeNvml(gpus)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert lock.device_key("cuda:2") == "cuda-cccccccc0000"
    assert lock.device_key("cuda:3") == "cuda-dddd0000"  # a GPU in MIG mode is its first instance
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert lock.device_key("cuda:0") == "cuda-cccccccc0000" and lock.device_key("cuda") == "cuda-cccccccc0000"
    assert lock.device_key("cpu") == "cpu-budget"
    # Without NVML: the GPU as CUDA_VISIBLE_DEVICES names it.
    monkeypatch.setattr(nvml, "inventory", lambda module=None: nvml.Inventory(available=False, reason="none"))
    assert lock.device_key("cuda:0") == "cuda-2"


def test_the_kernel_frees_the_lock_of_a_killed_holder(held_elsewhere: int) -> None:
    with pytest.raises(DeviceBusyError, match=f"pid {held_elsewhere} "), lock.device_lock("cpu", wait=False):
        pass
    os.kill(held_elsewhere, signal.SIGKILL)
    wait_for(lambda: not alive(held_elsewhere), 10, "the holder to die")
    with lock.device_lock("cpu", wait=False) as key:
        assert (lock.holder(key) or {}).get("pid") == os.getpid()


# The command line --------------------------------------------------------------------------------
def test_no_wait_fails_at_once_with_one_line_naming_the_holder(held_elsewhere: int) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "probe", "mlp", "--device", "cpu", "--memory", "4MiB", "--no-wait"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("probe failed: the CPU budget device is busy: ")
    assert f"pid {held_elsewhere} (a script: python -c " in lines[0] and "--no-wait" in lines[0]
    assert seconds < 60  # the holder never lets go: an answer at all is one that did not wait


# A service, a CLI and a client of one device -----------------------------------------------------
def _registry(log: Path, gate: Path, seen: Path) -> str:
    return (
        "[workloads.gated]\n"
        'target = "tests.lock_workloads:gated"\n'
        f'options = {{ log = "{log}", gate = "{gate}", seen = "{seen}" }}\n'
        "max_batch = 16\n"
    )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _owner(pid: int, owners: set[int]) -> int | None:
    """The first of `owners` among pid and its ancestors."""
    for _ in range(64):
        if pid in owners or pid <= 1:
            return pid if pid in owners else None
        pid = _parent(pid)
    return None


def _environment(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


class ProbeWatch:
    """Samples the process listing while it runs: which owners have probe processes at once. A
    probe process is this test's when its environment has the test's lock directory (other runs
    on this machine probe too). Each one seen is told so in `acknowledge` (a file named by its pid),
    where the workload waits for it (tests.lock_workloads:gated's `seen`)."""

    def __init__(self, owners: set[int], locks: Path, acknowledge: Path) -> None:
        self.owners = owners
        self.acknowledge = acknowledge
        self.mark = f"AUTOTUNE_LOCK_DIR={locks}\0".encode()
        self.seen: set[int] = set()
        self.together: list[set[int]] = []
        self.strays: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProbeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.03):
            probing = set()
            # The command line first, one read per process: most are no probe, and looks that read
            # two files of each cost the test a second more of CPU (a zombie's command line is empty).
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                pid = int(name)
                command = _cmdline(pid)
                if not any(f"-m {m}" in command for m in PROBE_MODULES) or not alive(pid):
                    continue
                if self.mark in _environment(pid):
                    owner = _owner(pid, self.owners)
                    if owner is None:
                        if alive(pid) and _parent(pid) == 1:
                            self.strays.append(command)
                        continue
                    (self.acknowledge / name).touch()
                    # A fork server kept idle between its process's probes runs nothing: its forked
                    # children (the same command line, a server for a parent) are the runs.
                    if FORK_SERVER not in command or FORK_SERVER in _cmdline(_parent(pid)):
                        probing.add(owner)
            self.seen |= probing
            if len(probing) > 1:
                self.together.append(probing)


CLIENT = """\
import json, sys
from pathlib import Path
from autotune.client import AutotuneClient

url, workloads = sys.argv[1], Path(sys.argv[2])
with AutotuneClient(url, retries=0, workloads_file=workloads) as client:
    plan = client.plan("gated", effective_batch=32, device="cpu", memory="4MiB", fallback="local")
    print(json.dumps({"source": client.last_source, "plan": plan.model_dump(mode="json")}), flush=True)
"""


def test_a_service_a_cli_and_a_client_probe_of_one_device_take_turns(tmp_path: Path, locks: Path) -> None:
    log, gate, seen = tmp_path / "batches.jsonl", tmp_path / "gate", tmp_path / "seen"
    gate.touch()  # the service's probe waits at its first batch until the others wait for the device
    seen.mkdir()  # and each probe process at its first batch until the watch below has seen it
    registry = _registry(log, gate, seen)
    server = start_server(tmp_path / "node", workloads=registry)
    started: list[subprocess.Popen[bytes]] = []
    try:
        with server.client() as http:
            submitted = http.post("/v1/probes", json={"workload": "gated", "device": "cpu"})
            assert submitted.status_code == 202, submitted.text
            probe_id = submitted.json()["id"]
            wait_for(lambda: (lock.holder("cpu-budget") or {}).get("pid") == server.process.pid, 60, "the lock", server)

            cli_err, client_err = tmp_path / "cli.err", tmp_path / "client.err"
            workloads = tmp_path / "node" / "workloads.toml"
            options = [f"log={log}", f"gate={gate}", f"seen={seen}"]
            cli_args = ["probe", "tests.lock_workloads:gated", *(arg for o in options for arg in ("-o", o))]
            cli_args += ["--device", "cpu", "--memory", "4MiB", "--max-batch", "16", "--no-confirm", "--json"]
            with cli_err.open("wb") as cli_sink, client_err.open("wb") as client_sink:
                for args, sink in (
                    (["-m", "autotune.cli", *cli_args], cli_sink),
                    (["-c", CLIENT, f"http://127.0.0.1:{free_port()}", str(workloads)], client_sink),
                ):
                    started.append(
                        subprocess.Popen(
                            [sys.executable, *args], stdout=subprocess.PIPE, stderr=sink, env=_env(), cwd=ROOT
                        )
                    )
            cli, client = started
            with ProbeWatch({server.process.pid, cli.pid, client.pid}, locks, seen) as watch:
                for name, path in (("the CLI", cli_err), ("the client", client_err)):
                    wait_for(lambda p=path: "waiting for the CPU budget device" in p.read_text(), 60, f"{name} to wait")
                gate.unlink()
                view = finished_probe(http, probe_id, timeout=120)
                cli_out, _ = cli.communicate(timeout=120)
                client_out, _ = client.communicate(timeout=120)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
        server.stop()

    # All three answered.
    assert view["status"] == "succeeded", view
    assert cli.returncode == 0, cli_err.read_text()
    assert json.loads(cli_out)["max_micro_batch"] >= 1
    assert client.returncode == 0, client_err.read_text()
    answer = json.loads(client_out)
    assert answer["source"] == "local" and answer["plan"]["micro_batch"] >= 1
    # Each waited, told who held the device: the service first.
    said = cli_err.read_text()
    assert (
        f"waiting for the CPU budget device: pid {server.process.pid} (the autotune service: probe {probe_id} " in said
    ), said
    assert "Traceback" not in said + client_err.read_text()

    # The process listings: never two owners' probe processes at once, none left orphaned.
    assert not watch.together, watch.together
    assert not watch.strays, watch.strays
    assert watch.seen == {server.process.pid, cli.pid, client.pid}

    # The batches: each made under its own probe's lock, the probes one after the other.
    records = [json.loads(line) for line in log.read_text().splitlines()]
    owners = {server.process.pid: "service", cli.pid: "cli", client.pid: "client"}
    spans: dict[str, list[float]] = {}
    for record in records:
        (owner,) = [owners[pid] for pid in record["chain"] if pid in owners]
        assert record["holder"] in record["chain"], record  # the lock's holder is this batch's probe
        span = spans.setdefault(owner, [record["time"], record["time"]])
        span[0], span[1] = min(span[0], record["time"]), max(span[1], record["time"])
    assert set(spans) == {"service", "cli", "client"}
    ordered = sorted(spans.values())
    assert all(earlier[1] < later[0] for earlier, later in itertools.pairwise(ordered)), spans


# The lock is free when the device is (issue 38, item 2) ------------------------------------------
HOLDER = """\
import subprocess, sys
from autotune.engine import lock, zygote

marker, linger = sys.argv[1], sys.argv[2]
with lock.device_lock("cpu"):
    args = ["tests.lock_child", marker, linger]
    zygote.spawn(args, stdin=subprocess.DEVNULL, stdout=None, stderr=None)  # a new interpreter, as on a GPU
    with zygote.serving():
        zygote.spawn(args, stdin=subprocess.DEVNULL, stdout=None, stderr=None)  # forked by the probe's server
        print("ready", flush=True)
        sys.stdin.read()
"""


def test_after_kill_9_of_a_probe_the_lock_waits_for_its_processes_even_for_an_idle_fork_server(
    tmp_path: Path, locks: Path
) -> None:
    """A probe's processes outlive its killed caller for a moment (here a second: they die by their
    parent-death signal 50-300 ms later, a CUDA context takes longer): the lock stays taken until
    the last has exited, for a waiter whose idle fork server would fork its first run at once."""
    marker = tmp_path / "marker"
    marker.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(marker), "1.0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
        cwd=ROOT,
    )
    try:
        # Meanwhile this process gets a fork server, idle once its first run has ended.
        with zygote.serving():
            warm_up, server = zygote.spawn(["tests.lock_child", str(marker), "0"], stdin=None, stdout=None, stderr=None)
            assert warm_up.wait(120) == 0
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        listed = wait_for(lambda: [p for p in marker.glob("child-*")][1:] and list(marker.glob("child-*")), 60, "runs")
        children = [int(p.name.removeprefix("child-")) for p in listed]
        assert len(children) == 2 and all(alive(pid) for pid in children), children
        holder.kill()
        with lock.device_lock("cpu"):
            taken = time.time()
            left = [pid for pid in children if alive(pid)]
            with zygote.serving():  # the idle server forks this probe's first run at once
                run, forked_by = zygote.spawn(
                    ["tests.lock_child", str(marker), "0"], stdin=None, stdout=None, stderr=None
                )
                assert run.wait(60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(30)
        for stream in (holder.stdin, holder.stdout):
            assert stream is not None
            stream.close()
        zygote.close_idle()
    assert forked_by == server  # the server kept idle between this process's probes
    assert not left, f"the lock was taken while {left} of the killed probe still ran"
    # The new interpreter lingers its second; the forked run too, unless its server, seeing its
    # caller gone, killed it first.
    ended = [float(p.read_text()) for p in marker.glob("ended-*")]
    assert ended and taken >= max(ended), (taken, ended)
    print(f"lock taken {taken - max(ended):.3f} s after the killed probe's last process ended")


def test_a_probe_that_lets_go_before_its_run_has_ended_leaves_the_device_to_it(tmp_path: Path, locks: Path) -> None:
    """An interrupt can cut short the wait for a probe's run: the probe lets go of the lock while
    its run still ends. The lock stays the run's until it has exited."""
    marker = tmp_path / "marker"
    marker.mkdir()
    with lock.device_lock("cpu"):
        run, _ = zygote.spawn(["tests.lock_child", str(marker), "0.5", "now"], stdin=None, stdout=None, stderr=None)
        wait_for(lambda: list(marker.glob("child-*")), 60, "the run")
    try:
        with pytest.raises(DeviceBusyError, match=f"pid {os.getpid()} "), lock.device_lock("cpu", wait=False):
            pass  # named: this process's probe, whose run holds it
    finally:
        assert run.wait(60) == 0
    with lock.device_lock("cpu", wait=False) as key:
        assert (lock.holder(key) or {}).get("pid") == os.getpid()
