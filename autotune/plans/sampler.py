"""A batch sampler that runs a plan: its micro-batches, unequal ones included, window after window.

A fewest-steps plan for 256 samples with at most 100 a micro-batch is `[86, 85, 85]`: no framework
loader with a fixed `batch_size` runs it. `PlanBatchSampler` gives any `DataLoader` those sizes,
in order, for every window (one optimizer step), so `accumulate(loader, plan)` sees windows that
match the plan:

    loader = DataLoader(dataset, batch_sampler=PlanBatchSampler(len(dataset), plan, shuffle=True))
    for step in accumulate(loader, plan):
        ...

At the end of an epoch the last window is short: the remaining samples are cut into the plan's
sizes in order (the last micro-batch is whatever is left), unless `drop_last` drops the short
window. Nothing here imports torch at import time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from autotune.errors import ConfigError
from autotune.plans.plan import Plan


def plan_windows(indices: list[int], plan: Plan, drop_last: bool = False) -> Iterator[list[int]]:
    """Cut `indices` into the plan's micro-batches, window after window (pure)."""
    sizes = plan.micro_batches
    window = sum(sizes)
    for start in range(0, len(indices), window):
        chunk = indices[start : start + window]
        if len(chunk) < window and drop_last:
            return
        offset = 0
        for size in sizes:
            if offset >= len(chunk):
                break
            yield chunk[offset : offset + size]
            offset += size


class PlanBatchSampler:
    """Yields lists of dataset indices: the plan's per-rank micro-batches, window after window.

    `source` is the dataset's length or a sampler (an iterable of indices, e.g. a
    `DistributedSampler` for this rank's share). `shuffle` draws a new permutation each epoch
    (with `generator`, a `torch.Generator`, for reproducibility); `drop_last` drops a short last
    window so that every optimizer step sees the whole effective batch."""

    def __init__(
        self,
        source: int | Any,
        plan: Plan,
        *,
        shuffle: bool = False,
        generator: Any = None,
        drop_last: bool = False,
    ) -> None:
        if isinstance(source, bool) or (isinstance(source, int) and source < 0):
            raise ConfigError(f"source must be a dataset length >= 0 or a sampler, got {source!r}")
        if shuffle and not isinstance(source, int):
            raise ConfigError("shuffle applies to a dataset length; a sampler shuffles itself")
        self.source = source
        self.plan = plan
        self.shuffle = shuffle
        self.generator = generator
        self.drop_last = drop_last

    def _indices(self) -> list[int]:
        if not isinstance(self.source, int):
            return [int(i) for i in self.source]
        if not self.shuffle:
            return list(range(self.source))
        import torch

        return torch.randperm(self.source, generator=self.generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        yield from plan_windows(self._indices(), self.plan, self.drop_last)

    def samples(self) -> int:
        """The samples of one pass (a short last window dropped with `drop_last`)."""
        total = self.source if isinstance(self.source, int) else len(self.source)
        window = sum(self.plan.micro_batches)
        return total - total % window if self.drop_last else total

    def __len__(self) -> int:
        total = self.source if isinstance(self.source, int) else len(self.source)
        window = sum(self.plan.micro_batches)
        full, left = divmod(total, window)
        batches = full * len(self.plan.micro_batches)
        if left and not self.drop_last:
            taken = 0
            for size in self.plan.micro_batches:
                if taken >= left:
                    break
                batches += 1
                taken += size
        return batches
