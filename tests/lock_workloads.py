"""Workloads for the device lock's tests and the service's (used as tests.lock_workloads:NAME): a tiny
MLP whose batches say which process made them and who held the device's lock then, or wait at a
gate, or hang in the fresh-process confirmation; a probe held after its first trial."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from autotune.workloads.examples import mlp
from autotune.workloads.workload import Workload

SEEN_SECONDS = 120.0  # at most, so that a watch that never looks fails its test rather than hangs it


def ancestors() -> list[int]:
    """This process and its ancestors, from /proc."""
    chain = [os.getpid()]
    while chain[-1] > 1 and len(chain) < 64:
        stat = Path(f"/proc/{chain[-1]}/stat").read_text()
        chain.append(int(stat[stat.rindex(")") + 2 :].split()[1]))
    return chain


def _in_confirmation() -> bool:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return getattr(spec, "name", None) == "autotune.engine.confirm"


def _tiny() -> Workload:
    return mlp(in_features=64, hidden=64, layers=1, classes=10)


def gated(log: str, gate: str, seen: str = "") -> Workload:
    """Each batch waits while the file `gate` exists, then appends a line to `log`: this process,
    its ancestors, and the pid the CPU budget device's lock file names as its holder. With `seen`,
    a directory, each process's first batch first waits for `seen/PID`, which a test that watches
    the process listing writes once it has seen this process: a probe that would otherwise end
    between two of its looks (a loaded machine stretches them) cannot go unseen."""
    from autotune.engine.lock import holder

    base = _tiny()

    def batch(b: int, device: torch.device) -> object:
        if device.type != "meta":  # the service builds it on the meta device to fingerprint it
            if seen:
                told, deadline = Path(seen, str(os.getpid())), time.monotonic() + SEEN_SECONDS
                while not told.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            while os.path.exists(gate):
                time.sleep(0.02)
            record = holder("cpu-budget") or {}
            line = json.dumps({"chain": ancestors(), "holder": record.get("pid"), "time": time.time()})
            with open(log, "a") as file:
                file.write(line + "\n")
        return base.make_batch(b, device)

    return dataclasses.replace(base, name="gated", make_batch=batch)


def held(gate: str) -> Workload:
    """A probe in the middle of its search for as long as the test wants: the batches of the first
    size a process makes pass (the probe reports that trial), any other size waits while the file
    `gate` exists. A small MLP of a shape of its own, so that a stored `tiny` result never answers
    for it. (The service's tests used a probe of `gpt` at 128 MiB, in the middle of its search only
    while its trials lasted: seconds of CPU.)"""
    base = mlp(in_features=64, hidden=32, layers=1, classes=10)
    first: list[int] = []

    def batch(b: int, device: torch.device) -> object:
        if device.type != "meta":  # the service builds it on the meta device to fingerprint it
            first[:] = first or [b]
            while b != first[0] and os.path.exists(gate):
                time.sleep(0.02)
        return base.make_batch(b, device)

    return dataclasses.replace(base, name="held", make_batch=batch)


def hangs_when_confirmed(marker: str) -> Workload:
    """Fits in the search; in a fresh-process confirmation run, writes MARKER/confirm-PID and hangs."""
    base = _tiny()

    def batch(b: int, device: torch.device) -> object:
        if device.type != "meta" and _in_confirmation():
            Path(marker, f"confirm-{os.getpid()}").write_text(json.dumps(ancestors()))
            time.sleep(3600)
        return base.make_batch(b, device)

    return dataclasses.replace(base, name="hangs-when-confirmed", make_batch=batch)
