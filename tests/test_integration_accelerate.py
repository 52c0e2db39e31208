"""Accelerate: a plain loop tuned by `tune_accelerator` and run for real on the budget device; the
double-scaling refusal; and the exact way to a ragged last window (autotune.plans.accumulate with the
Accelerator at one step)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from autotune import accumulate  # noqa: E402
from autotune.devices.budget import BudgetDevice  # noqa: E402
from autotune.errors import DoubleScalingError  # noqa: E402
from autotune.integrations.accelerate import tune_accelerator  # noqa: E402
from autotune.plans.plan import plan  # noqa: E402
from autotune.plans.sampler import PlanBatchSampler  # noqa: E402

MEMORY = 2 * 2**20
EFFECTIVE_BATCH = 960
FEATURES = 64


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows made when asked: only batches count on the budget device."""

    def __init__(self, length: int = 4096) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(FEATURES, generator=g), torch.randn(1, generator=g)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate's state is a process-wide singleton: no test may leave its accumulation to another."""
    gc.freeze()
    yield
    gc.unfreeze()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_accelerate_loop(micro: int, accumulation: int, optimizer_steps: int = 3) -> bool:
    """The plain Accelerate loop at (micro, accumulation) under the limit: True if it fits."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Rows(), batch_size=micro, shuffle=False)
    device = BudgetDevice(MEMORY)
    device.track([*model.parameters()])
    stepped = 0
    try:
        with device.active():
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(mse(model, batch))
                    optimizer.step()
                    optimizer.zero_grad()
                stepped += accelerator.sync_gradients
                if stepped == optimizer_steps:
                    return True
    except torch.OutOfMemoryError:
        return False
    raise AssertionError("the loader ended before the optimizer steps")


def test_tuned_values_run_accelerates_loop_and_one_more_runs_out() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    result = tune_accelerator(
        accelerator, model, optimizer, Rows(), effective_batch=EFFECTIVE_BATCH, loss=mse, memory=MEMORY, headroom=0
    )
    made = result.plan
    assert made is not None and made.accumulation_steps > 1
    assert accelerator.gradient_accumulation_steps == made.accumulation_steps
    assert result.workload.optimizer == "AdamW"
    assert optimizer.state == {}  # the job's optimizer was copied, never stepped
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert run_accelerate_loop(made.micro_batch, made.accumulation_steps)
    assert run_accelerate_loop(result.max_micro_batch, made.accumulation_steps)
    assert not run_accelerate_loop(result.max_micro_batch + 1, made.accumulation_steps)


def test_autotune_accumulate_refuses_accelerates_accumulation() -> None:
    accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    batches = [torch.ones(3, 2)] * 4
    with pytest.raises(DoubleScalingError, match=r"gradient_accumulation_steps=4.*1/4 of the true one"):
        next(accumulate(batches, 4))


def test_one_accelerator_step_and_autotune_accumulate_make_a_ragged_window_exact() -> None:
    """docs/frameworks.md's way: Accelerator(gradient_accumulation_steps=1), PlanBatchSampler, step.scale."""
    accelerator = accelerate.Accelerator(cpu=True)
    data = Rows(50)
    made = plan(25, 7)  # fewest-steps: [7, 6, 6, 6] per window; 50 samples = 2 windows
    model = mlp()
    loader = DataLoader(data, batch_sampler=PlanBatchSampler(len(data), made))
    model, loader = accelerator.prepare(model, loader)
    gradients = []
    for step in accumulate(loader, made):
        accelerator.backward(step.scale(mse(model, step.batch)))
        if step.should_step:
            gradients.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
    whole = mlp()
    x, y = zip(*(data[i] for i in range(25)), strict=True)
    mse(whole, (torch.stack(x), torch.stack(y))).backward()
    for got, want in zip(gradients[0], whole.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6)


def test_fewest_steps_leaves_the_accelerator_at_one_step_for_autotune_accumulate() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = mlp()
    result = tune_accelerator(
        accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), Rows(), effective_batch=EFFECTIVE_BATCH,
        loss=mse, memory=MEMORY, headroom=0, policy="fewest-steps",
    )  # fmt: skip
    assert result.plan is not None and result.plan.accumulation_steps > 1
    assert accelerator.gradient_accumulation_steps == 1
    next(accumulate([torch.ones(2, 1)] * 2, result.plan))  # no double scaling to refuse
