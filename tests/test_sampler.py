"""PlanBatchSampler: any DataLoader runs a plan's micro-batches, unequal ones included."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.plans.accumulate import accumulate
from autotune.plans.sampler import PlanBatchSampler


def test_a_fewest_steps_plan_runs_window_after_window_with_a_short_last_window() -> None:
    plan = autotune.plan(effective_batch=256, max_micro_batch=100)  # [86, 85, 85]
    sampler = PlanBatchSampler(600, plan)
    sizes = [len(b) for b in sampler]
    assert sizes == [86, 85, 85, 86, 85, 85, 86, 2]  # 600 = 2 x 256 + 88
    assert len(sampler) == len(sizes)
    assert sorted(i for b in sampler for i in b) == list(range(600))
    dropped = PlanBatchSampler(600, plan, drop_last=True)
    assert [len(b) for b in dropped] == [86, 85, 85] * 2 and len(dropped) == 6


def test_windows_of_the_loader_are_the_plans_and_the_gradient_is_the_full_batch_one() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(512, 4), torch.randn(512, 1)
    plan = autotune.plan(effective_batch=256, max_micro_batch=100)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=PlanBatchSampler(512, plan, shuffle=True))
    model = torch.nn.Linear(4, 1)
    windows: dict[int, list[int]] = {}
    seen: list[torch.Tensor] = []
    for step in accumulate(loader, plan):
        xb, yb = step.batch
        windows.setdefault(step.window, []).append(len(xb))
        seen.append(xb)
        step.scale(torch.nn.functional.mse_loss(model(xb), yb)).backward()
        if step.should_step:
            break
    assert windows == {0: [86, 85, 85]}
    got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    window_x = torch.cat(seen)
    rows = [int((x == row).all(dim=1).nonzero()[0]) for row in window_x]
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    for want, have in zip((p.grad for p in model.parameters()), got, strict=True):
        torch.testing.assert_close(have, want)


def test_a_sampler_source_gives_its_own_indices() -> None:
    plan = autotune.plan(effective_batch=10, max_micro_batch=4)  # [4, 3, 3]
    assert list(PlanBatchSampler([9, 8, 7, 6, 5], plan)) == [[9, 8, 7, 6], [5]]
