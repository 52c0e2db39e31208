"""Running a probe in a fresh child interpreter, with a hard timeout.

A probe can take its process down: a segfault in a kernel, a sticky CUDA error that poisons the
context, a workload that hangs or calls `os._exit`. So by default it runs in a child process, a
**process of its own** running our own entry point (`python -m autotune.engine.isolation`, with this
process's `sys.path`): forked by the probe's fork server (`autotune.engine.zygote`, a new
interpreter that imported torch once and never initializes CUDA) or, without one, a new
interpreter; never a fork of the caller (which must not share, or ever initialize, a CUDA
context) and never multiprocessing's spawn, which re-imports the caller's `__main__` and so
fails in a script without an `if __name__ == "__main__":` guard. The request goes in on the
child's stdin; the child streams its trials, then its result or error, back as JSON lines on a
pipe of its own (the workload may print on stdout), and is killed at the timeout. Whatever
happens to the child, the caller gets a `ProbeResult` or one of our `ProbeError`s with the reason.

The child never outlives its caller: it exits when its stdin reaches end of file (the caller has
gone, however it went: the kernel closes its end) or when its parent process changes, checked
every second; a caller that exits normally kills its live children on the way out, and a caller
interrupted (Ctrl-C, SIGTERM turned into an exception) kills and reaps its child before the
exception leaves `run_isolated`. The child runs in a session of its own, so a terminal's Ctrl-C
reaches the caller alone (not a traceback from the child in the middle of the caller's message).
The child also streams the progress inside each trial (`autotune.progress`), throttled.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune import errors
from autotune.engine import lock, zygote

if TYPE_CHECKING:
    from autotune.engine.probe import ProbeRequest, TrialCallback
    from autotune.progress import ProgressCallback
    from autotune.results import ProbeResult

WATCH_SECONDS = 1.0  # how often the child checks that its parent is still the one that started it
_POLL_SECONDS = 0.5  # how often the caller looks at the child while no message arrives

_live: set[subprocess.Popen[bytes] | zygote.Forked] = set()
_live_lock = threading.Lock()


# The caller's side ------------------------------------------------------------------------------
def _kill_live_children() -> None:
    # At a normal exit of the caller (an exception or a signal in another thread left a probe
    # running): end the children now rather than a second later by their own watch.
    with _live_lock:
        children = list(_live)
    for child in children:
        _end(child)


atexit.register(_kill_live_children)


def hold_interrupts() -> Callable[[], None]:
    """Hold Ctrl-C (and a SIGTERM turned into an exception) until the returned `release()`, which
    raises what came meanwhile: a child started in between is then in the hands of the code that
    ends it (an interrupt inside `Popen` would lose the child it has just started). A second signal
    is not held: the caller insists, and its handler runs at once (the hold may last the seconds a
    fork server needs to import torch; the command line also ends a held probe by itself within a
    second: `autotune.cli.interrupts`). Only in the main thread, and only signals with a Python
    handler; elsewhere `release` does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    held: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    handlers = {s: h for s, h in previous.items() if callable(h)}
    restored = False

    def restore() -> None:
        nonlocal restored
        if not restored:
            restored = True
            for number, handler in handlers.items():
                signal.signal(number, handler)

    def hold(signum: int, frame: Any) -> None:
        held.append(signum)
        if len(held) > 1:  # the second: not held
            restore()
            handlers[signal.Signals(signum)](signum, frame)

    for number in handlers:
        signal.signal(number, hold)

    def release() -> None:
        if restored:  # a second signal ran its handler already
            return
        restore()
        for signum in held[:1]:
            handlers[signal.Signals(signum)](signum, None)

    return release


def _end(child: subprocess.Popen[bytes] | zygote.Forked) -> None:
    try:
        if child.poll() is None:
            child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process in uninterruptible sleep
            child.wait(timeout=10)
        if child.stdin is not None:
            with contextlib.suppress(OSError):  # a broken pipe to a dead child
                child.stdin.close()
    finally:
        # Also when a Ctrl-C cuts the wait short: the child is killed (its fork server, closed on the
        # interrupt, reaps it), and nothing is left for the exit to end.
        with _live_lock:
            _live.discard(child)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def run_isolated(
    request: ProbeRequest,
    timeout: float,
    on_trial: TrialCallback | None = None,
    on_progress: ProgressCallback | None = None,
) -> ProbeResult:
    """Run `request` in a fresh child interpreter; raise ProbeTimeoutError or ProbeCrashedError
    if it does not come back with an answer, or the error the probe failed with. `on_progress`
    hears the micro-steps inside each trial (at most every 0.1 s, and each trial's first).

    The child is forked by this process's fork server (`autotune.engine.zygote`; inside
    `probe_and_confirm`, the probe's), so probes run one after another in a process import torch
    once."""
    with zygote.serving(zygote.forks_for(lock.device_key(request.device))):
        return _run_isolated(request, timeout, on_trial, on_progress)


def _run_isolated(
    request: ProbeRequest,
    timeout: float,
    on_trial: TrialCallback | None,
    on_progress: ProgressCallback | None,
) -> ProbeResult:
    from autotune.progress import TrialProgress
    from autotune.results import ProbeResult, TrialRecord

    read_end, write_end = os.pipe()
    release = hold_interrupts()  # until the child is in the `try` that ends it
    try:
        # PARENT_PID 0: the child watches the parent it finds at its start (the fork server that
        # forked it, or this process when none could).
        child, _ = zygote.spawn(
            ["autotune.engine.isolation", str(write_end), "0"],
            stdin=subprocess.PIPE,
            stdout=None,
            stderr=None,
            pass_fds=(write_end,),
        )
    except BaseException:
        os.close(read_end)
        release()
        raise
    finally:
        os.close(write_end)  # the child holds the only writer: EOF means it is gone
    with _live_lock:
        _live.add(child)
    deadline = time.monotonic() + timeout
    trials = 0
    pending = b""
    answers = select.poll()  # not select(): a busy server's descriptors can pass FD_SETSIZE
    answers.register(read_end, select.POLLIN)
    try:
        release()
        assert child.stdin is not None
        try:
            # One line, far below a pipe's buffer: this does not wait for the child. Its stdin
            # then stays open: end of file there tells the child that this process is gone.
            child.stdin.write(request.model_dump_json().encode() + b"\n")
            child.stdin.flush()
        except BrokenPipeError:
            pass  # the child is already gone: the loop below reports how
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.ProbeTimeoutError(
                    f"the probe ran past its timeout of {timeout:g} s after {trials} trial(s) and was "
                    "killed: raise the timeout (--timeout, AUTOTUNE_PROBE_TIMEOUT), or lower --max-batch or --steps "
                    "(a request's max_batch, steps)"
                )
            # A child that has exited wrote all it will: read what is left, without waiting on a
            # writer that a process it forked may still hold.
            exited = child.poll() is not None
            if not answers.poll(0 if exited else min(remaining, _POLL_SECONDS) * 1000):
                if exited:
                    break
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "progress" in message:
                    if on_progress is not None:
                        on_progress(TrialProgress.model_validate(message["progress"]))
                elif "trial" in message:
                    trials += 1
                    if on_trial is not None:
                        on_trial(TrialRecord.model_validate(message["trial"]))
                elif "result" in message:
                    return ProbeResult.model_validate(message["result"])
                else:
                    raise errors.from_report(message["error"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
        raise errors.ProbeCrashedError(
            f"the probe process {_describe_exit(child.returncode)} after {trials} trial(s) "
            "without reporting a result (a crash in native code, a sticky CUDA error, or the "
            "workload exiting); to debug, run the probe in the calling process "
            "(`in_process=True` in Python, `--in-process` on the command line)"
        )
    finally:
        os.close(read_end)
        _end(child)


# The child's side -------------------------------------------------------------------------------
def _watch_parent(control: int, parent_pid: int) -> None:
    # A child whose parent is gone must not hold a GPU forever: the parent's end of our stdin
    # closes when it dies (at once, whatever killed it), and a new parent shows within a second.
    stdin = select.poll()
    stdin.register(control, select.POLLIN)
    while True:
        if stdin.poll(WATCH_SECONDS * 1000) and not os.read(control, 4096):
            os._exit(3)
        if os.getppid() != parent_pid:
            os._exit(3)


def _child(answer_fd: int, parent_pid: int) -> None:
    parent_pid = parent_pid or os.getppid()  # 0: the parent this process started under
    # The request is one line on stdin; the rest of stdin is the parent watch's, and the workload
    # reads /dev/null as it would under a spawned process.
    control = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.set_inheritable(answer_fd, False)  # a subprocess of the workload must not hold it
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(control, 1 << 16)
        if not chunk:
            os._exit(3)  # the parent went away before it sent the request
        line += chunk
    threading.Thread(target=_watch_parent, args=(control, parent_pid), daemon=True).start()

    lock = threading.Lock()
    answers = os.fdopen(answer_fd, "wb")

    def send(message: dict[str, Any]) -> None:
        with lock:
            answers.write(json.dumps(message).encode() + b"\n")
            answers.flush()

    from autotune.workloads import usercode

    # A KeyboardInterrupt here is the workload's error unless a SIGINT was sent to this process:
    # it runs in a session of its own, so a terminal's Ctrl-C reaches the caller, not this child.
    with usercode.telling_interrupts_apart():
        try:
            from autotune.engine.probe import ProbeRequest, run_probe
            from autotune.progress import throttled

            request = ProbeRequest.model_validate_json(line)
            result = run_probe(
                request,
                on_trial=lambda t: send({"trial": t.model_dump(mode="json")}),
                on_progress=throttled(lambda p: send({"progress": p.model_dump(mode="json")})),
            )
            send({"result": result.model_dump(mode="json")})
        except errors.AutotuneError as exc:
            send({"error": errors.report(exc, with_traceback=True)})
        except (Exception, KeyboardInterrupt) as exc:  # reported to the parent, which raises ProbeError
            if not isinstance(exc, Exception) and not usercode.raised_by_code(exc):
                raise
            send({"error": errors.report(usercode.unexpected(exc), with_traceback=True)})
        finally:
            answers.close()


def main() -> None:
    if len(sys.argv) != 3 or not all(arg.isdigit() for arg in sys.argv[1:]):
        sys.stderr.write(
            "usage: python -m autotune.engine.isolation ANSWER_FD PARENT_PID < REQUEST.json (autotune's own use)\n"
        )
        sys.exit(2)
    _child(int(sys.argv[1]), int(sys.argv[2]))


if __name__ == "__main__":
    main()
