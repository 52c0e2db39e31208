"""`accumulate` holds no more of the loader's batches than the probe counted: with a plan and a loader
that says its length, one micro-batch at a time (issue 38: a window held on the device ran a CNN's
plan out of memory 0.5 MiB over the limit); otherwise a window read whole on an accelerator is
said, and a loader that yields other than its length is refused."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autotune
from autotune import accumulate
from autotune.errors import ConfigError


class _Tracked(Dataset[torch.Tensor]):
    """Samples whose collated batches are remembered weakly: how many are alive at any moment."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))

    def collate(self, samples: list[torch.Tensor]) -> torch.Tensor:
        batch = torch.stack(samples)
        self.made.append(weakref.ref(batch))
        return batch

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.made)


@pytest.mark.parametrize("loader_kind", ["batch_size", "plan_sampler"])
def test_a_plan_reads_one_micro_batch_at_a_time_with_the_windows_weights(loader_kind: str) -> None:
    plan = autotune.plan(effective_batch=12, max_micro_batch=4, policy="exact")  # 3 x 4
    data = _Tracked(30)  # windows of 12, 12 and a short one of 6
    loader = (
        DataLoader(data, batch_size=plan.micro_batch, collate_fn=data.collate)
        if loader_kind == "batch_size"
        else DataLoader(data, batch_sampler=plan.sampler(len(data)), collate_fn=data.collate)
    )
    seen = []
    for step in accumulate(loader, plan):
        assert data.alive() == 1  # the micro-batch in use, none read ahead
        seen.append((step.window, step.count, step.total, round(step.weight, 6), step.should_step, step.short))
    assert seen == [
        (0, 4, 12, 0.333333, False, False), (0, 4, 12, 0.333333, False, False), (0, 4, 12, 0.333333, True, False),
        (1, 4, 12, 0.333333, False, False), (1, 4, 12, 0.333333, False, False), (1, 4, 12, 0.333333, True, False),
        (2, 4, 6, 0.666667, False, True), (2, 2, 6, 0.333333, True, True),
    ]  # fmt: skip


def test_a_window_read_whole_on_a_device_is_said_and_a_loader_that_lies_about_its_length_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Token weights need the window's tokens first: the window is read whole, and on a device that is
    # more than the probe counted (meta stands for a GPU here).
    batches = [torch.zeros(2, 3, device="meta") for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="autotune"):
        steps = list(accumulate(batches, 2, count=lambda b: 6))
    assert len(steps) == 4
    (warning,) = [r.getMessage() for r in caplog.records if "read a window of 2 micro-batches" in r.getMessage()]
    assert "are on meta" in warning and "--prefetch 1" in warning

    class Says40(torch.utils.data.Sampler[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(30))  # yields 30

        def __len__(self) -> int:
            return 40

    plan = autotune.plan(effective_batch=8, max_micro_batch=4, policy="exact")
    loader = DataLoader(TensorDataset(torch.zeros(30, 2)), batch_size=4, sampler=Says40())
    with pytest.raises(ConfigError, match=r"the loader's length says 40 samples an epoch, and it ended after 30"):
        for _ in accumulate(loader, plan):
            pass
