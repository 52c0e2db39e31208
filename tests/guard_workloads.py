"""Workloads for issue 12's guards (used as tests.guard_workloads:NAME): a memory curve that does
not grow with the batch, and a workload whose own code raises."""

from __future__ import annotations

import torch
from torch import nn

from autotune.workloads.workload import Workload


def flat(width: int = 16) -> Workload:
    """make_batch ignores the batch size: every trial runs the same 4 rows."""
    return Workload(
        name="flat",
        build_model=lambda: nn.Linear(width, width),
        make_batch=lambda b, device: torch.randn(4, width, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["inputs"]) - batch["labels"]).square().mean()  # the batch has no "labels"


def missing_key() -> Workload:
    """A step that fails in the user's loss with KeyError: 'labels' (the message names this file's line)."""
    return Workload(
        name="missing-key",
        build_model=lambda: nn.Linear(8, 8),
        make_batch=lambda b, device: {"inputs": torch.randn(b, 8, device=device)},
        loss=_loss,
        optimizer="sgd",
    )


class _Experts(nn.Module):
    """Two experts applied with torch._grouped_mm, as transformers' Mixtral does by default."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[0] // 2
        offsets = torch.tensor([half, x.shape[0]], dtype=torch.int32, device=x.device)
        return torch._grouped_mm(x, self.weight, offs=offsets)


def grouped_mm() -> Workload:
    """fp32 torch._grouped_mm: the CPU kernel runs it, the fake (meta) kernel wants bf16."""
    return Workload(
        name="grouped-mm",
        build_model=_Experts,
        make_batch=lambda b, device: torch.randn(b, 8, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )


def bad_factory() -> Workload:
    """A factory whose own code fails (not its options)."""
    config: dict[str, int] = {}
    return flat(width=config["width"])
