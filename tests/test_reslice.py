"""A plan's windows from any loader: `accumulate(loader, plan)` gives every optimizer step exactly the
plan's effective batch whatever the loader's batch size, and refuses what it cannot cut.

The failure this guards against (issue 22): `DataLoader(batch_size=plan.micro_batch)` with a plan of
unequal micro-batches ran 260, 260 and 80 samples per optimizer step for an effective batch of 256.
"""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autotune
from autotune.errors import ConfigError
from autotune.plans.accumulate import MicroStep, OOMGuard, accumulate
from autotune.plans.batches import join_batches, plan_windows_of, split_batch
from autotune.plans.sampler import PlanBatchSampler

ROOT = Path(__file__).resolve().parent.parent


def windows_of(steps: Iterator[MicroStep[Any]]) -> list[list[MicroStep[Any]]]:
    windows: list[list[MicroStep[Any]]] = [[]]
    for step in steps:
        windows[-1].append(step)
        if step.should_step:
            windows.append([])
    return [w for w in windows if w]


def test_a_fixed_batch_size_loader_gets_the_plans_windows_and_the_full_batch_gradient() -> None:
    # The README's pattern with a fewest-steps plan of unequal micro-batches: 29 = [15, 14].
    plan = autotune.plan(effective_batch=29, max_micro_batch=15)
    assert plan.micro_batches == [15, 14]
    torch.manual_seed(0)
    n = 100
    inputs, targets = torch.randn(n, 6, dtype=torch.float64), torch.randn(n, 2, dtype=torch.float64)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=plan.micro_batch)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    loss_fn = nn.MSELoss()

    windows = windows_of(accumulate(loader, plan))
    # 100 samples: three full windows of 29, then a short one of 13, cut in the plan's sizes in order.
    assert [[s.count for s in w] for w in windows] == [[15, 14], [15, 14], [15, 14], [13]]
    assert [w[0].short for w in windows] == [False, False, False, True]
    assert all(s.total == 29 for w in windows[:3] for s in w)

    # Every window's accumulated gradient is the gradient of the mean over its samples, in order.
    start = 0
    for window in windows:
        model.zero_grad()
        for step in window:
            x, y = step.batch
            step.scale(loss_fn(model(x), y)).backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        stop = start + window[0].total
        model.zero_grad()
        loss_fn(model(inputs[start:stop]), targets[start:stop]).backward()
        want = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        assert torch.allclose(got, want, atol=1e-12), (start, stop)
        start = stop
    assert start == n


@pytest.mark.parametrize("batch_size", [1, 4, 7, 15, 16, 40, 100])
def test_any_loader_batch_size_gives_the_same_windows_of_the_same_samples(batch_size: int) -> None:
    plan = autotune.plan(effective_batch=29, max_micro_batch=15)
    ids = torch.arange(100)
    loader = DataLoader(TensorDataset(ids, ids * 10), batch_size=batch_size)
    windows = windows_of(accumulate(loader, plan))
    assert [[s.count for s in w] for w in windows] == [[15, 14]] * 3 + [[13]]
    seen = torch.cat([step.batch[0] for w in windows for step in w])
    assert torch.equal(seen, ids)
    assert all(torch.equal(step.batch[1], step.batch[0] * 10) for w in windows for step in w)


def test_a_plan_batch_sampler_loader_passes_through_untouched() -> None:
    plan = autotune.plan(effective_batch=29, max_micro_batch=15)
    loader = DataLoader(TensorDataset(torch.arange(60)), batch_sampler=PlanBatchSampler(60, plan))
    batches = list(loader)
    got = [step.batch for step in accumulate(batches, plan)]
    assert len(got) == len(batches)
    assert all(a is b for a, b in zip(got, batches, strict=True))  # no copy, no view: the same objects


def test_dicts_namedtuples_and_lists_of_strings_are_cut_and_joined() -> None:
    class Samples(Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": torch.full((3,), i), "text": f"s{i}", "label": i}

    plan = autotune.plan(effective_batch=10, max_micro_batch=6)  # [5, 5]
    loader = DataLoader(Samples(), batch_size=3)
    steps = list(accumulate(loader, plan))
    assert [s.count for s in steps] == [5, 5, 5, 5]
    first = steps[0].batch
    assert first["text"] == ["s0", "s1", "s2", "s3", "s4"]
    assert first["label"].tolist() == [0, 1, 2, 3, 4]
    assert first["input_ids"][:, 0].tolist() == [0, 1, 2, 3, 4]


def test_split_and_join_are_inverse() -> None:
    batch: Any = ({"a": torch.arange(10), "names": [str(i) for i in range(10)]}, torch.arange(10) * 2, "constant")
    pieces = split_batch(batch, 3)
    assert [len(p[1]) for p in pieces] == [3, 3, 3, 1]
    joined: Any = join_batches(pieces)
    assert torch.equal(joined[0]["a"], batch[0]["a"]) and joined[0]["names"] == batch[0]["names"]
    assert torch.equal(joined[1], batch[1]) and joined[2] == "constant"


def test_batches_padded_to_different_lengths_are_refused_with_the_fix() -> None:
    # Each loader batch padded to its own longest sequence: a micro-batch spanning two cannot be built.
    batches = [torch.zeros(4, 7), torch.zeros(4, 9), torch.zeros(4, 5)]
    plan = autotune.plan(effective_batch=6, max_micro_batch=6)
    with pytest.raises(ConfigError, match="PlanBatchSampler"):
        list(accumulate(batches, plan))


def test_a_batch_with_nothing_to_cut_along_is_refused_before_any_step() -> None:
    plan = autotune.plan(effective_batch=4, max_micro_batch=2)
    steps = accumulate([object(), object()], plan)
    with pytest.raises(ConfigError, match="PlanBatchSampler"):
        next(steps)


def test_a_bare_step_count_still_groups_batches_as_they_come() -> None:
    batches = [torch.zeros(3), torch.zeros(5), torch.zeros(2)]
    windows = windows_of(accumulate(batches, 2))
    assert [[s.count for s in w] for w in windows] == [[3, 5], [2]]


def test_the_oom_guard_runs_the_plans_windows_too() -> None:
    plan = autotune.plan(effective_batch=29, max_micro_batch=15)
    model = nn.Linear(2, 1)
    guard = OOMGuard(model)
    loader = DataLoader(TensorDataset(torch.randn(58, 2)), batch_size=plan.micro_batch)
    totals = []
    for window in guard.windows(loader, plan):
        counts = window.run(lambda step: step.count)
        totals.append(sum(c for c in counts if isinstance(c, int)))
    assert totals == [29, 29]


def test_plan_windows_of_reads_one_window_ahead_at_most() -> None:
    plan = autotune.plan(effective_batch=8, max_micro_batch=4)  # [4, 4]
    pulled = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(10):
            pulled.append(i)
            yield torch.full((2,), i)

    windows = plan_windows_of(source(), plan)
    next(windows)
    assert pulled == [0, 1, 2, 3]


def test_the_readme_examples_loop_gets_the_plans_effective_batch_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/accumulate_loop.py, counted: every optimizer step but an epoch's last sees 32 samples."""
    windows: list[int] = []
    original = autotune.accumulate

    def counting(*args: Any, **kwargs: Any) -> Iterator[MicroStep[Any]]:
        total = 0
        for step in original(*args, **kwargs):
            total += step.count
            yield step
            if step.should_step:
                windows.append(total)
                total = 0

    monkeypatch.setattr(autotune, "accumulate", counting)
    runpy.run_path(str(ROOT / "examples" / "accumulate_loop.py"), run_name="__main__")
    assert windows == [32, 32, 32, 4] * 20
