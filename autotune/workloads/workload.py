"""Workloads: what a trial runs. A model factory, a batch at its worst-case shape, a loss,
an optimizer and a precision.

Users define one in Python and point the CLI at it as `module:attribute`:

    from autotune import Workload

    workload = Workload(
        name="my-model",
        build_model=lambda: MyModel(),
        make_batch=lambda b, device: torch.randn(b, 3, 224, 224, device=device),
        loss=lambda model, batch: model(batch).logsumexp(-1).mean(),
        optimizer="adamw",
    )

The attribute may also be a function that takes keyword options and returns a Workload.

A job's live objects make one too, with no module to import (`Workload.from_model`): its model, its
optimizer (a class, a factory or an instance), its data (one batch, a Dataset with its collate
function, or a DataLoader: the worst-case samples are found and collated) and its loss. Such a
workload is probed in the calling process (`run_probe(request, workload=...)`): a fresh process
cannot re-create live objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from autotune.errors import AutotuneError, WorkloadError
from autotune.request import OptionValue, parse_checkpointing
from autotune.request import parse_options as parse_options  # torch-free there; re-exported
from autotune.results import ParallelSpec
from autotune.workloads import checkpointing as activation_checkpointing
from autotune.workloads.checkpointing import BlocksSpec
from autotune.workloads.live import live_parts

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# A name from OPTIMIZERS, an Optimizer class (built with `optimizer_kwargs`), or a factory of the
# parameters (what `from_model` makes of an optimizer instance).
OptimizerSpec = str | type[torch.optim.Optimizer] | OptimizerFactory


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"  # bf16 autocast, fp32 master weights
    FP16 = "fp16"  # fp16 autocast with a GradScaler


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


@dataclass(frozen=True)
class Workload:
    """One training job's step, reduced to what determines its memory."""

    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    name: str = "custom"
    optimizer: OptimizerSpec = "adamw"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    precision: Precision = Precision.FP32
    # Shapes and sizes that the batch depends on (sequence length, image size...): part of the
    # fingerprint, because memory depends on them but a model's structure does not show them.
    input_spec: Mapping[str, OptionValue] = field(default_factory=dict)
    # How the job runs the model across ranks (autotune.parallel); set from the probe request.
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    # Under --parallel fsdp, the job's own sharding: called with the model (on the device) and the
    # job's device mesh, it applies `fully_shard` as the job does (its blocks, reshard_after_forward,
    # mp_policy). None: autotune.parallel.fsdp.shard (per block, then the root).
    shard: Callable[[nn.Module, Any], Any] | None = None
    # Activation checkpointing of the model's repeated blocks: none, full or every=K (every K-th
    # block), applied with torch.utils.checkpoint (non-reentrant) when the trial builds the model
    # (`autotune.workloads.checkpointing`); in the fingerprint unless none.
    checkpointing: str = "none"
    # The blocks: the attribute path of a ModuleList/Sequential of them ("model.layers") or a function
    # of the model returning them. None: found (the largest ModuleList/Sequential of one class).
    checkpoint_blocks: BlocksSpec | None = None
    # The job's own switch instead of autotune's block wrapping, called with the model and the
    # setting (the Trainer's gradient_checkpointing); None: autotune.workloads.checkpointing.apply.
    apply_checkpointing: Callable[[nn.Module, str], None] | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "checkpointing", parse_checkpointing(str(self.checkpointing)))
        except AutotuneError as exc:
            raise WorkloadError(str(exc)) from None
        if isinstance(self.optimizer, str):
            if self.optimizer.lower() not in OPTIMIZERS:
                raise WorkloadError(f"unknown optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
            object.__setattr__(self, "optimizer", self.optimizer.lower())
        elif not callable(self.optimizer):
            raise WorkloadError(
                f"optimizer {self.optimizer!r} is neither a name ({', '.join(OPTIMIZERS)}), an Optimizer class "
                "nor a function of the parameters returning an optimizer"
            )
        if self.shard is not None and not callable(self.shard):
            raise WorkloadError(
                f"shard {self.shard!r} is not a function: give one of (model, mesh) that calls fully_shard, or None"
            )
        try:
            object.__setattr__(self, "precision", Precision(self.precision))
        except ValueError:
            choices = ", ".join(p.value for p in Precision)
            raise WorkloadError(f"unknown precision {self.precision!r}: choose one of {choices}") from None

    @property
    def optimizer_name(self) -> str:
        """The optimizer as results name it: its name, or its class's (`FusedAdam`, `Lion`...)."""
        spec = self.optimizer
        if isinstance(spec, str):
            return spec
        return str(getattr(spec, "optimizer_name", None) or getattr(spec, "__name__", type(spec).__name__))

    def with_overrides(self, *, precision: str | None = None, optimizer: str | None = None) -> Workload:
        changes: dict[str, Any] = {}
        if precision is not None:
            changes["precision"] = precision
        if optimizer is not None and optimizer.lower() != self.optimizer_name:
            changes["optimizer"] = optimizer
            changes["optimizer_kwargs"] = {}
        return dataclasses.replace(self, **changes) if changes else self

    def with_checkpointing(self, setting: str | None) -> Workload:
        """This workload with activation checkpointing `setting` (none, full, every=K); None: as it is."""
        if setting is None:
            return self
        changed = dataclasses.replace(self, checkpointing=setting)  # a WorkloadError for a bad setting
        return self if changed.checkpointing == self.checkpointing else changed

    def checkpoint(self, model: nn.Module) -> None:
        """Apply this workload's checkpointing setting to `model` (its repeated blocks, or the job's own
        switch); `none` on a model autotune never wrapped does nothing."""
        if self.apply_checkpointing is not None:
            self.apply_checkpointing(model, self.checkpointing)
        elif self.checkpointing != "none" or activation_checkpointing.applied(model):
            activation_checkpointing.apply(model, self.checkpointing, self.checkpoint_blocks)

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        spec = self.optimizer
        kwargs = dict(self.optimizer_kwargs)
        if isinstance(spec, str):
            if spec == "sgd":
                kwargs.setdefault("lr", 1e-3)
            return OPTIMIZERS[spec](params, **kwargs)
        if isinstance(spec, type):
            return spec(params, **kwargs)
        made = spec(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise WorkloadError(
                f"the optimizer factory of {self.name!r} returned {type(made).__name__}, not an Optimizer"
            )
        return made

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        *,
        batch: Any,
        optimizer: OptimizerSpec | torch.optim.Optimizer = "adamw",
        loss: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        precision: Precision | str = Precision.FP32,
        name: str | None = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        scan_limit: int = 10_000,
    ) -> Workload:
        """A workload of a job's live objects, probed as they are (see `autotune.workloads.live`)."""
        parts = live_parts(
            model, batch=batch, optimizer=optimizer, loss=loss, collate=collate, name=name, scan_limit=scan_limit
        )
        return cls(**parts, optimizer_kwargs=dict(optimizer_kwargs or {}), precision=precision)  # type: ignore[arg-type]
