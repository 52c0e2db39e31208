"""A probe's child that is slow to die, for the device lock's tests: `python -m tests.lock_child
MARKER LINGER [now]` (started by `autotune.engine.zygote.spawn`, as a probe's runs are).

It disarms the parent-death signal a forked run gets, writes MARKER/child-PID, then waits for its
parent to die (or, with `now`, not) and lives LINGER seconds more (a CUDA context takes that long to
tear down, a probe process dies 50-300 ms after its parent by the signal), then writes
MARKER/ended-PID with the time and exits. With LINGER 0 it exits at once (a run that warms up a
fork server)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    marker, linger = Path(sys.argv[1]), float(sys.argv[2])
    if linger <= 0:
        return
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 0)  # PR_SET_PDEATHSIG: none
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    (marker / f"child-{os.getpid()}").write_text(json.dumps({"pid": os.getpid(), "parent": parent}))
    deadline = time.monotonic() + 120
    while sys.argv[3:] != ["now"] and os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(linger)
    (marker / f"ended-{os.getpid()}").write_text(repr(time.time()))


if __name__ == "__main__":
    main()
