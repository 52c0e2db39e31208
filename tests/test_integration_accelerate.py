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
from autotune.errors import ConfigError, DoubleScalingError  # noqa: E402
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


# The job as configured ------------------------------------------------------------------------
def test_no_effective_batch_keeps_the_jobs_64_x_16() -> None:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=16)
    model = mlp()
    loader = DataLoader(Rows(), batch_size=64)
    result = tune_accelerator(
        accelerator, model, torch.optim.AdamW(model.parameters()), loader, loss=mse, memory=MEMORY, headroom=0
    )
    tuning = result.framework
    assert tuning.effective_batch_from == "job"
    assert (tuning.job.micro_batch, tuning.job.accumulation_steps, tuning.job.effective_batch) == (64, 16, 1024)
    assert result.plan.effective_batch == 1024 and result.plan.accumulation_steps > 1
    assert accelerator.gradient_accumulation_steps == result.plan.accumulation_steps == tuning.tuned.accumulation_steps
    assert tuning.tuned.micro_batch == result.plan.micro_batch
    # Accelerate's loop holds one micro-batch at a time: no trial beyond two micro-steps.
    assert max(t.micro_steps for t in result.trials) == 2
    assert tuning.gradient_check.equivalent  # a mean loss, divided by the steps: the window is the batch
    # The job's DataLoader cannot change its batch size: the plan says to build it again.
    micro, steps = result.plan.micro_batch, result.plan.accumulation_steps
    assert f"the DataLoader given makes batches of 64: build it again with batch_size={micro}" in " ".join(
        result.plan.warnings
    ) and f"64 x {steps} = {64 * steps} samples a step" in " ".join(result.plan.warnings)


def test_a_dataset_without_effective_batch_is_refused_with_the_fix() -> None:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = mlp()
    with pytest.raises(
        ConfigError, match=r"data is not a DataLoader, so the job's effective batch is unknown: pass effective_batch="
    ):
        tune_accelerator(
            accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), Rows(), loss=mse, memory=MEMORY
        )


def test_tuning_after_prepare_is_refused() -> None:
    """A prepared loader keeps its batch size: the plan's micro-batch would never run (16 samples a
    step instead of 48, before this refusal)."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _loader = accelerator.prepare(model, optimizer, DataLoader(Rows(), batch_size=8))
    with pytest.raises(
        ConfigError,
        match=r"after accelerator.prepare \(it prepared .*a DataLoader of batch size 8\).*call tune_accelerator first",
    ):
        tune_accelerator(accelerator, model, optimizer, Rows(), effective_batch=48, loss=mse, memory=MEMORY, headroom=0)


def test_a_summed_loss_is_warned_with_the_factor(capsys: pytest.CaptureFixture[str]) -> None:
    def summed(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y, reduction="sum")

    accelerator = accelerate.Accelerator(cpu=True)
    model = mlp()
    result = tune_accelerator(
        accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), Rows(), effective_batch=EFFECTIVE_BATCH,
        loss=summed, memory=MEMORY, headroom=0, progress=True,
    )  # fmt: skip
    check = result.framework.gradient_check
    steps = result.plan.accumulation_steps
    assert not check.equivalent and check.factor == pytest.approx(1 / steps, rel=1e-3), check
    warning = next(w for w in result.plan.warnings if "accumulation does not train like" in w)
    assert f"gave {check.factor:.2f}x the gradient" in warning
    # progress=True: the command line's table of trials on stderr, then the plan.
    shown = capsys.readouterr().err
    assert "tuning Sequential in Accelerate's loop" in shown and "batch" in shown
    assert f"autotune: micro-batch {result.plan.micro_batch} x {steps} accumulation steps" in shown
