"""The framework tuners' progress where stderr is not a terminal (a job's log file, CI): the command
line's plain lines, and the wait for the device said apart from the tune's seconds (issue 38: an
integration run with its output redirected printed no trial line in 118 s, and its seconds included
the lock wait)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from autotune.engine import lock

WAIT = 1.5  # seconds another probe holds the device after the tune asks for it


class _Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def test_a_tune_with_stderr_not_a_terminal_prints_its_trials_and_its_wait_apart(
    accelerate: Any, locks: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autotune.integrations.accelerate import tune_accelerator

    held, release = threading.Event(), threading.Event()

    def other_probe() -> None:  # another probe of the CPU budget device, in another thread
        with lock.device_lock("cpu"):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=other_probe, daemon=True)
    holder.start()
    assert held.wait(30)
    timer = threading.Timer(WAIT, release.set)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    accelerator, optimizer = accelerate.Accelerator(cpu=True), torch.optim.SGD(model.parameters(), lr=0.1)
    started = time.perf_counter()
    timer.start()
    try:
        result = tune_accelerator(
            accelerator, model, optimizer, _Rows(), effective_batch=256, loss=_mse, memory=2 * 2**20, headroom=0
        )
    finally:
        release.set()
        timer.cancel()
        holder.join(30)
    wall = time.perf_counter() - started
    err = capsys.readouterr().err  # captured: not a terminal
    # The command line's plain lines: each trial as it starts and with its verdict.
    verdicts = re.findall(r"^trial +(\d+): batch +\d+ x\d (?:fits|OOM )", err, re.M)
    assert verdicts == [str(n) for n in range(1, len(result.trials) + 1)], err
    assert re.search(r"^trial +1: batch +\d+ step 1/2 micro-step 1/\d +\d+\.\d\d s$", err, re.M), err
    # The wait, said apart: the tune's seconds are its own.
    tuning = result.framework
    waited = re.search(r"trials in (\d+\.\d) s, after (\d+\.\d) s waiting for the device", err)
    assert waited is not None, err
    assert float(waited.group(2)) >= WAIT - 0.8  # the tune asks for the device a moment after it starts
    assert tuning.seconds <= wall - float(waited.group(2)) + 0.1
    assert float(waited.group(1)) == pytest.approx(tuning.seconds, abs=0.06)
