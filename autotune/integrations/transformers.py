"""The Hugging Face Trainer: probe its own `train()` and set its batch size and accumulation.

    from autotune.integrations.transformers import tune_trainer
    tune_trainer(trainer)  # keeps the job's effective batch: per_device_train_batch_size x accumulation
    trainer.train()

Every trial is the Trainer's own loop: `trainer.train()` for `steps` optimizer steps at a
micro-batch size and number of accumulation steps, with the optimizer it creates from `args.optim`
(or the one it was given, restarted with no state), its collator over the worst-case examples of
`train_dataset`, its `compute_loss`, its precision, its activation checkpointing and gradient
clipping. So what the Trainer holds beyond one step is counted: it fetches a whole accumulation
window of micro-batches before the first forward, which is why the plan is searched again in its
own number of micro-steps (`autotune.engine.probe.settle_plan`).

Between trials the Trainer is put back as it was (its attributes, its arguments, the model's
weights); your callbacks do not run during the probe. The Trainer runs equal micro-batches, so plans
use the `exact` policy: when the effective batch per rank has no divisor near the largest micro-batch
that fits, the plan takes more steps than fewest-steps would (its warning says how many), and
`trainer.autotune_result.plan` shows both.

When the plan accumulates, the gradient check (`autotune.integrations.gradients`) runs the Trainer's
`train()` over one window and over one batch of the same examples (the job's, from the shortest to
the longest, in order): a model whose forward takes `**kwargs` but whose loss ignores
`num_items_in_batch` gets no division by the accumulation steps from the Trainer, and a loss that is
a mean over each micro-batch's tokens without `num_items_in_batch` weighs short micro-batches' tokens
more; the plan's warning says by how much its gradient is off and how to fix it.

A `get_train_dataloader` that ignores `per_device_train_batch_size` (built at the job's size and at
one more, before the probe: a size written into it makes the same batches at both) is refused.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import Dataset, SequentialSampler
from transformers import DefaultFlowCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from autotune.engine.probe import device_spec, probe_workload
from autotune.engine.trial import TrainLoop, TrialRunner
from autotune.errors import ConfigError, ProbeError
from autotune.integrations import gradients, micro_and_accumulation
from autotune.integrations.job import (
    EffectiveBatch,
    loader_batch_size,
    log_outcome,
    log_target,
    planned_effective,
    preserved,
    reporting,
    tuning_record,
    with_tuning,
)
from autotune.integrations.reporting import reports_to_the_caller
from autotune.plans.plan import Policy
from autotune.results import JobBatch, LoopShape, ProbeResult, TrialRecord
from autotune.workloads import worstcase
from autotune.workloads.live import OptimizerCopy
from autotune.workloads.workload import Workload

logger = logging.getLogger("autotune.integrations.transformers")


class _Repeated(Dataset[Any]):
    """`length` items cycling through the worst-case examples: every batch the Trainer makes is the worst."""

    def __init__(self, dataset: Any, indices: tuple[int, ...], length: int) -> None:
        self.dataset, self.indices, self.length = dataset, indices, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i % len(self.indices)]]


class _TrainerOptimizer:
    """The optimizer the Trainer would create from its arguments, for the fingerprint and the name."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        given = trainer.optimizer
        self.optimizer_name = (
            type(given).__name__
            if given is not None
            else f"trainer:{getattr(trainer.args.optim, 'value', trainer.args.optim)}"
        )

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.trainer.args, self.trainer.model)
        made: torch.optim.Optimizer = cls(params, **kwargs)
        return made


def _precision(trainer: Trainer) -> str:
    return "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else "fp32"


class _Settling(TrainerCallback):
    """Each optimizer step of the Trainer's loop reported to the runner, and the loop stopped once
    the caching allocator settled (the runner's rule, as in autotune's own loop)."""

    def __init__(self, runner: TrialRunner, batch: int, loop: LoopShape) -> None:
        self.runner, self.batch, self.loop = runner, batch, loop
        self.micro = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.micro = 0
        self.runner.micro_step(self.batch, self.loop, state.global_step, 0)
        return control

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.micro += 1
        self.runner.micro_step(self.batch, self.loop, state.global_step, self.micro)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.runner.stepped(self.batch, state.global_step - 1)
        if self.runner.done(self.loop):
            control.should_training_stop = True
        return control


@contextmanager
def _borrowed(trainer: Trainer) -> Iterator[TrainingArguments]:
    """The Trainer lent to one `train()` of autotune's: a copy of its arguments to change (no saving,
    evaluation, logging or progress bar), and afterwards its attributes and callbacks as they were."""
    saved = dict(vars(trainer))
    handler = trainer.callback_handler
    saved_handler = dict(vars(handler))
    args = copy.copy(trainer.args)
    args.save_strategy, args.eval_strategy = SaveStrategy.NO, IntervalStrategy.NO
    args.logging_strategy, args.eval_on_start = IntervalStrategy.NO, False
    args.load_best_model_at_end, args.push_to_hub, args.auto_find_batch_size = False, False, False
    args.disable_tqdm = True
    try:
        trainer.args = args
        yield args
    finally:
        # The accelerator keeps the run's prepared optimizer (and its state) until the next
        # train(); the job's own train() must start from nothing of autotune's.
        trainer.accelerator.free_memory()
        vars(trainer).clear()
        vars(trainer).update(saved)
        vars(handler).clear()
        vars(handler).update(saved_handler)


def _optimizer_copy(trainer: Trainer) -> OptimizerCopy | None:
    return None if trainer.optimizer is None else OptimizerCopy(trainer.optimizer, trainer.model)


def trainer_loop(trainer: Trainer, dataset: Any, indices: tuple[int, ...]) -> Callable[[TrialRunner], TrainLoop]:
    """The Trainer's own `train()` as a trial loop over the worst-case examples."""
    given = _optimizer_copy(trainer)

    def make(runner: TrialRunner) -> TrainLoop:
        switched = runner.workload.apply_checkpointing is not None  # a probe that sets the Trainer's switch

        def train(batch: int, loop: LoopShape) -> float:
            with _borrowed(trainer) as args:
                if switched:
                    _switch(args, runner.workload.checkpointing)
                args.per_device_train_batch_size = batch
                args.gradient_accumulation_steps = loop.micro_steps
                budget = runner.step_budget(loop)
                args.max_steps = budget
                trainer._train_batch_size = args.train_batch_size
                per_step = args.train_batch_size * loop.micro_steps * args.world_size
                trainer.train_dataset = _Repeated(dataset, indices, per_step * budget)
                trainer.callback_handler.callbacks = [DefaultFlowCallback(), _Settling(runner, batch, loop)]
                # A given optimizer and scheduler must not be stepped: each trial gets a fresh copy
                # of the optimizer, and the Trainer's own scheduler (no memory to speak of).
                trainer.optimizer = None if given is None else given(runner.model.parameters())
                trainer.lr_scheduler = None
                output = trainer.train()
                ran = max(runner.steps_run, 1)
                return float(output.metrics.get("train_runtime", 0.0)) / (ran * loop.micro_steps)

        return train

    return make


def _switch(args: TrainingArguments, setting: str) -> None:
    """The Trainer's own activation checkpointing for `setting` (non-reentrant, as autotune's block
    wrapping): `activation_checkpointing` (with `every_n_layers` for every=K, which a Trainer counts
    from its first layer) where the Trainer has it, else `gradient_checkpointing`, which checkpoints
    every layer or none (every=K is refused there)."""
    on = setting != "none"
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if hasattr(args, "activation_checkpointing"):
        if setting.startswith("every="):
            kwargs["every_n_layers"] = int(setting.removeprefix("every="))
        args.activation_checkpointing = on
        args.activation_checkpointing_kwargs = kwargs if on else None
    elif setting.startswith("every="):
        raise ConfigError(
            f"tune_trainer: checkpointing {setting!r}: this Trainer's gradient_checkpointing checkpoints every layer; "
            "choose among none and full (checkpointing='auto')"
        )
    args.gradient_checkpointing = on
    args.gradient_checkpointing_kwargs = kwargs if on else None


def _model_switch(model: torch.nn.Module, setting: str) -> None:
    """The model's side of the Trainer's switch, as each trial's model is built: off for none (a
    Trainer's train() turns it on when its argument says so, never off)."""
    if setting != "none":
        return
    for flag, disable in (
        ("is_activation_checkpointing", "activation_checkpointing_disable"),
        ("is_gradient_checkpointing", "gradient_checkpointing_disable"),
    ):
        if hasattr(model, disable):
            if getattr(model, flag, False):
                getattr(model, disable)()
            return


def set_trainer_checkpointing(job: Trainer | TrainingArguments, setting: str) -> None:
    """Set a Trainer's (or its arguments') activation checkpointing to `setting` (none, full, every=K
    where the Trainer has every_n_layers): what `tune_trainer(..., checkpointing=...)` sets, and what
    `autotune.client.CheckpointedPlan.apply` sets for a plan the service chose."""
    args = job.args if isinstance(job, Trainer) else job
    _switch(args, setting)
    if isinstance(job, Trainer) and isinstance(job.model, torch.nn.Module):
        _model_switch(job.model, setting)


def _checkpointing_words(args: TrainingArguments) -> str:
    if hasattr(args, "activation_checkpointing"):
        return f"activation_checkpointing={args.activation_checkpointing}"
    return f"gradient_checkpointing={args.gradient_checkpointing}"


class _Captured(Exception):
    """Ends a gradient-check run of train() before its optimizer step."""


class _Capture(TrainerCallback):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.gradients: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.gradients.append(gradients.sampled_gradients(self.model))
        raise _Captured


def trainer_gradients(trainer: Trainer, dataset: Any, samples: gradients.JobSamples) -> gradients.WindowGradients:
    """The gradients the Trainer's own `train()` leaves for one window of `steps` micro-batches of
    `micro` examples (the job's, from the shortest to the longest: `samples`), stopped before the
    optimizer steps: the Trainer's collator on each micro-batch, its count of `num_items_in_batch`
    over the window, its division by the steps, its compute_loss."""
    model = trainer.model
    assert isinstance(model, torch.nn.Module)
    given = _optimizer_copy(trainer)

    def window(micro: int, steps: int) -> torch.Tensor:
        indices = tuple(i for i, _sample in samples.chosen(micro * steps))
        capture = _Capture(model)
        with gradients.same_function(model), _borrowed(trainer) as args:
            args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, steps
            args.max_steps = 1
            args.max_grad_norm = 0.0  # clipping would hide the scale that is checked
            trainer._train_batch_size = args.train_batch_size
            trainer.train_dataset = _Repeated(dataset, indices, len(indices))
            # In order: the window's micro-batches are the chosen examples, shortest first (an instance
            # attribute, gone with the rest of the borrowing).
            trainer._get_train_sampler = lambda *_args, **_kwargs: SequentialSampler(trainer.train_dataset)
            trainer.callback_handler.callbacks = [capture]
            trainer.optimizer = None if given is None else given(model.parameters())
            trainer.lr_scheduler = None
            try:
                trainer.train()
            except _Captured:
                pass
            finally:
                gradients.clear_gradients(model)
        if not capture.gradients:
            raise ProbeError("the Trainer's train() ended before its optimizer step")
        return capture.gradients[0]

    return window


def _gradient_fix(trainer: Trainer) -> str:
    # The Trainer's switch for dividing the loss by the steps: `loss_is_scaled_for_ga` where it has one
    # (recent transformers 5), `model_accepts_loss_kwargs` before it (5.17, the H100 image's, has none).
    switch = "loss_is_scaled_for_ga" if hasattr(trainer, "loss_is_scaled_for_ga") else "model_accepts_loss_kwargs"
    if (
        trainer.model_accepts_loss_kwargs
        and trainer.compute_loss_func is None
        and getattr(trainer, "loss_is_scaled_for_ga", None) is None
    ):
        how = (
            "the model's forward takes **kwargs, so the Trainer passes it num_items_in_batch and does not divide the "
            "loss by the accumulation steps, and this model's loss does not use num_items_in_batch"
        )
    else:
        how = "the loss this Trainer backpropagates is not the window's mean"
    return (
        f"{how}: set trainer.{switch} = False (the Trainer then divides each micro-step's loss by the "
        "steps), normalize the model's loss by num_items_in_batch (its reduction: sum / num_items_in_batch), or pass "
        "compute_loss_func= (or override compute_loss) doing so; on several processes, keep "
        "average_tokens_across_devices=True so that the count is the whole window's"
    )


def _weights_fix(trainer: Trainer) -> str:
    """For a window whose micro-batches are weighed unlike the batch weighs their examples."""
    return (
        "the Trainer weighs the window's micro-steps alike (it divides each loss by the steps, unless the loss takes "
        "num_items_in_batch), so a loss that is a mean over its micro-batch's tokens weighs the tokens of a short "
        "micro-batch more than those of a long one: sum the token losses and divide by num_items_in_batch, the "
        "tokens of the whole window that the Trainer counts, in compute_loss_func= (or compute_loss, or a model "
        "whose forward takes **kwargs and uses num_items_in_batch, as the Hugging Face language-model heads do); on "
        "several processes, keep average_tokens_across_devices=True"
    )


def _refuse_a_loader_that_keeps_its_size(trainer: Trainer) -> None:
    """get_train_dataloader() built at another per_device_train_batch_size than the job's (in a
    borrowed Trainer: nothing is changed): a loader whose batch size does not follow the argument
    wrote in a size (the job's own, which comparing at the job's size cannot tell), and every trial
    and the job after tuning would run it."""
    configured = trainer.args.per_device_train_batch_size
    with _borrowed(trainer) as args:
        args.per_device_train_batch_size = configured + 1
        trainer._train_batch_size = args.train_batch_size
        made = loader_batch_size(trainer.get_train_dataloader())
    if made is not None and made != configured + 1:
        raise ConfigError(
            f"tune_trainer: this Trainer's get_train_dataloader() makes batches of {made} with "
            f"per_device_train_batch_size={configured + 1} as with {configured}: it ignores the argument, which is "
            "what autotune sets, so the trials and the job after tuning would run batches of "
            f"{made}: build it with self._train_batch_size, as the Trainer's own does"
        )


@reports_to_the_caller()
def tune_trainer(
    trainer: Trainer,
    effective_batch: EffectiveBatch = None,
    *,
    memory: int | str | None = None,
    headroom: float | int | str | None = None,
    steps: int = 2,
    scan_limit: int = 10_000,
    on_trial: Callable[[TrialRecord], None] | None = None,
    check_gradients: bool = True,
    progress: bool | None = None,
    checkpointing: str | None = None,
) -> ProbeResult:
    """Probe `trainer`'s own loop and set `per_device_train_batch_size` and
    `gradient_accumulation_steps` for the job's effective batch (per_device_train_batch_size x
    gradient_accumulation_steps x world size, as configured), for `effective_batch=N` samples per
    optimizer step, or with `effective_batch="max"` for the largest micro-batch that fits with no
    accumulation. Returns the probe's result (also `trainer.autotune_result`; `result.framework`
    says what was kept and set).

    `memory`/`headroom`: as the CLI's `--memory`/`--headroom` (on a machine without a GPU the probe
    runs on the CPU budget device of `memory` bytes). `check_gradients`: run the gradient check
    when the plan accumulates. `progress`: the live table of trials (default: when stderr is a
    terminal); every trial is logged at INFO either way. `checkpointing`: "auto" probes the Trainer
    without and with `gradient_checkpointing` (every layer recomputed in backward), times each
    plan for the effective batch and keeps the faster that fits, setting `gradient_checkpointing`
    with the batch size and accumulation ("none" or "full" probes that one); None: as configured."""
    started = time.perf_counter()
    if trainer.train_dataset is None:
        raise ConfigError("tune_trainer: the Trainer has no train_dataset: autotune needs its examples")
    model = trainer.model
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("tune_trainer: the Trainer has no model (a model_init is not probed): pass model=")
    args = trainer.args
    if args.world_size > 1:
        raise ConfigError(
            f"tune_trainer runs in one process, and this Trainer has world size {args.world_size}: "
            "every rank would probe alone and could differ; tune in a single process with the same per-device "
            "setup, then pass the values to the distributed run"
        )
    job = JobBatch.of(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size)
    effective, source = planned_effective(effective_batch, job, who="tune_trainer")
    with (
        preserved(model, args.device),
        reporting(logger, f"tuning the Trainer's {type(model).__name__}", show=progress, on_trial=on_trial) as reporter,
    ):
        log_target(logger, effective, source, job)
        loader = trainer.get_train_dataloader()
        made = loader_batch_size(loader)
        if made is not None and made != args.train_batch_size:
            raise ConfigError(
                f"tune_trainer: this Trainer's get_train_dataloader() makes batches of {made} while "
                f"per_device_train_batch_size is {args.per_device_train_batch_size}: autotune sets the argument, "
                "which this loader ignores: build it with self._train_batch_size, as the Trainer's own does"
            )
        _refuse_a_loader_that_keeps_its_size(trainer)
        # The loader's collate function is the Trainer's: its collator, after dropping the columns the
        # model does not take.
        dataset, collate = loader.dataset, loader.collate_fn
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise ConfigError(
                "tune_trainer needs a train_dataset it can index (a map-style Dataset): the probe feeds the Trainer "
                "its worst-case examples again and again"
            )
        worst = worstcase.find_worst_case(dataset, collate, limit=scan_limit)
        workload = Workload(
            build_model=lambda: model,
            make_batch=worstcase.worst_case_maker(dataset, collate, worst),
            loss=lambda model, batch: model(**batch).loss,
            name=f"trainer:{type(model).__name__}",
            optimizer=_TrainerOptimizer(trainer),
            precision=_precision(trainer),  # type: ignore[arg-type]
            input_spec=worst.input_spec(),
            apply_checkpointing=None if checkpointing is None else _model_switch,
        )
        result = probe_workload(
            workload,
            train=trainer_loop(trainer, dataset, worst.indices),
            on_trial=reporter.trial,
            on_progress=reporter.progress,
            device=device_spec(args.device),
            memory=memory,
            headroom=headroom,
            steps=steps,
            effective_batch=effective,
            world_size=args.world_size,
            policy=Policy.EXACT,
            checkpointing=checkpointing,
        )
        if checkpointing is not None:  # the setting the plan was verified with, for the check and the job
            _switch(args, result.workload.checkpointing or "none")
            _model_switch(model, result.workload.checkpointing or "none")
        micro, accumulation = micro_and_accumulation(result)
        check = None
        samples = gradients.JobSamples(dataset, collate)
        if check_gradients and accumulation > 1:
            check = gradients.check_gradients(
                trainer_gradients(trainer, dataset, samples),
                micro=micro,
                steps=accumulation,
                precision=_precision(trainer),
            )
        tuning = tuning_record(
            "transformers",
            job=job,
            effective=effective,
            source=source,
            tuned=(micro, accumulation),
            world_size=args.world_size,
            check=check,
            result=result,
            started=started,
        )
        result = with_tuning(
            result,
            tuning,
            gradients.warning(check, _gradient_fix(trainer), _weights_fix(trainer), samples.described),
        )
        chosen = "" if checkpointing is None else f", {_checkpointing_words(args)}"
        log_outcome(
            reporter,
            result,
            f"set per_device_train_batch_size={micro}, gradient_accumulation_steps={accumulation}{chosen}",
        )
    args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, accumulation
    trainer._train_batch_size = args.train_batch_size
    trainer.autotune_result = result
    return result
