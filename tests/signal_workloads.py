"""A workload for tests/test_cli_signals.py (tests.signal_workloads:slow): every part of its probe
lasts a moment, so that a signal can land inside it. Its module takes 0.6 s to import, and says
so on stderr as it begins (in the isolated search's process, whose stderr is the command's); each
micro-step's loss takes 0.1 s."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from autotune.workloads.workload import Workload

sys.stderr.write("signal-workloads: importing\n")
sys.stderr.flush()
time.sleep(0.6)  # a user's module that is slow to import (its own imports, a dataset's index)


def slow() -> Workload:
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return model(x).square().mean()

    return Workload(
        name="slow",
        build_model=lambda: nn.Linear(8, 8),
        make_batch=lambda b, device: torch.randn(b, 8, device=device),
        loss=loss,
        optimizer="sgd",
    )
