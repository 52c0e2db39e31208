"""Workloads for tests/test_progress.py (used as tests.progress_workloads:NAME)."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from autotune.workloads.workload import Workload


def _in_confirmation() -> bool:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return getattr(spec, "name", None) == "autotune.engine.confirm"


def hangs_when_confirmed() -> Workload:
    """Fits in the probe; hangs in its fresh-process confirmation (`python -m autotune.engine.confirm`)."""

    def batch(b: int, device: torch.device) -> torch.Tensor:
        if _in_confirmation():
            time.sleep(3600)
        return torch.randn(b, 8, device=device)

    return Workload(
        name="hangs-when-confirmed",
        build_model=lambda: nn.Linear(8, 8),
        make_batch=batch,
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )


def interrupts_itself(where: str = "loss") -> Workload:
    """Raises KeyboardInterrupt from its own code, no signal sent: in its loss from batch 2 on
    (`where=loss`), while building its model (`build`), or in its loss in the fresh-process
    confirmation alone (`confirm`)."""

    def build() -> nn.Module:
        if where == "build":
            raise KeyboardInterrupt  # while building
        return nn.Linear(8, 8)

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if (where == "loss" and x.shape[0] >= 2) or (where == "confirm" and _in_confirmation()):
            raise KeyboardInterrupt  # in the loss
        return model(x).square().mean()

    return Workload(
        name="interrupts-itself",
        build_model=build,
        make_batch=lambda b, device: torch.randn(b, 8, device=device),
        loss=loss,
        optimizer="sgd",
    )
