"""Workloads whose timeline trials settle in different numbers of optimizer steps under the
caching allocator's model (used as tests.settle_workloads:NAME)."""

from __future__ import annotations

import torch
from torch import nn

from autotune.workloads.workload import Workload


def unequal_steps() -> Workload:
    """Two 512-wide layers over 256 tokens, Adam: under the allocator model (AUTOTUNE_ALLOCATOR=cuda,
    32 MiB) a trial at batch 4 settles in 3 optimizer steps and one at batch 2 in 4 (the tests that
    use it check it), so their op sequences differ by a whole step. (Its activations, 512 KiB a
    sample, are 1 MiB blocks of the small pool at batch 2 and 2 MiB blocks of the large pool at 4.)"""
    return Workload(
        name="unequal-steps",
        build_model=lambda: nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)),
        make_batch=lambda b, device: torch.randn(b, 256, 512, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="adam",
    )
