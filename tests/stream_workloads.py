"""Workloads that use streams as CUDA jobs do, for tests/test_streams.py (tests.stream_workloads:NAME).

Written device-agnostically (`torch.get_device_module`), so that each runs on CUDA as it does on
the budget device, whose model of the caching allocator keeps a pool per stream."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autotune.workloads.workload import Workload

WIDTH = 256
_SIDE: dict[str, Any] = {}  # one side stream per device type, as a loader keeps one


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))


def _side_stream(device: torch.device) -> Any:
    stream = _SIDE.get(device.type)
    if stream is None:
        stream = _SIDE[device.type] = torch.get_device_module(device).Stream()
    return stream


def _prefetched(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch made on a side stream, as a prefetching loader copies it (timm's PrefetchLoader,
    apex's data_prefetcher): the default stream waits for it and records its use, so each batch's
    memory is the side stream's, and reused only after the default stream's work on it is done."""
    if device.type == "meta":  # the fingerprint's structure: shapes only, no streams
        return torch.empty(b, WIDTH, device=device), torch.empty(b, WIDTH, device=device)
    module = torch.get_device_module(device)
    side = _side_stream(device)
    with module.stream(side):
        inputs = torch.randn(b, WIDTH, device=device)
        targets = torch.randn(b, WIDTH, device=device)
    current = module.current_stream()
    current.wait_stream(side)
    inputs.record_stream(current)
    targets.record_stream(current)
    return inputs, targets


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def prefetched() -> Workload:
    """An MLP whose batches come from a side stream (see `_prefetched`)."""
    return Workload(name="prefetched", build_model=_mlp, make_batch=_prefetched, loss=_mse, optimizer="adamw")


def plain() -> Workload:
    """The same MLP with its batches made on the default stream."""

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, WIDTH, device=device), torch.randn(b, WIDTH, device=device)

    return Workload(name="plain-streams", build_model=_mlp, make_batch=batch, loss=_mse, optimizer="adamw")
