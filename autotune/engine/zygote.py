"""Fresh processes without a fresh interpreter each: a fork server that has imported torch.

A probe runs its search in a child process and each confirmation in another (`isolation`,
`confirm`): a process of its own, whatever the workload does to it. Starting an interpreter and
importing torch costs 2-3 s a process on a small machine, more than a small trial, and a probe
started three or four. So `probe_and_confirm` starts one server for the probe (`python -m
autotune.engine.zygote`, a new interpreter with the caller's `sys.path`), which imports torch and
autotune's engine and then forks one child per run. A child is still a process of its own: its own
address space and allocator (the server never imports a workload: the child does, as a new process
would), its own session, stdin, stdout and stderr as the caller asked; it runs the same entry point
(`python -m autotune.engine.isolation` / `confirm`) as a spawned interpreter would.

Only probes on the CPU budget device fork (`forks_for`): a GPU probe's children start interpreters,
as CUDA cannot run in a child forked from a process whose torch has asked the driver anything.

`serving()` marks a probe's calls; `spawn` forks from its server (taken at the first child) or,
without one, starts an interpreter. A forked child is a `Forked`, which the callers use as they use
a `subprocess.Popen`: pid, stdin, stderr, poll, wait, kill, communicate. The server sends each
child's exit status back on its socket. It serves one probe at a time (a probe's runs are
sequential; concurrent probes take servers of their own), exits when its stdin reaches end of file
(the caller has gone, however it went) or its socket closes, and kills a child still running then,
so no run outlives its caller. A killed caller takes the server down at once (PR_SET_PDEATHSIG,
armed before its imports), and the server its children (the same signal): nothing of a probe is
left a moment after kill -9 of its process. Each child holds the probe's device lock with it (the
lock's descriptor goes with the request, `lock.held_fds`; the server closes its copy once it has
forked): the device is free only when the last of them has exited, not when its caller has. A
server that cannot start, or dies, makes `spawn` start a new interpreter instead.

A server outlives its probe: at the probe's end it waits, idle, for the next probe of this process
(a service answers job after job), which takes it when it was started for the same environment
(`_key`: the interpreter, `sys.path` and the variables imports read), so a later probe starts no
interpreter. Its children see nothing of that history: the server only imports, warms up and forks,
never runs a workload, so its hundredth child starts from the state its first did. A probe that
failed (the workload's error, a crash, a timeout: the child is gone, or was killed) keeps its
server too once every child's end is seen; a probe interrupted (Ctrl-C, SIGTERM, the caller's
exit), or one with a child still running, closes its server instead. Servers are
started by one thread kept for the process (`_starter`): Linux sends the parent-death signal when
the *thread* that started a process ends, and a service's probes run in threads that come and go.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import fcntl
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import IO, Any

# What the server imports before it forks: what every child would import first.
PRELOAD = ("torch", "autotune.engine.probe", "autotune.engine.confirm", "autotune.engine.isolation")
_MAX_MESSAGE = 1 << 20


# The caller's side ------------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    """The environment of a probe's child: this one, with this process's `sys.path` (the current
    directory made absolute) as PYTHONPATH, so the child imports autotune and the workload as this
    process does."""
    from autotune.engine import lock

    path = [os.path.abspath(p or os.curdir) for p in [*sys.path, ""]]
    # The device lock this thread's probe holds is the child's too (it is part of that probe).
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **lock.inherited_env()}


class _Serving:
    """A probe's claim on a server, taken at its first child (a probe may need none)."""

    def __init__(self, fork: bool = True) -> None:
        self.thread = threading.current_thread()  # a probe's runs are sequential, in its thread
        self.zygote: Zygote | None = None
        self.failed = not fork  # a probe that forks nothing starts an interpreter per child

    def get(self) -> Zygote | None:
        if self.zygote is None and not self.failed:
            self.zygote = _take()
            self.failed = self.zygote is None
        return self.zygote


# Servers between probes --------------------------------------------------------------------------
IDLE_SERVERS = 2  # kept at most; each holds an interpreter with torch imported (some 300 MB)

_idle: list[tuple[str, Zygote]] = []  # (key, server), the most recently used last
_idle_lock = threading.Lock()
_starter: concurrent.futures.ThreadPoolExecutor | None = None


# The variables a server's imports and warm-up may read (torch's, its libraries', ours, the
# interpreter's); a child gets its whole environment anew, so only these can make an old server's
# children differ from a new one's. AUTOTUNE_LOCK_HELD is read by children alone.
_READ_AT_IMPORT = ("AUTOTUNE_", "TORCH", "PYTORCH_", "CUDA", "NVIDIA_", "NCCL_", "OMP_", "MKL_", "KMP_", "GOMP_",
                   "OPENBLAS_", "LD_", "PYTHON", "TMP", "TEMP", "HOME", "XDG_", "TRITON_")  # fmt: skip


def _key(env: dict[str, str]) -> str:
    """What a server was started for: the interpreter, and what of the environment its imports may
    read (the caller's `sys.path` among it, as PYTHONPATH)."""
    from autotune.engine import lock

    read = {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT) and k != lock.HELD_ENV}
    return json.dumps([sys.executable, sorted(read.items())])


def _take() -> Zygote | None:
    """An idle server started for this environment, else a new one (None when none can start)."""
    global _starter
    key = _key(child_env())
    with _idle_lock:
        found = next((i for i, (k, z) in enumerate(_idle) if k == key and z.alive()), None)
        if found is not None:
            return _idle.pop(found)[1]
        if _starter is None:
            _starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="autotune-zygote")
        starter = _starter
    zygote = starter.submit(Zygote._start).result()
    if zygote is not None:
        zygote.key = key
    return zygote


def _give_back(zygote: Zygote) -> None:
    """Keep a server whose probe ended with no child running for the next probe; close the rest."""
    if not zygote.idle():
        zygote.close()
        return
    with _idle_lock:
        _idle.append((zygote.key, zygote))
        surplus = _idle[:-IDLE_SERVERS] if len(_idle) > IDLE_SERVERS else []
        del _idle[: len(surplus)]
    for _, old in surplus:
        old.close()


def close_idle() -> None:
    """End the servers kept between probes (at exit; a test that wants the next probe to start one)."""
    with _idle_lock:
        servers = [z for _, z in _idle]
        _idle.clear()
    for zygote in servers:
        zygote.close()


def _forget_idle() -> None:
    # A fork of this process (a DataLoader's worker, a user's multiprocessing) shares the servers'
    # sockets: it must start servers of its own, and never close the parent's.
    global _starter
    _idle.clear()
    _starter = None


atexit.register(close_idle)
os.register_at_fork(after_in_child=_forget_idle)


_current: list[_Serving] = []
_current_lock = threading.Lock()


def _serving_here() -> _Serving | None:
    with _current_lock:
        return next((s for s in _current if s.thread is threading.current_thread()), None)


@contextlib.contextmanager
def serving(fork: bool = True) -> Iterator[None]:
    """Fork the probe's processes in the block from one server (one interpreter's start for all).
    `fork=False` (a probe on a GPU: see `forks_for`): each starts an interpreter instead, here and in
    any `serving()` nested in the block."""
    claim = _Serving(fork)
    with _current_lock:
        _current.append(claim)
    interrupted = True
    try:
        yield
        interrupted = False
    except Exception:
        # The probe's failure, not the server's: `_give_back` keeps it only when every child it
        # forked has ended (a child still running is ended with its server).
        interrupted = False
        raise
    finally:
        with _current_lock:
            _current.remove(claim)
        if claim.zygote is not None:
            if interrupted:  # no waiting on an interrupt: whatever runs ends with its server, now
                claim.zygote.close()
            else:
                _give_back(claim.zygote)


def forks_for(device_key: str) -> bool:
    """Whether a probe of the device (its lock's key, `lock.device_key`) forks its processes from a
    server: on the CPU budget device only. CUDA cannot be used in a child forked from a process in
    which torch has asked the driver anything (torch.cuda.is_available(), device_count(): torch
    marks the fork bad, and the child's first CUDA call raises "Cannot re-initialize CUDA in forked
    subprocess"), and the server's imports and warm-up cannot be kept from doing so by every torch
    and library version: seen on the H100 (torch 2.11), 2026-11-26. A GPU probe's trials take far
    longer than an interpreter's start, which is all the server saves."""
    return device_key == "cpu-budget"


def spawn(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    stdin: int | None,
    stdout: int | None,
    stderr: int | None,
    pass_fds: Sequence[int] = (),
) -> tuple[subprocess.Popen[bytes] | Forked, int]:
    """`python -m args...` as a process of its own: forked by the probe's server when one serves
    (in this thread), else a new interpreter, with `env` (default: `child_env()`). Returns the child
    and the pid of its parent. The child holds the device lock this thread's probe holds (its
    descriptor, at the same number): the device is not free before the child has exited."""
    from autotune.engine import lock

    env = child_env() if env is None else env
    pass_fds = [*pass_fds, *(fd for fd in lock.held_fds() if fd not in pass_fds)]
    claim = _serving_here()
    zygote = None if claim is None else claim.get()
    if zygote is not None:
        forked = zygote.spawn(args, env=env, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds)
        if forked is not None:
            lock.note_child(forked.pid)
            return forked, zygote.pid
    child = subprocess.Popen(
        [sys.executable, "-m", *args],
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        pass_fds=tuple(pass_fds),
        start_new_session=True,  # Ctrl-C goes to the caller, which ends the child
    )
    lock.note_child(child.pid)
    return child, os.getpid()


class Forked:
    """A child forked by the server, with the parts of `subprocess.Popen` the callers use."""

    def __init__(self, zygote: Zygote, pid: int, stdin: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid, self.stdin, self.stderr = pid, stdin, stderr
        self.returncode: int | None = None
        self._zygote = zygote
        self._reader: threading.Thread | None = None
        self._errors: list[bytes] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote._exit_status(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote._exit_status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[None, bytes]:
        """Write `input` to stdin and close it, read stderr to its end, wait for the exit (again
        after a timeout: the same reader goes on)."""
        if self._reader is None and self.stderr is not None:
            stream, errors = self.stderr, self._errors
            self._reader = threading.Thread(target=lambda: errors.append(stream.read()), daemon=True)
            self._reader.start()
        if self.stdin is not None and not self.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        self.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout=10)
            if not self._reader.is_alive() and self.stderr is not None:
                self.stderr.close()
        return None, b"".join(self._errors)


class Zygote:
    """The fork server of one probe (see `serving` and `spawn`)."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._process, self._sock = process, sock
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._started: set[int] = set()  # the children it forked for us
        self._buffer = b""
        self.key = ""  # the environment it was started for (`_key`)

    @classmethod
    def _start(cls) -> Zygote | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = child_env()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "autotune.engine.zygote", str(theirs.fileno()), str(os.getpid())],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # Ctrl-C goes to the caller, which ends the server
            )
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(process, ours)

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def idle(self) -> bool:
        """Alive, with every child it forked for us ended. A child whose end the caller saw (its pipe
        closed) may not be reported yet: the server looks every 0.1 s, so this waits up to 2 s."""
        deadline = time.monotonic() + 2.0
        with self._lock:
            try:
                while self._started - self._exits.keys():
                    message = self._message(max(0.0, deadline - time.monotonic()))
                    if message is None:
                        return False
                    if "exit" in message:
                        self._exits[int(message["pid"])] = int(message["exit"])
            except OSError:
                return False
        return self.alive()

    def close(self) -> None:
        """End the server (it kills a child still running), and reap it."""
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def spawn(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str],
        stdin: int | None,
        stdout: int | None,
        stderr: int | None,
        pass_fds: Sequence[int] = (),
    ) -> Forked | None:
        """Fork `python -m MODULE ARGS...` (args[0] is the module) from the server, with stdin,
        stdout and stderr each `subprocess.PIPE`, `subprocess.DEVNULL` or None (this process's) and
        `pass_fds` at the same numbers in the child. None when the server is gone."""
        ours: list[int] = []  # our ends of the pipes, given to the caller as files
        theirs: list[int] = []  # the child's ends, sent to the server, then closed here
        streams: list[int] = []
        for target, mode in ((0, stdin), (1, stdout), (2, stderr)):
            if mode == subprocess.PIPE:
                read_end, write_end = os.pipe()
                mine, child = (write_end, read_end) if target == 0 else (read_end, write_end)
                ours.append(mine)
                theirs.append(child)
                streams.append(child)
            elif mode == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                streams.append(fd)
            else:
                streams.append(target)
        header = {"args": list(args), "cwd": os.getcwd(), "env": dict(env), "fds": [*range(3), *pass_fds]}
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps(header).encode() + b"\n"], [*streams, *pass_fds])
                pid = self._read_pid()
        except OSError:
            pid = None
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if pid is None:
            for fd in ours:
                os.close(fd)
            return None
        self._started.add(pid)
        files = iter(ours)
        child_stdin = os.fdopen(next(files), "wb") if stdin == subprocess.PIPE else None
        if stdout == subprocess.PIPE:
            os.close(next(files))  # nobody here reads a child's stdout
        child_stderr = os.fdopen(next(files), "rb") if stderr == subprocess.PIPE else None
        return Forked(self, pid, child_stdin, child_stderr)

    def _message(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next message, None at the timeout (or when it is gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = select.poll()  # not select(): a busy process's descriptors can pass FD_SETSIZE
        waiting.register(self._sock.fileno(), select.POLLIN)
        while b"\n" not in self._buffer:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not waiting.poll(None if remaining is None else remaining * 1000):
                return None
            chunk = self._sock.recv(65536)
            if not chunk:
                raise OSError("the fork server is gone")
            self._buffer += chunk
            if len(self._buffer) > _MAX_MESSAGE:
                raise OSError("the fork server sent too much")
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def _read_pid(self) -> int | None:
        while True:
            message = self._message(600.0)  # the first one waits for the server's imports
            if message is None or "pid" not in message:
                return None
            if "exit" not in message:
                return int(message["pid"])
            self._exits[int(message["pid"])] = int(message["exit"])  # an earlier child's end

    def _exit_status(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            try:
                while True:
                    message = self._message(timeout)
                    if message is None:
                        return None
                    if "exit" in message:
                        self._exits[int(message["pid"])] = int(message["exit"])
                        if int(message["pid"]) == pid:
                            return self._exits[pid]
            except OSError:
                # The server died: its child dies too (its parent-death signal), and here for sure.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                return -signal.SIGKILL


# The server's side ------------------------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    child: list[int] = []
    try:
        _serve_until_closed(sock, child)
    finally:
        for pid in child:  # no run outlives the probe that started it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _serve_until_closed(sock: socket.socket, running: list[int]) -> None:
    control = select.poll()
    control.register(0, select.POLLIN)
    control.register(sock.fileno(), select.POLLIN)
    buffer = b""
    received: list[int] = []  # a long request arrives in pieces; its descriptors with the first
    while True:
        for fd, _ in control.poll(100 if running else None):
            if fd == 0 and not os.read(0, 4096):  # the caller has gone, or closed us
                return
            if fd == sock.fileno():
                data, fds, _, _ = socket.recv_fds(sock, 65536, 64)
                if not data:
                    return
                buffer += data
                received += fds
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    child = _fork(json.loads(line), received, sock)
                    received = []
                    running.append(child)
                    sock.sendall(json.dumps({"pid": child}).encode() + b"\n")
        for child in list(running):
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                running.remove(child)
                code = os.waitstatus_to_exitcode(status)
                sock.sendall(json.dumps({"pid": child, "exit": code}).encode() + b"\n")


def _fork(header: dict[str, Any], fds: list[int], sock: socket.socket) -> int:
    server = os.getpid()
    with warnings.catch_warnings():
        # Python 3.12 warns of any fork of a process with threads; the server's are torch's intra-op
        # workers, idle between trials, whose pools torch rebuilds in a forked child (its at-fork
        # handlers, as for a DataLoader's workers). The warning would reach every probe's stderr.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        sock.close()
        os.setsid()
        die_with_parent(server)
        # The received descriptors, moved above every number the caller asked for, then placed there.
        wanted: list[int] = header["fds"]
        floor = max([*wanted, *fds]) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in zip(wanted, high, strict=True):
            os.dup2(fd, target)
        for fd in high:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
        os.environ.clear()
        os.environ.update(header["env"])
        os.chdir(header["cwd"])
        module, *args = header["args"]
        sys.argv = [module, *args]
        sys.stdin = os.fdopen(0, "r", closefd=False)
        sys.stdout = os.fdopen(1, "w", closefd=False)
        sys.stderr = os.fdopen(2, "w", closefd=False)
        import runpy

        # Run as `python -m` runs it: a fresh __main__, not the copy the server imported.
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):  # sys.exit("why"): Python prints the why
            with contextlib.suppress(Exception):
                sys.stderr.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001 - the child's own error, printed as a spawned one would
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` (the thread of it that started this one) dies, however it
    dies (Linux's PR_SET_PDEATHSIG); exit now if it has died already."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def _warm_up() -> None:
    """Run a tiny trial on the CPU budget device, once, before forking: a trial's first run imports
    some 800 modules lazily (torch._dynamo and sympy under the optimizers' step, torch.distributed),
    2-3 s that every forked child would otherwise pay again. CPU only: CUDA is never touched here.
    A failure only costs the children that time."""
    try:
        import torch
        from torch import nn

        from autotune.devices.budget import BudgetDevice
        from autotune.engine.trial import TrialRunner
        from autotune.workloads.workload import Workload

        for optimizer in ("adam", "sgd"):
            workload = Workload(
                name="warm-up",
                build_model=lambda: nn.Linear(4, 4),
                make_batch=lambda b, device: torch.randn(b, 4, device=device),
                loss=lambda model, x: model(x).square().mean(),
                optimizer=optimizer,
            )
            TrialRunner(workload, BudgetDevice(64 << 20), micro_steps=2)(2)
    except Exception:  # noqa: BLE001 - a warm-up only saves time; the children work without it
        pass


def main() -> None:
    if len(sys.argv) != 3 or not all(arg.isdigit() for arg in sys.argv[1:]):
        sys.stderr.write("usage: python -m autotune.engine.zygote SOCKET_FD CALLER_PID (autotune's own use)\n")
        sys.exit(2)
    # Before the imports, which take seconds: a caller killed meanwhile takes this server with it
    # at once (its stdin's end of file is read only once they are done).
    die_with_parent(int(sys.argv[2]))
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _warm_up()
    # What the server holds now (torch, the engine: some 300,000 objects) outlives every child: out
    # of the collector's reach, a child's collections walk only its own objects, and do not write
    # into the pages it shares with the server (CPython's advice for fork without exec).
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller ends us (stdin), not a terminal's Ctrl-C
    _serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
