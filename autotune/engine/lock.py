"""One probe per device on this node, whoever starts it: an OS lock per device that every probe holds.

Two probes on one device measure each other: the second one's memory is the first one's missing
headroom. The service's database lease keeps its own workers apart, but not a `autotune probe` typed
beside it, a client that probes locally while the service is down, or a framework's tuner. So every
probe (`probe_and_confirm`, `probe_workload`, `run_probe`) holds its device's lock for the whole of
it, its isolated search and confirmation runs included: `flock` on a file per device identity in
AUTOTUNE_LOCK_DIR (default /tmp/autotune-UID), `cpu-budget.lock` for the budget device and
`cuda-<UUID>.lock` for a GPU (read through NVML, so that `cuda:0` under two CUDA_VISIBLE_DEVICES is
still one card). The kernel releases it when its holder and the probe's processes have died,
however they die: a killed probe never leaves the device locked.

A second probe of the device waits, telling its caller who holds it (the holder writes its pid,
command, start and kind into the lock file: the service with the probe's id, the command line, or
a script), or fails at once with `DeviceBusyError` when told not to wait (`--no-wait`).

The lock is free only when the device is: the probe's processes hold it with their caller. Every
child a probe starts (`zygote.spawn`: the isolated search, each confirmation run, forked by the fork
server or a new interpreter) inherits the lock's descriptor (`held_fds`), and `flock` belongs to
the open file, not to a process: after kill -9 of the probing process, the lock stays taken until
the last of its children has exited too (they die by their parent-death signal, 50-300 ms later),
so a waiter, even one whose idle fork server forks at once, never runs beside them. A probe that
ends normally has reaped its children before it lets go (`LOCK_UN`); one whose child may still run
(an interrupt cut its wait short: `note_child`) only closes its copy, leaving the lock to the
child until it exits. The fork server kept between probes never holds it (it closes its copy as
soon as it has forked the child it was sent for).

The lock is re-entrant: within a process for the thread that holds it (the service's job calls the
engine, `probe_workload` calls `run_probe`), and across processes for the holder's descendants,
which inherit AUTOTUNE_LOCK_HELD (`inherited_env`, in every child's environment): the isolated
search's `run_probe` is its parent's probe, not a second one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from autotune.errors import ConfigError, DeviceBusyError

log = logging.getLogger(__name__)

HELD_ENV = "AUTOTUNE_LOCK_HELD"  # the locks a process's ancestors hold for it (JSON), see `inherited_env`
POLL_SECONDS = 0.1  # how often a waiting probe tries the lock again
_MAX_RECORD = 4096


@dataclass(frozen=True)
class Wait:
    """What a probe waiting for its device hears: who holds it, and then that it is free."""

    device: str  # the device in words: "cpu (the budget device)", "cuda:0 (GPU-1a2b...)"
    holder: str  # who holds it, in words
    seconds: float  # waited so far
    done: bool = False  # the lock is ours now
    record: dict[str, object] | None = None  # what the lock file says of the holder (`holder`)

    def line(self) -> str:
        if self.done:
            return f"{self.device} is free after {self.seconds:.1f} s of waiting: probing"
        return f"waiting for {self.device}: {self.holder}"


WaitCallback = Callable[[Wait], None]


@dataclass
class _Held:
    spec: str  # the device as asked: cpu, cuda:N, or default
    key: str  # the lock's name: cpu-budget, cuda-<uuid>
    pid: int  # the process that holds the OS lock: this one, or an ancestor
    depth: int = 1
    fd: int | None = None  # the lock's descriptor, when this process holds the OS lock
    children: list[int] = field(default_factory=list, compare=False)  # pids given the descriptor


_local = threading.local()
_fds: set[int] = set()  # lock descriptors this process holds, closed in a forked copy of it


def _held() -> list[_Held]:
    held: list[_Held] | None = getattr(_local, "held", None)
    if held is None:
        held = _local.held = []
    return held


def _forget_in_fork() -> None:
    # A fork of the holder (a DataLoader worker of an in-process probe) must not keep the lock
    # after the probe releases it, nor think it holds it.
    for fd in list(_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _fds.clear()
    _local.held = []


os.register_at_fork(after_in_child=_forget_in_fork)


# Which device ------------------------------------------------------------------------------------
def _spec(device: str | None) -> str:
    if device is None:
        return "default"
    text = device.strip().lower()
    return "cuda:0" if text == "cuda" else text


def _default_is_cuda() -> bool:
    """The default device's kind as `open_device` will choose it: CUDA when present."""
    from autotune.request import cpu_only_torch

    if cpu_only_torch():
        return False
    import torch

    return bool(torch.cuda.is_available())


def device_key(device: str | None) -> str:
    """The lock's name for a device as a request names it (`cpu`, `cuda:N`, None for the default)."""
    from autotune.request import parse_device

    kind, index = ("cuda", 0) if device is None and _default_is_cuda() else parse_device(device or "cpu")
    if kind == "cpu":
        return "cpu-budget"
    uuid = _cuda_uuid(index)
    if uuid is not None:
        from autotune.devices.nvml import uuid_key

        return f"cuda-{uuid_key(uuid)}"
    # No NVML: the GPU as CUDA_VISIBLE_DEVICES names it, else its index.
    visible = [t.strip() for t in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if t.strip()]
    name = visible[index] if index < len(visible) else str(index)
    return "cuda-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _cuda_uuid(index: int) -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # exact, and this process pays nothing
        from autotune.devices.nvml import torch_device_uuid

        return torch_device_uuid(index)
    from autotune.devices.nvml import cuda_uuid

    return cuda_uuid(index)


def _describe_device(spec: str, key: str) -> str:
    if key == "cpu-budget":
        return "the CPU budget device" if spec in ("cpu", "default") else f"{spec} (the CPU budget device)"
    return f"{'the default device' if spec == 'default' else spec} ({key})"


# Where ------------------------------------------------------------------------------------------
def lock_dir() -> Path:
    """AUTOTUNE_LOCK_DIR, made if missing; by default /tmp/autotune-UID, this user's own."""
    from autotune.settings import get_settings

    configured = get_settings().lock_dir
    if configured is not None:
        try:
            configured.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot make the device lock directory {configured} (AUTOTUNE_LOCK_DIR): {exc.strerror}: "
                "set AUTOTUNE_LOCK_DIR to a directory this user can write"
            ) from None
        return configured
    path = Path(f"/tmp/autotune-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(
            f"{path}, the default device lock directory, is not a directory of this user's: set AUTOTUNE_LOCK_DIR "
            "to one (every probe on this node must use the same)"
        )
    return path


def _open(path: Path) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this process may write its name in it."""
    flags = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd, writable = os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:
        try:  # another user's lock file in a shared directory: lockable, not writable
            fd, writable = os.open(path, flags | os.O_RDONLY), False
        except OSError as exc:
            raise _unusable(path, exc) from None
    except OSError as exc:
        raise _unusable(path, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"the device lock {path} is not a plain file: remove it, or set AUTOTUNE_LOCK_DIR elsewhere")
    return fd, writable


def _unusable(path: Path, exc: OSError) -> ConfigError:
    return ConfigError(
        f"cannot open the device lock {path}: {exc.strerror}: set AUTOTUNE_LOCK_DIR to a directory every "
        "probe on this node can write"
    )


# Who holds it -----------------------------------------------------------------------------------
def _command() -> str:
    try:
        parts = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        words = [p.decode(errors="replace") for p in parts]
    except OSError:
        words = [sys.executable, *sys.argv]
    if words and words[0] == sys.executable:
        words[0] = "python"
    words[0] = os.path.basename(words[0])
    text = " ".join(" ".join(words).split())  # one line: `python -c` code has newlines
    return text if len(text) <= 120 else text[:117] + "..."


KINDS = ("service", "cli", "script")


def _kind() -> str:
    """Who this process is, for a waiter: the command line (`autotune ...`, `python -m autotune.cli`)
    or a script (anything else: a training job's client, a framework's tuner). The service names
    itself (`device_lock(kind="service")`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = str(getattr(spec, "name", "") or "")
    if module == "autotune" or module.startswith(("autotune.cli", "autotune.__main__")):
        return "cli"
    return "cli" if os.path.basename(sys.argv[0] if sys.argv else "") == "autotune" else "script"


def holder(key: str) -> dict[str, object] | None:
    """What the lock file of `key` says of its holder (pid, command, started, device), or None.
    It names the last holder: whether that one still holds it, only the lock itself says."""
    try:
        with open(lock_dir() / f"{key}.lock", "rb") as file:
            text = file.read(_MAX_RECORD)
    except OSError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def describe(record: dict[str, object]) -> str:
    """The holder as a person knows it: "the autotune service: probe 1a2b... on node gpu-7", "the
    autotune command line: autotune probe mlp ...", "a script: python train.py"."""
    kind, command, name = record.get("kind"), record.get("command", "?"), record.get("name")
    if kind == "service":
        return f"the autotune service: {name or command}"
    if kind == "cli":
        return f"the autotune command line: {command}"
    if kind == "script":
        return f"a script: {command}"
    return str(command)  # a lock file written by an autotune that did not say its kind


def _describe_holder(record: dict[str, object] | None) -> str:
    if record is None:
        return "another probe holds it (one that did not write its name in the lock file)"
    started = record.get("started")
    since = ""
    if isinstance(started, int | float):
        clock = time.strftime("%H:%M:%S", time.localtime(started))
        since = f" since {clock} ({max(0.0, time.time() - started):.0f} s)"
    pid = record["pid"]
    if isinstance(pid, int) and not _running(pid):
        # Killed (its lock file still names it): the lock is held by its probe's processes, which
        # die with it, a moment later.
        return f"pid {pid} ({describe(record)}) was probing it{since} and has ended; its probe's processes are ending"
    return f"pid {pid} ({describe(record)}) has been probing it{since}"


def _current_holder(key: str) -> dict[str, object] | None:
    # The new holder writes its name just after it takes the lock: give it a moment.
    for _ in range(5):
        record = holder(key)
        if record is not None:
            return record
        time.sleep(0.02)
    return None


# Taking it --------------------------------------------------------------------------------------
def _inherited(spec: str, key: str | None) -> _Held | None:
    """The lock an ancestor of this process holds for the device, from AUTOTUNE_LOCK_HELD."""
    try:
        entries = json.loads(os.environ.get(HELD_ENV, "[]"))
    except ValueError:
        return None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int):
            continue
        if (entry.get("spec") == spec or (key is not None and entry.get("key") == key)) and _is_ancestor(entry["pid"]):
            return _Held(spec=spec, key=str(entry.get("key")), pid=entry["pid"])
    return None


def _is_ancestor(pid: int) -> bool:
    here = os.getppid()
    for _ in range(64):
        if here == pid:
            return True
        if here <= 1:
            return False
        try:
            status = Path(f"/proc/{here}/stat").read_text()
        except OSError:
            # No /proc (macOS): a live process named by our environment is taken at its word.
            return _alive(pid)
        here = int(status[status.rindex(")") + 2 :].split()[1])
    return False


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return _alive(pid)
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def held_fds() -> list[int]:
    """The descriptors of the device locks this thread's probe holds itself: every process the
    probe starts inherits them (`zygote.spawn`), so that the lock stays taken until the last of the
    probe's processes has exited, however the probe ends (kill -9 of this process included)."""
    return [h.fd for h in _held() if h.fd is not None and h.pid == os.getpid()]


def note_child(pid: int) -> None:
    """A process this thread's probe started with its locks' descriptors (`held_fds`): when the
    probe lets go, a lock one of them still holds is left to it, not released under it."""
    for entry in _held():
        if entry.fd is not None and entry.pid == os.getpid():
            entry.children.append(pid)


def inherited_env() -> dict[str, str]:
    """AUTOTUNE_LOCK_HELD for a child of this thread's probe: the device locks it holds, which the
    child's own probe calls then take as theirs. Empty when it holds none."""
    held = _held()
    if not held:
        return {}
    entries = [{"spec": h.spec, "key": h.key, "pid": h.pid} for h in held]
    return {HELD_ENV: json.dumps(entries)}


@contextlib.contextmanager
def device_lock(
    device: str | None,
    *,
    wait: bool = True,
    on_wait: WaitCallback | None = None,
    kind: str | None = None,
    name: str | None = None,
) -> Iterator[str]:
    """Hold the lock of `device` (a request's: cpu, cuda:N, None for the default) for the block;
    yields its name. Another probe holding it: wait (telling `on_wait`, else the log, who holds it
    and then that it is free), or, with `wait=False`, raise DeviceBusyError naming the holder.
    `kind` (service, cli, script: by default the command line or a script, as this process was
    started) and `name` (the service's probe) say who holds it to those who wait."""
    spec = _spec(device)
    held = _held()
    again = next((h for h in held if h.spec == spec), None) or _inherited(spec, None)
    key = again.key if again is not None else device_key(device)
    again = again or next((h for h in held if h.key == key), None) or _inherited(spec, key)
    if again is not None:  # this thread's probe, or an ancestor's: its lock already covers us
        with _entered(again):
            yield key
        return
    path = lock_dir() / f"{key}.lock"
    fd, writable = _open(path)
    _fds.add(fd)
    entry: _Held | None = None
    try:
        _acquire(fd, spec, key, wait, on_wait)
    except BaseException:
        _fds.discard(fd)
        os.close(fd)  # never ours: the holder's name in the file stays
        raise
    try:
        if writable:
            record = {
                "pid": os.getpid(),
                "command": _command(),
                "started": time.time(),
                "device": spec,
                "kind": kind if kind in KINDS else _kind(),
                **({"name": name} if name else {}),
            }
            with contextlib.suppress(OSError):  # a full disk: the lock holds all the same
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode(), 0)
        entry = _Held(spec=spec, key=key, pid=os.getpid(), fd=fd)
        with _entered(entry):
            yield key
    finally:
        # The probe's own processes, which inherited the descriptor, are reaped by now (`isolation`
        # and `confirm` end and wait for theirs before the probe's block ends), unless an interrupt
        # cut that wait short: a lock one of them still holds stays theirs until it exits (only
        # closed here). Else LOCK_UN, not only the close: a copy of the descriptor in some other
        # fork would keep it locked. A holder that dies without coming here leaves it to them too.
        running = entry is not None and any(_running(pid) for pid in entry.children)
        if writable and not running:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a waiter reading it now must not name a probe that has ended
        if not running:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        _fds.discard(fd)
        os.close(fd)


@contextlib.contextmanager
def _entered(entry: _Held) -> Iterator[None]:
    held = _held()
    if entry not in held:
        held.append(entry)
    else:
        entry.depth += 1
    try:
        yield
    finally:
        entry.depth -= 1
        if entry.depth <= 0 and entry in held:
            held.remove(entry)


def _acquire(fd: int, spec: str, key: str, wait: bool, on_wait: WaitCallback | None) -> None:
    started = time.monotonic()
    told: tuple[object, object] | None = None  # the holder last told of: (pid, start)
    said = ""
    tell = on_wait or (lambda w: log.warning("autotune: %s", w.line()))
    device = _describe_device(spec, key)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            if told is not None:
                tell(Wait(device=device, holder=said, seconds=time.monotonic() - started, done=True, record=None))
            return
        record = _current_holder(key)
        if not wait:
            raise DeviceBusyError(
                f"{device} is busy: {_describe_holder(record)}; a second probe beside it would measure a device in "
                "use: wait for it (drop --no-wait; wait_for_device=True in Python)"
            )
        who = (None, None) if record is None else (record.get("pid"), record.get("started"))
        if who != told:  # the first time, and whenever another probe has taken it meanwhile
            told, said = who, _describe_holder(record)
            tell(Wait(device=device, holder=said, seconds=time.monotonic() - started, record=record))
        time.sleep(POLL_SECONDS)
