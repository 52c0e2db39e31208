"""Accelerate: probe the job's model, optimizer and data as an Accelerate loop runs them, and set the
Accelerator's gradient accumulation from the plan.

    from autotune.integrations.accelerate import tune_accelerator
    plan = tune_accelerator(accelerator, model, optimizer, dataset, effective_batch=256, collate=collate).plan
    loader = accelerator.prepare(DataLoader(dataset, batch_size=plan.micro_batch, collate_fn=collate))

The loop probed is Accelerate's: per micro-step a batch from the prepared loader, forward under
`accelerator.autocast()`, the loss divided by `gradient_accumulation_steps` (what
`accelerator.backward` does, for every loss, even with one step), backward, and at the window's end
`optimizer.step()` and `zero_grad()`. The prepared loader iterates one batch ahead; that batch is on
the device when the device is the host memory (the CPU budget device), so it is counted there; on a
GPU it is still the host's until its turn.

Accelerate's own accumulation runs equal micro-batches and divides by the configured steps, so the
plan uses the `exact` policy. For fewest-steps plans (unequal micro-batches) and exact short last
windows, leave the Accelerator at one step and use `autotune.plans.accumulate` with `PlanBatchSampler`
(the README shows it); combining both scales twice, and `autotune.plans.accumulate` refuses it
(`DoubleScalingError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from autotune.engine.probe import device_spec, probe_workload
from autotune.engine.trial import TrainLoop, TrialRunner
from autotune.errors import ConfigError
from autotune.plans.plan import Policy, parse_policy
from autotune.results import LoopShape, ProbeResult
from autotune.workloads.live import model_loss
from autotune.workloads.workload import OptimizerSpec, Workload

_PRECISION = {"bf16": "bf16", "fp16": "fp16"}


def accelerate_loop(accelerator: Accelerator, workload: Workload, prefetch: int) -> Callable[[TrialRunner], TrainLoop]:
    """Accelerate's accumulation loop, as a trial loop."""

    def make(runner: TrialRunner) -> TrainLoop:
        model, device = runner.model, runner.device.torch_device

        def train(batch: int, loop: LoopShape) -> float:
            optimizer = workload.make_optimizer(model.parameters())
            # A fresh scaler: the Accelerator's own must not learn its scale from the probe.
            scaler = torch.amp.GradScaler(device.type, enabled=accelerator.scaler is not None)
            held: list[Any] = [workload.make_batch(batch, device) for _ in range(prefetch)]
            current: Any = None
            seconds = 0.0
            for step in range(runner.step_budget(loop)):
                started = time.perf_counter()
                for micro in range(loop.micro_steps):
                    runner.micro_step(batch, loop, step, micro)
                    # The loader makes the next batch while the loop's variable still holds the last.
                    held.append(workload.make_batch(batch, device))
                    current = held.pop(0)
                    with accelerator.autocast():
                        loss = workload.loss(model, current)
                    loss = loss / loop.micro_steps  # accelerator.backward divides every loss
                    scaler.scale(loss).backward()
                    del loss
                    if micro == loop.micro_steps - 1:
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad()
                seconds = (time.perf_counter() - started) / loop.micro_steps
                runner.stepped(batch, step)
                if runner.done(loop):
                    break
            return seconds

        return train

    return make


def tune_accelerator(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: OptimizerSpec | torch.optim.Optimizer,
    data: Any,
    effective_batch: int | None = None,
    *,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    memory: int | str | None = None,
    headroom: float | int | str | None = None,
    steps: int = 2,
    scan_limit: int = 10_000,
    policy: Policy | str = Policy.EXACT,
) -> ProbeResult:
    """Probe the job in Accelerate's loop and set `accelerator.gradient_accumulation_steps` from the
    plan for `effective_batch` (over all processes). Call it before `accelerator.prepare(model, ...)`:
    `data` is a Dataset (with `collate`), a DataLoader or one batch; `optimizer` an instance (not
    stepped: a fresh copy of its class and settings is), a class or a factory; `loss(model, batch)`
    defaults to the model's own `.loss`. Returns the result; build the loader with
    `result.plan.micro_batch`.

    `policy="fewest-steps"`: unequal micro-batches, which Accelerate's accumulation cannot run; the
    Accelerator is left at one step, for `autotune.plans.accumulate` with a `PlanBatchSampler`."""
    policy = parse_policy(policy)
    if accelerator.num_processes > 1:
        raise ConfigError(
            f"tune_accelerator runs in one process, and this Accelerator has {accelerator.num_processes}: every "
            "process would probe alone and could differ; tune in a single process, then launch with the values"
        )
    unwrapped = accelerator.unwrap_model(model)
    workload = Workload.from_model(
        unwrapped,
        batch=data,
        optimizer=optimizer,
        loss=loss or model_loss,
        collate=collate,
        precision=_PRECISION.get(str(accelerator.mixed_precision), "fp32"),
        name=f"accelerate:{type(unwrapped).__name__}",
        scan_limit=scan_limit,
    )
    device = accelerator.device
    # The prepared loader's next batch is on the probing device only when that device is the host.
    prefetch = 1 if device.type == "cpu" else 0
    result = probe_workload(
        workload,
        train=accelerate_loop(accelerator, workload, prefetch),
        device=device_spec(device),
        memory=memory,
        headroom=headroom,
        steps=steps,
        effective_batch=effective_batch,
        world_size=accelerator.num_processes,
        policy=policy,
    )
    accumulates = result.plan is not None and policy is Policy.EXACT
    accelerator.gradient_accumulation_steps = result.plan.accumulation_steps if accumulates else 1  # type: ignore[union-attr]
    return result
