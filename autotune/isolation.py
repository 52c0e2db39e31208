"""Running a probe in a spawned child process, with a hard timeout.

A probe can take its process down: a segfault in a kernel, a sticky CUDA error that poisons the
context, a workload that hangs or calls `os._exit`. So by default it runs in a child started with
the `spawn` method (never `fork`: the parent must not share, or ever initialize, a CUDA context),
streams its trials back over a pipe, and is killed at the timeout. Whatever happens to the child,
the caller gets a `ProbeResult` or one of our `ProbeError`s with the reason.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from autotune import errors
from autotune.probe import ProbeRequest, TrialCallback, run_probe
from autotune.results import ProbeResult, TrialRecord


def _watch_parent(parent_pid: int) -> None:
    # A child whose parent was killed must not hold a GPU forever.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _child_main(payload: dict[str, Any], conn: Connection, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        request = ProbeRequest.model_validate(payload)
        result = run_probe(request, on_trial=lambda t: conn.send(("trial", t.model_dump(mode="json"))))
        conn.send(("result", result.model_dump(mode="json")))
    except errors.AutotuneError as exc:
        conn.send(("error", errors.report(exc)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises ProbeError
        conn.send(
            (
                "error",
                {"type": "ProbeError", "message": f"probe failed: {type(exc).__name__}: {exc}"},
            )
        )
    finally:
        conn.close()


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
) -> ProbeResult:
    """Run `request` in a spawned child; raise ProbeTimeoutError or ProbeCrashedError if it
    does not come back with an answer."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_child_main,
        args=(request.model_dump(mode="json"), sender, os.getpid()),
        name=f"autotune-probe-{request.target}",
        daemon=True,
    )
    process.start()
    sender.close()  # the child holds the only writer: EOF means it is gone
    deadline = time.monotonic() + timeout
    trials = 0
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.ProbeTimeoutError(
                    f"the probe ran past its timeout of {timeout:g} s after {trials} trial(s) and was "
                    "killed: raise the timeout, lower --max-batch or --steps"
                )
            if not receiver.poll(min(remaining, 0.5)):
                continue
            try:
                kind, payload = receiver.recv()
            except EOFError:
                break
            if kind == "trial":
                trials += 1
                if on_trial is not None:
                    on_trial(TrialRecord.model_validate(payload))
            elif kind == "result":
                return ProbeResult.model_validate(payload)
            else:
                raise errors.from_report(payload)
        process.join(timeout=10)
        raise errors.ProbeCrashedError(
            f"the probe process {_describe_exit(process.exitcode)} after {trials} trial(s) "
            "without reporting a result (a crash in native code, a sticky CUDA error, or the "
            "workload exiting); run with --in-process to debug"
        )
    finally:
        receiver.close()
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
