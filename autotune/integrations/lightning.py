"""PyTorch Lightning: a callback that probes the LightningModule at fit start and sets its batch size
and the trainer's gradient accumulation.

    from autotune.integrations.lightning import AutotuneBatchSize
    trainer = L.Trainer(callbacks=[AutotuneBatchSize()], accumulate_grad_batches=4, ...)
    trainer.fit(model, datamodule=data)  # keeps the effective batch: batch_size x 4 x world size

Like Lightning's `BatchSizeFinder`, it acts in `on_fit_start`. Unlike it, it runs no trial inside the
fit loop: it runs Lightning's automatic-optimization step itself, as the fit loop orders it, on the
unwrapped module, so that under DDP one rank can probe while the others wait (rank 0 probes, every
rank receives its values by broadcast). Per micro-step, as Lightning does it: `training_step` under
the trainer's precision context, the loss divided by the accumulation steps and a detached copy of
it kept until the step ends, `zero_grad` after the forward of a window's first micro-step (so the
forward runs with the last window's gradients alive), backward (scaled for 16-mixed), and the
optimizer step (the first optimizer of `configure_optimizers`) after the window's last micro-step.
The batches are the worst-case samples of the train dataloader, collated by its collate function;
`self.log` is silenced during the probe (its values are a few bytes each).

It sets `batch_arg_name` (default `batch_size`) on the module, its hparams or the datamodule, as
`lightning_setattr` finds it, and `trainer.accumulate_grad_batches`. Lightning's loaders run equal
micro-batches, so plans use the `exact` policy. Manual optimization is the module's own loop: probe it
with `Workload.from_model` instead. Refused, because Lightning would not run the plan: a
`GradientAccumulationScheduler` (it sets the accumulation again at every epoch), a train
dataloader whose first batch is not the `batch_arg_name` attribute's size, and one that, built again
once the plan's values are set, still yields the old size (a `batch_size=16` written into the
DataLoader while the attribute was 16 too): its first batch is read on the host, on every rank, and
the refusal puts the attribute and the accumulation back before the fit's first step.

Lightning's loop holds one micro-batch at a time (a sized loader prefetches nothing), so two
micro-steps stand for any number, and the plan is not searched again in its own number of
micro-steps as the Trainer's is. When the plan accumulates, the gradient check
(`autotune.integrations.gradients`) runs `training_step` over one window and one batch of the same
samples, the train dataloader's own, collated by its collate function: a loss summed over its
samples (Lightning divides it by the steps) is off by 1/steps, and a mean over each micro-batch's
tokens is off as far as the samples' lengths differ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from autotune.engine.probe import device_spec, probe_workload
from autotune.engine.trial import TrainLoop, TrialRunner
from autotune.errors import AutotuneError, ConfigError, ProbeError
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
    valid_effective,
    with_tuning,
    yields_the_plan,
)
from autotune.integrations.reporting import for_the_caller, lightning_frames_cut
from autotune.plans.plan import Policy
from autotune.results import JobBatch, LoopShape, ProbeResult
from autotune.workloads import checkpointing as activation_checkpointing
from autotune.workloads import worstcase
from autotune.workloads.checkpointing import BlocksSpec
from autotune.workloads.workload import Workload

logger = logging.getLogger("autotune.integrations.lightning")

_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


def _loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ConfigError("training_step must return the loss, or a dict with 'loss', for autotune to probe it")
    return loss


def lightning_loop(
    trainer: pl.Trainer, module: pl.LightningModule, make_batch: Callable[[int, torch.device], Any]
) -> Callable[[TrialRunner], TrainLoop]:
    """Lightning's automatic-optimization step, micro-step by micro-step, as a trial loop."""
    precision = trainer.precision_plugin

    def make(runner: TrialRunner) -> TrainLoop:
        device = runner.device.torch_device

        def train(batch: int, loop: LoopShape) -> float:
            optimizers, _schedulers = _init_optimizers_and_lr_schedulers(module)
            optimizer = optimizers[0]
            # A fresh scaler: the job's must not learn its scale from the probe (under DDP, rank 0's
            # would then differ from the others').
            scaler = None if getattr(precision, "scaler", None) is None else torch.amp.GradScaler(device.type)
            data: Any = None
            seconds = 0.0
            for step in range(runner.step_budget(loop)):
                started = time.perf_counter()
                for micro in range(loop.micro_steps):
                    runner.micro_step(batch, loop, step, micro)
                    data = None  # a sized loader prefetches nothing: the last batch is gone first
                    data = make_batch(batch, device)
                    with precision.train_step_context():
                        loss = _loss(module.training_step(data, step * loop.micro_steps + micro))
                    loss = loss / loop.micro_steps
                    kept = loss.detach().clone()  # Lightning's ClosureResult keeps it until the step ends
                    if micro == 0:
                        optimizer.zero_grad()
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    del loss
                    if micro == loop.micro_steps - 1:
                        if scaler is not None:
                            scaler.step(optimizer)
                            scaler.update()
                        else:
                            optimizer.step()
                    del kept
                seconds = (time.perf_counter() - started) / loop.micro_steps
                runner.stepped(batch, step)
                if runner.done(loop):
                    break
            optimizer.zero_grad()
            return seconds

        return train

    return make


def lightning_gradients(
    trainer: pl.Trainer, module: pl.LightningModule, samples: gradients.CheckSamples
) -> gradients.WindowGradients:
    """The gradients Lightning's automatic optimization leaves for one window of `steps`
    micro-batches of `micro` samples (the job's own, as its loader collates them: `samples`): each
    loss divided by the steps."""
    precision = trainer.precision_plugin

    def window(micro: int, steps: int) -> torch.Tensor:
        parts = samples.batches(micro, steps, next(module.parameters()).device)
        try:
            with gradients.same_function(module):
                for i, part in enumerate(parts):
                    with precision.train_step_context():
                        loss = _loss(module.training_step(part, i))
                    (loss / steps).backward()
            return gradients.sampled_gradients(module)
        finally:
            gradients.clear_gradients(module)

    return window


_GRADIENT_FIX = (
    "Lightning divides each micro-step's loss by accumulate_grad_batches, which averages a loss that is a mean over "
    "its micro-batch: return the mean (reduction='mean') from training_step, not a sum"
)
_WEIGHTS_FIX = (
    "Lightning divides every micro-step's loss by accumulate_grad_batches alike, so a loss that is a mean over its "
    "micro-batch's tokens (or over any count that differs between micro-batches) weighs the tokens of a short "
    "micro-batch more than those of a long one: return the sum of the token losses divided by the tokens of the "
    "whole window, or a mean over samples of each sample's token mean (every sample weighs alike), or train in "
    "manual optimization with autotune.accumulate's token weights (count= the batch's tokens, then "
    "step.scale(loss): docs/accumulation.md, token-weighted losses)"
)


class AutotuneBatchSize(pl.Callback):
    """Probe at fit start; set the module's batch size and the trainer's `accumulate_grad_batches`.

    `effective_batch`: samples per optimizer step over all ranks; by default the job's own (the
    train dataloader's batch size x `accumulate_grad_batches` x world size); `"max"`: the largest
    micro-batch that fits, no accumulation. `memory`/`headroom`: as the CLI's (without a GPU the probe
    runs on the CPU budget device of `memory` bytes). `check_gradients`: the gradient check when the
    plan accumulates. `progress`: the live table of trials (default: when stderr is a terminal).
    The result is `self.result` on rank 0 (`result.framework`: what was kept and set)."""

    def __init__(
        self,
        effective_batch: EffectiveBatch = None,
        *,
        memory: int | str | None = None,
        headroom: float | int | str | None = None,
        batch_arg_name: str = "batch_size",
        steps: int = 2,
        scan_limit: int = 10_000,
        check_gradients: bool = True,
        progress: bool | None = None,
        checkpointing: str | None = None,
        checkpoint_blocks: BlocksSpec | None = None,
    ) -> None:
        valid_effective(effective_batch, who="AutotuneBatchSize")
        self.checkpointing, self.checkpoint_blocks = checkpointing, checkpoint_blocks
        self.effective_batch = effective_batch
        self.memory, self.headroom = memory, headroom
        self.batch_arg_name = batch_arg_name
        self.steps, self.scan_limit = steps, scan_limit
        self.check_gradients, self.progress = check_gradients, progress
        self.result: ProbeResult | None = None
        self.values: tuple[int, int] | None = None
        self._failure: BaseException | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # What this callback raised leaves fit through Lightning's frames: cut them (and ours).
        if exception is self._failure or isinstance(exception, AutotuneError):
            lightning_frames_cut(exception)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(
                f"AutotuneBatchSize: neither the module, its hparams nor the datamodule has {self.batch_arg_name!r}: "
                "give batch_arg_name= the attribute your train_dataloader reads"
            )
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "AutotuneBatchSize probes Lightning's automatic optimization; with manual optimization the loop is "
                "yours: probe it with Workload.from_model"
            )
        schedule = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)  # type: ignore[attr-defined]
        if schedule is not None or not isinstance(trainer.accumulate_grad_batches, int):
            scheduling = schedule.scheduling if schedule is not None else trainer.accumulate_grad_batches
            raise ConfigError(
                f"AutotuneBatchSize sets one accumulation for the whole fit, and this trainer changes it by epoch "
                f"({scheduling}): remove the GradientAccumulationScheduler and give "
                "Trainer(accumulate_grad_batches=N), or tune each phase's effective batch in a fit of its own"
            )
        values: tuple[int, int] | str | None = None
        failure: Exception | None = None
        if trainer.global_rank == 0:
            try:
                values = self._probe(trainer, pl_module)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
                failure, values = exc, f"{type(exc).__name__}: {exc}"
        # One rank probes; every rank must run the same micro-batches and accumulation, and every
        # rank must stop when the probe failed rather than wait in a collective.
        values = trainer.strategy.broadcast(values, src=0)
        if failure is not None:
            # Raised as the user reads it: the job's own error with their frames, or ours, short.
            self._failure = for_the_caller(failure) if isinstance(failure, AutotuneError) else failure
            raise self._failure
        if not isinstance(values, tuple):
            raise ProbeError(f"AutotuneBatchSize: the probe on rank 0 failed: {values}")
        micro, accumulation = values
        before = lightning_getattr(pl_module, self.batch_arg_name), trainer.accumulate_grad_batches
        lightning_setattr(pl_module, self.batch_arg_name, micro)
        trainer.accumulate_grad_batches = accumulation
        refusal = self._loader_refusal(trainer, micro, accumulation, before[0])
        if refusal is not None:
            # Put back as it was: the fit stops here, and the job keeps what it was configured with.
            lightning_setattr(pl_module, self.batch_arg_name, before[0])
            trainer.accumulate_grad_batches = before[1]
            self._failure = for_the_caller(refusal)
            raise self._failure
        self.values = values
        # A loader built before this point has the old batch size: build it again.
        trainer.fit_loop._combined_loader = None

    def _loader_refusal(self, trainer: pl.Trainer, micro: int, accumulation: int, old: Any) -> ConfigError | None:
        """The train dataloader built again with the new batch size, its first batch read on the host:
        a refusal when it is not the plan's micro-batch (the loader does not read the attribute). On
        every rank: each builds its own loader, and each stops when it would run another batch."""
        loader = trainer.fit_loop._data_source.dataloader()
        yielded = first_batch_size(loader)
        if yielded is None:
            yielded = loader_batch_size(loader)
        if yielded is None or yields_the_plan(yielded, micro, loader):
            return None
        name = self.batch_arg_name
        world = trainer.world_size
        ran = f"{yielded} x {accumulation} x {world} = {yielded * accumulation * world}"
        planned = f"{micro * accumulation * world}"
        sampler = custom_batch_sampler(loader)
        if not trainer.fit_loop._data_source.is_module():
            how = (
                "it was given to fit() as an object, which is not built again: return it from the module's (or a "
                f"LightningDataModule's) train_dataloader(), built with batch_size=self.{name}"
            )
        elif sampler is not None:
            how = (
                f"its batch_sampler ({sampler}) makes batches of {yielded} whatever {name!r} is: build the "
                f"batch_sampler from self.{name} in train_dataloader (or DataLoader(dataset, batch_size=self.{name}))"
            )
        else:
            how = (
                f"it makes batches of {yielded} whatever {name!r} is (a batch_size written into the DataLoader?): "
                f"build it with batch_size=self.{name}"
            )
        return ConfigError(
            f"AutotuneBatchSize set {name}={micro} (it was {old}) and accumulate_grad_batches={accumulation}, and the "
            f"train dataloader built again yields batches of {yielded}: Lightning would run {ran} samples per "
            f"optimizer step, not {planned}; {how} (or give batch_arg_name= the attribute it reads). Nothing was "
            f"changed: {name} and accumulate_grad_batches are as they were"
        )

    def _probe(self, trainer: pl.Trainer, module: pl.LightningModule) -> tuple[int, int]:
        started = time.perf_counter()
        loader = trainer.fit_loop._data_source.dataloader()
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise ConfigError("AutotuneBatchSize needs one train DataLoader (not a collection of loaders)")
        # The batch the loader really yields (a batch_sampler need not say its size), else the one it declares.
        made = first_batch_size(loader) or loader_batch_size(loader)
        attribute = lightning_getattr(module, self.batch_arg_name)
        reads_it = made is not None and isinstance(attribute, int) and yields_the_plan(made, attribute, loader)
        if made is None or not reads_it:
            batches = "batches that cannot be counted" if made is None else f"batches of {made}"
            sampler = custom_batch_sampler(loader)
            build = (
                f"build its batch_sampler ({sampler}) from self.{self.batch_arg_name}"
                if sampler is not None
                else f"build the DataLoader with batch_size=self.{self.batch_arg_name}"
            )
            raise ConfigError(
                f"AutotuneBatchSize sets {self.batch_arg_name!r} ({attribute}), and the train dataloader has "
                f"{batches}: Lightning would not run the plan's micro-batch; {build} (or give batch_arg_name= the "
                "attribute it reads)"
            )
        job = JobBatch.of(made, trainer.accumulate_grad_batches, trainer.world_size)
        effective, source = planned_effective(self.effective_batch, job, who="AutotuneBatchSize")
        with (
            preserved(module, trainer.strategy.root_device),
            reporting(logger, f"tuning {type(module).__name__}", show=self.progress) as reporter,
        ):
            log_target(logger, effective, source, job)
            worst = worstcase.find_worst_case(loader, limit=self.scan_limit)
            make_batch = worstcase.worst_case_maker(loader, worst=worst)

            def configured(params: Any) -> torch.optim.Optimizer:
                return _init_optimizers_and_lr_schedulers(module)[0][0]

            # The optimizer's name in results: what configure_optimizers returns.
            setattr(configured, "optimizer_name", type(configured(None)).__name__)  # noqa: B010
            precision = _PRECISION.get(str(trainer.precision), "fp32")
            workload = Workload(
                build_model=lambda: module,
                make_batch=make_batch,
                loss=lambda model, batch: _loss(module.training_step(batch, 0)),
                name=f"lightning:{type(module).__name__}",
                optimizer=configured,
                precision=precision,  # type: ignore[arg-type]
                input_spec=worst.input_spec(),
                checkpoint_blocks=self.checkpoint_blocks,
            )

            def silent(*args: Any, **kwargs: Any) -> None:
                """self.log outside Lightning's loop has no result collection to write to."""

            module.log = module.log_dict = silent  # type: ignore[method-assign]
            try:
                result = probe_workload(
                    workload,
                    train=lightning_loop(trainer, module, make_batch),
                    holds_window=False,
                    on_trial=reporter.trial,
                    on_progress=reporter.progress,
                    device=device_spec(trainer.strategy.root_device),
                    memory=self.memory,
                    headroom=self.headroom,
                    steps=self.steps,
                    effective_batch=effective,
                    world_size=trainer.world_size,
                    policy=Policy.EXACT,
                    checkpointing=self.checkpointing,
                )
                if self.checkpointing is not None:  # the fit runs with the setting its plan was verified with
                    setting = result.workload.checkpointing or "none"
                    activation_checkpointing.apply(module, setting, self.checkpoint_blocks)
                micro, accumulation = micro_and_accumulation(result)
                check = None
                samples: gradients.CheckSamples = gradients.JobSamples.of_loader(loader) or gradients.RowsOf(
                    make_batch, "worst-case samples: the loader has automatic batching off"
                )
                if self.check_gradients and accumulation > 1:
                    check = gradients.check_gradients(
                        lightning_gradients(trainer, module, samples),
                        micro=micro,
                        steps=accumulation,
                        precision=precision,
                    )
            finally:
                del module.log, module.log_dict
            tuning = tuning_record(
                "lightning",
                job=job,
                effective=effective,
                source=source,
                tuned=(micro, accumulation),
                world_size=trainer.world_size,
                check=check,
                result=result,
                started=started,
            )
            result = with_tuning(
                result, tuning, gradients.warning(check, _GRADIENT_FIX, _WEIGHTS_FIX, samples.described)
            )
            log_outcome(
                reporter, result, f"set {self.batch_arg_name}={micro}, trainer.accumulate_grad_batches={accumulation}"
            )
        self.result = result
        return micro, accumulation
