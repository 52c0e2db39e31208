"""Workloads made of a job's live objects: its model, optimizer, data and loss, as the job has them.

`Workload.from_model` builds a Workload from `live_parts`. What it makes of each object:

- the model is used as it is: trials run on it and restore its parameters and buffers afterwards,
  so the job gets it back unchanged;
- an optimizer *instance* is not stepped (its state would change the job): its class is built
  again, fresh, over the same parameters with each param group's hyper-parameters (`fused=True`,
  betas, weight decay per group...); a class is built with `optimizer_kwargs`; a factory is called
  with the parameters;
- the data: a DataLoader (its dataset and collate function) or a Dataset (with `collate`) is
  scanned for its worst-case samples and batches of any size are collated from them
  (`autotune.workloads.worstcase`); anything else is one batch of the job's, whose rows are repeated to make
  any size. Either way the batch is made on the host and copied to the device, which counts the
  batch and not what it was made from;
- the loss: a function of (model, batch), or by default the model's own loss, `model(**batch).loss`
  (a Hugging Face model given labels), as the Trainer takes it.

Live objects cannot be re-created in another process, so they are probed in the calling process
(the trials restore everything) and not confirmed in a fresh one; the result says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autotune.devices.host import on_host
from autotune.errors import WorkloadError

if TYPE_CHECKING:
    from autotune.workloads.workload import OptimizerSpec


class OptimizerCopy:
    """Builds a fresh optimizer of an instance's class over the same parameters and hyper-parameters.

    Param groups are recorded by the position of their parameters in `model.parameters()`, so the
    copy follows the model wherever trials move it."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        position = {id(p): i for i, p in enumerate(model.parameters())}
        self.cls = type(optimizer)
        self.optimizer_name = self.cls.__name__
        self.groups: list[tuple[list[int], dict[str, Any]]] = []
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in position]
            if missing:
                raise WorkloadError(
                    f"the {self.cls.__name__} optimizer holds {len(missing)} parameter(s) that are not the model's: "
                    "pass the optimizer made for this model, or optimizer= a function of the parameters"
                )
            settings = {k: v for k, v in group.items() if k != "params"}
            self.groups.append(([position[id(p)] for p in group["params"]], settings))
        self.defaults = dict(optimizer.defaults)

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        ordered = list(params)
        groups = [{"params": [ordered[i] for i in indices], **settings} for indices, settings in self.groups]
        try:
            return self.cls(groups, **self.defaults)
        except TypeError:
            # Some optimizers keep derived entries in `defaults` that their constructor does not
            # take; the groups carry every hyper-parameter anyway.
            return self.cls(groups)  # type: ignore[call-arg]


def optimizer_spec(optimizer: OptimizerSpec | torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
    # Accelerate's and Lightning's wrappers hold the job's optimizer as `.optimizer`.
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[union-attr]
    if isinstance(optimizer, torch.optim.Optimizer):
        return OptimizerCopy(optimizer, model)
    return optimizer


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss, as the Hugging Face Trainer takes it: `model(**batch)` and its `loss`."""
    try:
        if isinstance(batch, Mapping):
            output = model(**batch)
        elif isinstance(batch, (list, tuple)):
            output = model(*batch)
        else:
            output = model(batch)
    except TypeError as exc:
        raise WorkloadError(
            f"calling the model with the batch failed ({exc}): the default loss calls model(**batch) for a dict, "
            "model(*batch) for a list or tuple; pass loss=lambda model, batch: ... returning the training loss"
        ) from exc
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise WorkloadError(
            f"the model's output ({type(output).__name__}) has no loss: give the batch its labels, or pass "
            "loss=lambda model, batch: ... returning the training loss"
        )
    return loss


def is_dataset(data: Any) -> bool:
    """Whether `data` is a dataset to scan (or a DataLoader), not one batch."""
    if isinstance(data, (torch.utils.data.Dataset, torch.utils.data.DataLoader)):
        return True
    if isinstance(data, (torch.Tensor, Mapping, list, tuple)):
        return False
    # Map-style datasets of other libraries (Hugging Face `datasets`) are not torch Datasets.
    return hasattr(data, "__getitem__") and hasattr(data, "__len__")


def batch_maker(
    data: Any, collate: Callable[[list[Any]], Any] | None, scan_limit: int
) -> tuple[Callable[[int, torch.device], Any], dict[str, str | int | float | bool]]:
    """make_batch(b, device), and the input spec that names the samples and shapes it uses."""
    from autotune.workloads import worstcase

    if is_dataset(data):
        worst = worstcase.find_worst_case(data, collate, limit=scan_limit)
        return worstcase.worst_case_maker(data, collate, worst), worst.input_spec()
    if collate is not None:
        raise WorkloadError("collate= goes with a Dataset; batch= is one batch here, already collated")

    def make_batch(size: int, device: torch.device) -> Any:
        # The rows are repeated on the host, as a loader would collate them; the device holds the batch.
        with on_host():
            rows = worstcase.repeat_batch(data, size)
        return worstcase.to_device(rows, device)

    spec: dict[str, str | int | float | bool] = {"batch": "given, rows repeated"}
    for path, shape in worstcase.field_shapes(data).items():
        # Fields by their keys (a dict batch's `input_ids`), as a dataset's are.
        spec[path if path not in spec else f"shape.{path}"] = "x".join(str(d) for d in shape) or "scalar"
    return make_batch, spec


def live_parts(
    model: nn.Module,
    *,
    batch: Any,
    optimizer: OptimizerSpec | torch.optim.Optimizer,
    loss: Callable[[nn.Module, Any], torch.Tensor] | None,
    collate: Callable[[list[Any]], Any] | None,
    name: str | None,
    scan_limit: int,
) -> dict[str, Any]:
    """The fields of a `Workload` made of a job's live objects (`Workload.from_model` builds it)."""
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    make_batch, spec = batch_maker(batch, collate, scan_limit)
    return {
        "build_model": lambda: model,
        "make_batch": make_batch,
        "loss": loss or model_loss,
        "name": name or type(model).__name__,
        "optimizer": optimizer_spec(optimizer, model),
        "input_spec": spec,
    }
