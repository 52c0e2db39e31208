"""Accelerate: probe the job's model, optimizer and data as an Accelerate loop runs them, and set the
Accelerator's gradient accumulation from the plan.

    from autotune.integrations.accelerate import tune_accelerator
    plan = tune_accelerator(accelerator, model, optimizer, dataset, effective_batch=256, collate=collate).plan
    loader = accelerator.prepare(DataLoader(dataset, batch_size=plan.micro_batch, collate_fn=collate))

Called before `accelerator.prepare`: a prepared DataLoader keeps its batch size, so the plan's
micro-batch would not be what the loop runs, and it is refused. With a DataLoader as `data` and no
`effective_batch`, the plan keeps the job's: the size of the first batch it yields (read on the
host) x `gradient_accumulation_steps` x processes; a Dataset carries no batch size, so it needs
`effective_batch=` (or `"max"`). A DataLoader cannot change its batch size: one built with
`batch_size=` that is not the plan's micro-batch gets the plan's warning to build it again, and one
with a `batch_sampler` of its own is refused (nothing set), with the fix: tune with the Dataset, and
build the loader with `batch_sampler=result.plan.sampler(len(dataset))`.

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

Accelerate's loop holds one micro-batch at a time (and the loader's next one), so two micro-steps
stand for any number. When the plan accumulates, the gradient check
(`autotune.integrations.gradients`) runs the loss over one window and one batch of the same samples,
the job's own (the DataLoader's or the Dataset's, collated by its collate function): a loss summed
over its samples is off by 1/steps once divided by the steps, and a mean over each micro-batch's
tokens as far as the samples' lengths differ.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from autotune.engine.probe import device_spec, probe_workload
from autotune.engine.trial import TrainLoop, TrialRunner
from autotune.errors import ConfigError
from autotune.integrations import gradients, micro_and_accumulation
from autotune.integrations.job import (
    EffectiveBatch,
    custom_batch_sampler,
    first_batch_size,
    loader_batch_size,
    log_outcome,
    log_target,
    planned_effective,
    preserved,
    reporting,
    tuning_record,
    with_tuning,
    yields_the_plan,
)
from autotune.integrations.reporting import default_collate_hint, reports_to_the_caller
from autotune.plans.plan import Policy, parse_policy
from autotune.results import JobBatch, LoopShape, ProbeResult, TrialRecord
from autotune.workloads import checkpointing as activation_checkpointing
from autotune.workloads.checkpointing import BlocksSpec
from autotune.workloads.live import is_dataset, model_loss
from autotune.workloads.workload import OptimizerSpec, Workload

logger = logging.getLogger("autotune.integrations.accelerate")

_PRECISION = {"bf16": "bf16", "fp16": "fp16"}
_GRADIENT_FIX = (
    "Accelerate divides each micro-step's loss by gradient_accumulation_steps (and autotune.accumulate's step.scale "
    "weighs it by its micro-batch's share), which averages a loss that is a mean over its micro-batch: make the loss "
    "the mean over the micro-batch's samples, not a sum"
)
_WEIGHTS_FIX = (
    "accelerator.backward divides every micro-step's loss by gradient_accumulation_steps alike, so a loss that is a "
    "mean over its micro-batch's tokens (or over any count that differs between micro-batches) weighs the tokens of "
    "a short micro-batch more than those of a long one: leave the Accelerator at one step and weigh each loss by "
    "its share of the window's tokens with autotune.accumulate(loader, plan, count=lambda batch: "
    "(batch['labels'] != -100).sum()) and step.scale(loss) (docs/accumulation.md, token-weighted losses), or "
    "return the sum of the token losses divided by the tokens of the whole window"
)


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


def accelerate_gradients(
    accelerator: Accelerator, workload: Workload, model: nn.Module, samples: gradients.CheckSamples
) -> gradients.WindowGradients:
    """The gradients Accelerate's loop leaves for one window of `steps` micro-batches of `micro`
    samples (the job's own, as its loader collates them: `samples`): each loss under autocast,
    divided by the steps."""

    def window(micro: int, steps: int) -> torch.Tensor:
        parts = samples.batches(micro, steps, next(model.parameters()).device)
        try:
            with gradients.same_function(model):
                for part in parts:
                    with accelerator.autocast():
                        loss = workload.loss(model, part)
                    (loss / steps).backward()
            return gradients.sampled_gradients(model)
        finally:
            gradients.clear_gradients(model)

    return window


def _prepared(accelerator: Accelerator, objects: tuple[Any, ...]) -> str | None:
    """What was already prepared, in words (loaders with their batch sizes); None if nothing."""
    loaders = {id(loader): loader for loader in accelerator._dataloaders}
    named = []
    for item in objects:
        if getattr(item, "_is_accelerate_prepared", False):
            if isinstance(item, torch.utils.data.DataLoader):
                loaders[id(item)] = item
            else:
                named.append(f"the {type(item).__name__}")
    named += [f"a DataLoader of batch size {loader_batch_size(loader) or '?'}" for loader in loaders.values()]
    return ", ".join(named) or None


def _check_samples(data: Any, collate: Callable[[list[Any]], Any] | None, workload: Workload) -> gradients.CheckSamples:
    """The gradient check's samples: the job's own (a DataLoader's dataset and collate_fn, or the
    Dataset with `collate`), the rows of the one batch given, or the worst case's where the loader
    has automatic batching off."""
    if isinstance(data, torch.utils.data.DataLoader):
        found = gradients.JobSamples.of_loader(data)
        if found is not None and collate is not None:
            found = gradients.JobSamples(data.dataset, collate)
        if found is not None:
            return found
        return gradients.RowsOf(workload.make_batch, "worst-case samples: the loader has automatic batching off")
    if is_dataset(data):
        return gradients.JobSamples(data, collate)
    return gradients.RowsOf(workload.make_batch, "rows of the batch given")


def _sampler_refusal(
    data: Any, given: int | None, micro: int, accumulation: int, effective: int | None, policy: Policy
) -> ConfigError | None:
    """A DataLoader whose batch_sampler yields batches of another size than the plan's micro-batch:
    the loader cannot be given the plan's size (a loader built with batch_size= can: the plan's
    warning says so), and Accelerate would run the sampler's batches."""
    if (
        policy is not Policy.EXACT
        or given is None
        or not isinstance(data, torch.utils.data.DataLoader)
        or yields_the_plan(given, micro, data)
    ):
        return None
    sampler = custom_batch_sampler(data)
    if sampler is None:
        return None
    target = "the effective batch" if effective is None else f"the effective batch {effective}"
    return ConfigError(
        f"tune_accelerator: the DataLoader given yields batches of {given} from its batch_sampler ({sampler}), and "
        f"the plan for {target} runs micro-batches of {micro} x {accumulation} accumulation "
        f"step{'' if accumulation == 1 else 's'}: a DataLoader cannot change its batch_sampler, so Accelerate would "
        f"run {given} x {accumulation} = {given * accumulation} samples a step per process instead of "
        f"{micro * accumulation}. Give the loader the plan's micro-batches: tune with the Dataset "
        f"(tune_accelerator(accelerator, model, optimizer, loader.dataset, effective_batch={effective or 'max'!r}, "
        "collate=loader.collate_fn)), then build DataLoader(dataset, batch_sampler=result.plan.sampler(len(dataset)), "
        "collate_fn=...); or give your batch_sampler batches of the plan's micro-batch. Nothing was set: "
        "gradient_accumulation_steps is as it was"
    )


@reports_to_the_caller(hint=default_collate_hint)
def tune_accelerator(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: OptimizerSpec | torch.optim.Optimizer,
    data: Any,
    effective_batch: EffectiveBatch = None,
    *,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    memory: int | str | None = None,
    headroom: float | int | str | None = None,
    steps: int = 2,
    scan_limit: int = 10_000,
    policy: Policy | str = Policy.EXACT,
    on_trial: Callable[[TrialRecord], None] | None = None,
    check_gradients: bool = True,
    progress: bool | None = None,
    checkpointing: str | None = None,
    checkpoint_blocks: BlocksSpec | None = None,
) -> ProbeResult:
    """Probe the job in Accelerate's loop and set `accelerator.gradient_accumulation_steps` from the
    plan for `effective_batch` (over all processes; by default the job's own: the DataLoader's batch
    size x gradient_accumulation_steps x processes; "max": the largest micro-batch that fits, no
    accumulation). Call it before `accelerator.prepare(model, ...)`: `data` is a DataLoader, a
    Dataset (with `collate`) or one batch; `optimizer` an instance (not stepped: a fresh copy of its
    class and settings is), a class or a factory; `loss(model, batch)` defaults to the model's own
    `.loss`. Returns the result; build the loader with `result.plan.micro_batch`.

    `policy="fewest-steps"`: unequal micro-batches, which Accelerate's accumulation cannot run; the
    Accelerator is left at one step, for `autotune.plans.accumulate` with a `PlanBatchSampler`.
    `check_gradients`: the gradient check when the plan accumulates. `progress`: the live table of
    trials (default: when stderr is a terminal); every trial is logged at INFO either way.
    `checkpointing`: activation checkpointing of the model's repeated blocks (`checkpoint_blocks`, or
    found: autotune.workloads.checkpointing), "auto" choosing among none and full by the plan's
    measured speed (or one setting, none, full, every=K); the setting chosen is applied to `model`
    (`result.workload.checkpointing`). None: the model as it is."""
    started = time.perf_counter()
    policy = parse_policy(policy)
    if accelerator.num_processes > 1:
        raise ConfigError(
            f"tune_accelerator runs in one process, and this Accelerator has {accelerator.num_processes}: every "
            "process would probe alone and could differ; tune in a single process, then launch with the values"
        )
    prepared = _prepared(accelerator, (model, optimizer, data))
    if prepared is not None:
        raise ConfigError(
            f"tune_accelerator after accelerator.prepare (it prepared {prepared}): a prepared DataLoader keeps its "
            "batch size, so the loop would not run the plan's micro-batch; call tune_accelerator first, then "
            "accelerator.prepare a DataLoader with batch_size=result.plan.micro_batch"
        )
    given = None
    if isinstance(data, torch.utils.data.DataLoader):
        # The batch it really yields (a batch_sampler need not say its size), else the one it declares.
        given = first_batch_size(data) or loader_batch_size(data)
    job = (
        None
        if given is None
        else JobBatch.of(given, accelerator.gradient_accumulation_steps, accelerator.num_processes)
    )
    unknown = (
        "the DataLoader has no batch size"
        if isinstance(data, torch.utils.data.DataLoader)
        else "data is not a DataLoader"
    )
    effective, source = planned_effective(effective_batch, job, who="tune_accelerator", unknown=unknown)
    unwrapped = accelerator.unwrap_model(model)
    device = accelerator.device
    with (
        preserved(unwrapped, device),
        reporting(
            logger, f"tuning {type(unwrapped).__name__} in Accelerate's loop", show=progress, on_trial=on_trial
        ) as reporter,
    ):
        log_target(logger, effective, source, job)
        precision = _PRECISION.get(str(accelerator.mixed_precision), "fp32")
        workload = Workload.from_model(
            unwrapped,
            batch=data,
            optimizer=optimizer,
            loss=loss or model_loss,
            collate=collate,
            precision=precision,
            name=f"accelerate:{type(unwrapped).__name__}",
            scan_limit=scan_limit,
        )
        if checkpoint_blocks is not None:
            workload = dataclasses.replace(workload, checkpoint_blocks=checkpoint_blocks)
        # The prepared loader's next batch is on the probing device only when that device is the host.
        prefetch = 1 if device.type == "cpu" else 0
        result = probe_workload(
            workload,
            train=accelerate_loop(accelerator, workload, prefetch),
            holds_window=False,
            on_trial=reporter.trial,
            on_progress=reporter.progress,
            device=device_spec(device),
            memory=memory,
            headroom=headroom,
            steps=steps,
            effective_batch=effective,
            world_size=accelerator.num_processes,
            policy=policy,
            checkpointing=checkpointing,
        )
        if checkpointing is not None:  # the job trains with the setting its plan was verified with
            activation_checkpointing.apply(unwrapped, result.workload.checkpointing or "none", checkpoint_blocks)
        made = result.plan
        micro = micro_and_accumulation(result)[0]
        window = 1 if made is None else made.accumulation_steps
        accumulation = window if policy is Policy.EXACT else 1
        refusal = _sampler_refusal(data, given, micro, accumulation, effective, policy)
        if refusal is not None:
            raise refusal
        check = None
        samples = _check_samples(data, collate, workload)
        if check_gradients and window > 1:
            check = gradients.check_gradients(
                accelerate_gradients(accelerator, workload, unwrapped, samples),
                micro=micro,
                steps=window,
                precision=precision,
            )
        tuning = tuning_record(
            "accelerate",
            job=job,
            effective=effective,
            source=source,
            tuned=(micro, window),
            world_size=accelerator.num_processes,
            check=check,
            result=result,
            started=started,
        )
        stale = None
        if given is not None and not yields_the_plan(given, micro, data) and policy is Policy.EXACT:
            # A DataLoader cannot change its batch size: the job must build its own again.
            stale = (
                f"the DataLoader given makes batches of {given}: build it again with batch_size={micro}, the plan's "
                f"micro-batch, or the loop runs {given} x {accumulation} = {given * accumulation} samples a step per "
                f"process instead of {micro * accumulation}"
            )
        result = with_tuning(
            result, tuning, gradients.warning(check, _GRADIENT_FIX, _WEIGHTS_FIX, samples.described), stale
        )
        then = (
            f"set gradient_accumulation_steps={accumulation}; build the DataLoader with batch_size={micro}"
            if policy is Policy.EXACT
            else "the Accelerator left at one step: run the plan's micro-batches with autotune.accumulate"
        )
        log_outcome(reporter, result, then)
    accelerator.gradient_accumulation_steps = accumulation
    return result
