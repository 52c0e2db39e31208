"""Workloads that misbehave, for testing isolation and error handling (used as tests.workloads:NAME)."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from autotune.workloads.workload import Workload


def _tiny(make_batch_effect: object = None) -> Workload:
    def batch(b: int, device: torch.device) -> torch.Tensor:
        if callable(make_batch_effect):
            make_batch_effect(b)
        return torch.randn(b, 8, device=device)

    return Workload(
        name="tiny",
        build_model=lambda: nn.Linear(8, 8),
        make_batch=batch,
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )


def segfault() -> Workload:
    return _tiny(lambda b: os.kill(os.getpid(), signal.SIGSEGV) if b >= 4 else None)


def exits() -> Workload:
    return _tiny(lambda b: os._exit(7) if b >= 2 else None)


def hangs() -> Workload:
    return _tiny(lambda b: time.sleep(3600) if b >= 2 else None)


def _raise_value_error(b: int) -> None:
    if b >= 4:
        raise ValueError("shape mismatch in my data pipeline")


def broken() -> Workload:
    return _tiny(_raise_value_error)


tiny = _tiny()


def not_a_workload() -> int:
    return 3


def ragged(threshold: int = 40, width: int = 64) -> Workload:
    """Memory that grows with the batch, with a user option: used by CLI tests."""
    return Workload(
        name="ragged",
        build_model=lambda: nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)),
        make_batch=lambda b, device: torch.randn(b, width, device=device),
        loss=lambda model, x: model(x).mean(),
        optimizer="adam",
        input_spec={"threshold": threshold, "width": width},
    )


def _raise_cudnn_not_supported(b: int) -> None:
    if b >= 2:
        raise RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
        )


def ambiguous() -> Workload:
    return _tiny(_raise_cudnn_not_supported)


def fresh_process_hungry(width: int = 64) -> Workload:
    """Needs more memory per sample in any process but the one named by AUTOTUNE_TEST_PROBE_PID:
    stands for a job whose fresh process fits less than the probe's (allocator history on a GPU)."""

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        hungry = os.environ.get("AUTOTUNE_TEST_PROBE_PID") != str(os.getpid())
        extra = torch.randn(b, width // 8, device=device) if hungry else None
        return torch.randn(b, width, device=device), extra

    return Workload(
        name="fresh-process-hungry",
        build_model=lambda: nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)),
        make_batch=batch,
        loss=lambda model, batch: model(batch[0]).mean(),
        optimizer="adam",
        input_spec={"width": width},
    )


def classifier() -> Workload:
    """A small classifier whose out-of-memory errors at 1 MiB fall in a DDP step's synced backward
    (gradient buckets half reduced), not in its forward."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 4))

    def batch(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, 32, device=device), torch.randint(0, 4, (b,), device=device)

    return Workload(
        name="classifier",
        build_model=build,
        make_batch=batch,
        loss=lambda model, xy: nn.functional.cross_entropy(model(xy[0]), xy[1]),
    )


def wide(width: int = 2048) -> Workload:
    """One large weight and tiny activations: accumulating needs a second gradient's worth of memory
    (the new gradient beside the kept one), so a limit between the two fits one micro-step only."""
    return Workload(
        name="wide",
        build_model=lambda: nn.Linear(width, width, bias=False),
        make_batch=lambda b, device: torch.randn(b, width, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )
