"""The Hugging Face Trainer: probe its own `train()` and set its batch size and accumulation.

    from autotune.integrations.transformers import tune_trainer
    tune_trainer(trainer, effective_batch=64)
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
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import DefaultFlowCallback, Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from autotune.engine.probe import device_spec, probe_workload
from autotune.engine.trial import TrainLoop, TrialRunner
from autotune.errors import ConfigError
from autotune.integrations import micro_and_accumulation
from autotune.plans.plan import Policy
from autotune.results import LoopShape, ProbeResult, TrialRecord
from autotune.workloads import worstcase
from autotune.workloads.live import OptimizerCopy
from autotune.workloads.workload import Workload


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
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.trainer.args, self.trainer.model)  # type: ignore[arg-type]
        made: torch.optim.Optimizer = cls(params, **kwargs)
        return made


def _precision(trainer: Trainer) -> str:
    return "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else "fp32"


class _Settling(TrainerCallback):
    """Each optimizer step of the Trainer's loop reported to the runner, and the loop stopped once
    the caching allocator settled (the runner's rule, as in autotune's own loop)."""

    def __init__(self, runner: TrialRunner, batch: int, loop: LoopShape) -> None:
        self.runner, self.batch, self.loop = runner, batch, loop

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.runner.stepped(self.batch, state.global_step - 1)
        if self.runner.done(self.loop):
            control.should_training_stop = True
        return control


def trainer_loop(trainer: Trainer, dataset: Any, indices: tuple[int, ...]) -> Callable[[TrialRunner], TrainLoop]:
    """The Trainer's own `train()` as a trial loop over the worst-case examples."""
    given = None if trainer.optimizer is None else OptimizerCopy(trainer.optimizer, trainer.model)  # type: ignore[arg-type]

    def make(runner: TrialRunner) -> TrainLoop:
        def train(batch: int, loop: LoopShape) -> float:
            saved = dict(vars(trainer))
            handler = trainer.callback_handler
            saved_handler = dict(vars(handler))
            args = copy.copy(trainer.args)
            args.per_device_train_batch_size = batch
            args.gradient_accumulation_steps = loop.micro_steps
            budget = runner.step_budget(loop)
            args.max_steps = budget
            args.save_strategy, args.eval_strategy = SaveStrategy.NO, IntervalStrategy.NO
            args.logging_strategy, args.eval_on_start = IntervalStrategy.NO, False
            args.load_best_model_at_end, args.push_to_hub, args.auto_find_batch_size = False, False, False
            args.disable_tqdm = True
            try:
                trainer.args = args
                trainer._train_batch_size = args.train_batch_size
                per_step = args.train_batch_size * loop.micro_steps * args.world_size
                trainer.train_dataset = _Repeated(dataset, indices, per_step * budget)
                handler.callbacks = [DefaultFlowCallback(), _Settling(runner, batch, loop)]
                # A given optimizer and scheduler must not be stepped: each trial gets a fresh copy
                # of the optimizer, and the Trainer's own scheduler (no memory to speak of).
                trainer.optimizer = None if given is None else given(runner.model.parameters())
                trainer.lr_scheduler = None
                output = trainer.train()
                ran = max(runner.steps_run, 1)
                seconds = float(output.metrics.get("train_runtime", 0.0)) / (ran * loop.micro_steps)
            finally:
                # The accelerator keeps the trial's prepared optimizer (and its state) until the
                # next train(); the job's own train() must start from nothing of the probe's.
                trainer.accelerator.free_memory()
                vars(trainer).clear()
                vars(trainer).update(saved)
                vars(handler).clear()
                vars(handler).update(saved_handler)
            return seconds

        return train

    return make


def tune_trainer(
    trainer: Trainer,
    effective_batch: int | None = None,
    *,
    memory: int | str | None = None,
    headroom: float | int | str | None = None,
    steps: int = 2,
    scan_limit: int = 10_000,
    on_trial: Callable[[TrialRecord], None] | None = None,
) -> ProbeResult:
    """Probe `trainer`'s own loop and set `per_device_train_batch_size` and
    `gradient_accumulation_steps` for `effective_batch` (by default: the largest micro-batch that
    fits, no accumulation). Returns the probe's result (also `trainer.autotune_result`).

    `memory`/`headroom`: as the CLI's `--memory`/`--headroom` (on a machine without a GPU the probe
    runs on the CPU budget device of `memory` bytes)."""
    if trainer.train_dataset is None:
        raise ConfigError("tune_trainer: the Trainer has no train_dataset: autotune needs its examples")
    model = trainer.model
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("tune_trainer: the Trainer has no model (a model_init is not probed): pass model=")
    if trainer.args.world_size > 1:
        raise ConfigError(
            f"tune_trainer runs in one process, and this Trainer has world size {trainer.args.world_size}: "
            "every rank would probe alone and could differ; tune in a single process with the same per-device "
            "setup, then pass the values to the distributed run"
        )
    loader = trainer.get_train_dataloader()
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
    )
    args = trainer.args
    result = probe_workload(
        workload,
        train=trainer_loop(trainer, dataset, worst.indices),
        on_trial=on_trial,
        device=device_spec(trainer.args.device),
        memory=memory,
        headroom=headroom,
        steps=steps,
        effective_batch=effective_batch,
        world_size=args.world_size,
        policy=Policy.EXACT,
    )
    args.per_device_train_batch_size, args.gradient_accumulation_steps = micro_and_accumulation(result)
    trainer._train_batch_size = args.train_batch_size
    trainer.autotune_result = result  # type: ignore[attr-defined]
    return result
