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
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from autotune.errors import AutotuneError, WorkloadError
from autotune.request import OptionValue
from autotune.request import parse_options as parse_options  # torch-free there; re-exported
from autotune.results import ParallelSpec
from autotune.usercode import attach, describe, where

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

    def __post_init__(self) -> None:
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
        """A workload of a job's live objects, probed as they are (see `autotune.live`)."""
        from autotune.live import workload_from_model

        return workload_from_model(
            model,
            batch=batch,
            optimizer=optimizer,
            loss=loss,
            collate=collate,
            precision=precision,
            name=name,
            optimizer_kwargs=optimizer_kwargs,
            scan_limit=scan_limit,
        )


def _import_attribute(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise WorkloadError(
            f"target {target!r} is neither a built-in example nor module:attribute (for example mypkg.train:workload)"
        )
    # Like uvicorn's --app-dir default: `autotune probe mypkg.train:workload` run from a project
    # directory finds mypkg there even though console scripts do not put the cwd on sys.path.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        at = where(exc)
        raise attach(
            WorkloadError(
                f"cannot import module {module_name!r} for target {target!r}: {exc}" + (f" (at {at})" if at else "")
            ),
            exc,
        ) from None
    except SystemExit as exc:  # sys.exit() at import: a script's main part run without a __main__ guard
        raise attach(
            WorkloadError(
                f"importing {module_name!r} for target {target!r} exited with code {exc.code!r}"
                + (f" (at {where(exc)})" if where(exc) else "")
                + ": a workload's module must not exit on import; put its script part under "
                "`if __name__ == '__main__':`"
            ),
            exc,
        ) from None
    except Exception as exc:  # noqa: BLE001 - user code may raise anything at import time
        raise attach(
            WorkloadError(f"importing {module_name!r} for target {target!r} failed: {describe(exc)}"), exc
        ) from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise WorkloadError(f"module {module_name!r} has no attribute {attribute!r}") from None
    return obj


def resolve(target: str, options: Mapping[str, OptionValue] | None = None) -> Workload:
    """Turn a CLI/service target into a Workload: a built-in example name or module:attribute."""
    from autotune import examples

    options = dict(options or {})
    if ":" not in target:
        factory = examples.EXAMPLES.get(target)
        if factory is None:
            names = ", ".join(sorted(examples.EXAMPLES))
            raise WorkloadError(f"unknown workload {target!r}: use a built-in example ({names}) or module:attribute")
        return _call_factory(factory, options, target)
    obj = _import_attribute(target)
    if isinstance(obj, Workload):
        if options:
            raise WorkloadError(
                f"{target} is a Workload instance and takes no options; make it a function "
                f"that takes keyword options to pass {sorted(options)}"
            )
        return obj
    if callable(obj):
        return _call_factory(obj, options, target)
    raise WorkloadError(f"{target} is a {type(obj).__name__}, not a Workload or a function returning one")


def _arguments(options: Mapping[str, OptionValue]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


def _call_factory(factory: Callable[..., Any], options: dict[str, OptionValue], target: str) -> Workload:
    try:
        workload = factory(**options)
    except AutotuneError:  # a WorkloadError of its own (an unknown optimizer name): already says what
        raise
    except TypeError as exc:
        if where(exc) is None or exc.__traceback__ is None or exc.__traceback__.tb_next is None:
            # Raised by the call itself: the options do not match the factory's parameters.
            raise WorkloadError(f"bad options {options} for {target}: {exc}") from None
        raise attach(WorkloadError(f"{target}({_arguments(options)}) failed: {describe(exc)}"), exc) from None
    except SystemExit as exc:
        raise attach(
            WorkloadError(
                f"{target}({_arguments(options)}) exited with code {exc.code!r}"
                + (f" (at {where(exc)})" if where(exc) else "")
                + ": a workload factory must return a Workload, not exit"
            ),
            exc,
        ) from None
    except Exception as exc:  # noqa: BLE001 - the user's factory may raise anything
        raise attach(WorkloadError(f"{target}({_arguments(options)}) failed: {describe(exc)}"), exc) from None
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{target} returned {type(workload).__name__}, not a Workload")
    return workload
