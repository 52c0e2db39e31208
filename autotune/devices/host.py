"""The host's side of a trial: work the job does in host memory, which no device counts, and where
each op a device records came from.

A job's loader collates its batches on the host (in a worker or the main process) and then moves
them to the device; the device holds the batch, never the samples it was collated from nor the
collate's intermediate tensors. On the CPU budget device host and device are the same memory, so
the probe says which work is the host's: `on_host()` runs a block that the budget device does not
count and that no memory timeline records (a padding collate runs more ops for more rows: 14, 24
and 44 ops at 2, 4 and 8 rows, which would make every timeline differ from the next). The batch
then reaches the device as a copy, counted as the device's own allocation
(`autotune.workloads.worstcase.to_device`).

`code_site()` names the code that ran the current op (its file, line and function, outside torch
and the devices' own counting), which a timeline keeps beside each op so that the predictor can
say where two sizes' op sequences part.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_depth = 0  # process-wide, not per thread: CUDA's backward runs on the autograd engine's threads

_TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
_DEVICES = str(Path(__file__).resolve().parent) + os.sep
_skipped: dict[str, bool] = {}

Site = tuple[str, int, str]  # (file, line, function)


@contextmanager
def on_host() -> Iterator[None]:
    """Run the block as host-side work: not counted by the budget device, not recorded in a timeline."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def active() -> bool:
    """Whether host-side work is running (inside `on_host()`)."""
    return _depth > 0


def _skip(filename: str) -> bool:
    skip = _skipped.get(filename)
    if skip is None:
        path = filename if filename.startswith("<") else str(Path(filename).resolve())
        skip = path.startswith((_DEVICES, _TORCH))
        _skipped[filename] = skip
    return skip


def code_site(depth: int = 1) -> Site | None:
    """The innermost frame of the running code that is neither torch's nor the devices' own, or
    None when there is none (an op run by the autograd engine's thread alone)."""
    frame = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if not _skip(code.co_filename):
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return None
