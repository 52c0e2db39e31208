"""Workloads whose steps do not repeat, for tests/test_leak.py (used as tests.leak_workloads:NAME)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from autotune.workloads.workload import Workload


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(b: int, device: torch.device) -> torch.Tensor:
    return torch.randn(b, 64, device=device)


def leak() -> Workload:
    """Keeps every step's output (a list of outputs for logging, kept with their grad_fn)."""
    kept: list[torch.Tensor] = []

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        kept.append(out)
        return out.square().mean()

    return Workload(name="leak", build_model=_mlp, make_batch=_batch, loss=loss, optimizer="sgd")


def cache_once() -> Workload:
    """Builds a cache on the device at its second call and keeps it: a step-2 increase, not a leak."""
    cache: dict[str, torch.Tensor] = {}
    calls = [0]

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            cache["table"] = torch.zeros(256, 64, device=x.device)
        return model(x).square().mean()

    return Workload(name="cache-once", build_model=_mlp, make_batch=_batch, loss=loss, optimizer="sgd")


def _in_confirmation() -> bool:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return getattr(spec, "name", None) == "autotune.engine.confirm"


def lighter_when_confirmed() -> Workload:
    """Trains on one sample of each batch in its fresh-process confirmation alone: the fresh run fits
    at a fraction of the probe's peak, which confirms nothing."""

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if _in_confirmation():
            x = x[:1]
        return model(x).square().mean()

    return Workload(name="lighter-when-confirmed", build_model=_mlp, make_batch=_batch, loss=loss, optimizer="sgd")


def late_leak(start: int = 7) -> Workload:
    """Keeps every output from its `start`-th loss call on, counted over the process: a leak that
    starts late (a debugging list filled after a warm-up, a logger that starts keeping tensors)."""
    kept: list[torch.Tensor] = []
    calls = [0]

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        out = model(x)
        if calls[0] >= start:
            kept.append(out)
        return out.square().mean()

    return Workload(name="late-leak", build_model=_mlp, make_batch=_batch, loss=loss, optimizer="sgd")


def cache_per_size() -> Workload:
    """Caches a tensor per batch size in its loss (a mask or position table keyed by the batch's
    shape): a run at one size keeps one, a probe's trials at many sizes keep them all."""
    cache: dict[int, torch.Tensor] = {}

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weights = cache.setdefault(x.shape[0], torch.ones(x.shape[0], 10, device=x.device))
        return (model(x) * weights).square().mean()

    return Workload(name="cache-per-size", build_model=_mlp, make_batch=_batch, loss=loss, optimizer="sgd")


def shape_changes() -> Workload:
    """make_batch gives a sequence of another length at every call (a random crop, a sampled
    length): no peak belongs to the batch size."""
    calls = [0]

    def batch(b: int, device: torch.device) -> torch.Tensor:
        calls[0] += 1
        return torch.randn(b, 8 + calls[0] % 5, 64, device=device)

    return Workload(
        name="shape-changes",
        build_model=_mlp,
        make_batch=batch,
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )
