"""Workloads whose op sequence depends on the batch size (used as tests.predict_workloads:NAME)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autotune.workloads.workload import Workload


class _Net(nn.Module):
    def __init__(self, extra_ops: object) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.extra_ops = extra_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert callable(self.extra_ops)
        for _ in range(self.extra_ops(x.shape[0])):
            x = x * 1.0
        return self.inner(x)


def _workload(extra_ops: object) -> Workload:
    return Workload(
        name="branchy",
        build_model=lambda: _Net(extra_ops),
        make_batch=lambda b, device: torch.randn(b, 64, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="adam",
    )


def plain() -> Workload:
    """The same network with no branch: one op sequence at every size."""
    return _workload(lambda b: 0)


def branchy() -> Workload:
    """One more op above batch 2: batch 2 and 4 differ, 4 and 8 agree."""
    return _workload(lambda b: 1 if b > 2 else 0)


def loopy() -> Workload:
    """An op per bit of the batch size: 2, 4 and 8 all run different sequences."""
    return _workload(lambda b: b.bit_length())


class _WarmingNet(_Net):
    """One more op in every forward of the process's first trial (two steps of one micro-step; the
    fingerprint's forward on the meta device aside), as FSDP2's first step runs once-only work."""

    forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            _WarmingNet.forwards += 1
            if _WarmingNet.forwards <= 2:
                x = x * 1.0
        return self.inner(x)


def warms_up() -> Workload:
    """The first timeline trial (batch 4) differs from the later ones at 2 and 8, which agree."""
    _WarmingNet.forwards = 0
    return dataclasses.replace(_workload(None), build_model=lambda: _WarmingNet(lambda b: 0))
