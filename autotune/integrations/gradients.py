"""The gradient check: does one accumulation window train like one batch of the same samples?

A framework accumulates by scaling each micro-step's loss: Lightning and Accelerate divide it by the
accumulation steps, and the Trainer divides it too, unless the model takes `num_items_in_batch`
(then the model is trusted to normalize by the window's count). Whether the window's summed
gradients are the effective batch's gradient depends on the loss: a classification head that takes
`**kwargs` but ignores `num_items_in_batch` gets no division in the Trainer (8 micro-steps gave 8x
the gradient), and a loss summed over its samples gets 1/steps of it under Lightning or Accelerate.
Either way the plan's accumulation trains at another learning rate, and nothing fails.

So, after the probe, when the plan accumulates, the integration runs the framework's own step over
one window of the plan's accumulation steps, each a micro-batch of `CHECK_MICRO_BATCH` samples, and
over one batch of the same samples, with every forward in eval mode (no dropout, BatchNorm on its
running statistics: both runs compute the same function) and no optimizer step, on the job's
device, outside the probe's counting. It compares the two gradients (a strided sample of at most
`SAMPLED` elements, in float64 on the host): `factor` is the ratio of their norms, `difference` the
norm of their difference over the batch's; beyond `TOLERANCE` at the job's precision the plan gets a
warning with the factor and the framework's fix. It costs one forward and backward of 2 x steps
samples, twice. `check_gradients=False` skips it.
"""

from __future__ import annotations

import copy
import math
import time
from collections import UserDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from autotune.results import GradientCheck
from autotune.workloads import usercode

CHECK_MICRO_BATCH = 2
SAMPLED = 1 << 20
# A window and a batch of the same samples differ by float rounding only: summation order in fp32,
# and the half-precision rounding of activations under autocast.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}

# (micro-batch, accumulation steps) -> the gradients the framework's step left for that window
WindowGradients = Callable[[int, int], torch.Tensor]


def sampled_gradients(model: nn.Module) -> torch.Tensor:
    """Every trainable parameter's gradient (zeros where it has none), strided to at most SAMPLED
    elements in all, in float64 on the host: the same positions for every call on one model."""
    params = [p for p in model.parameters() if p.requires_grad]
    stride = max(1, -(-sum(p.numel() for p in params) // SAMPLED))
    parts = []
    for p in params:
        if p.grad is None:
            parts.append(torch.zeros(len(range(0, p.numel(), stride)), dtype=torch.float64))
        else:
            parts.append(p.grad.detach().flatten()[::stride].to("cpu", torch.float64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def clear_gradients(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


@contextmanager
def same_function(model: nn.Module) -> Iterator[None]:
    """Every forward of `model` in eval mode, whoever put it in train mode before (the Trainer
    does, at each step): no dropout mask differs between the window and the batch. The caller
    restores the modes (`autotune.integrations.job.preserved`)."""

    def evaluating(module: nn.Module, args: Any) -> None:
        module.eval()

    model.eval()
    handle = model.register_forward_pre_hook(evaluating)
    try:
        yield
    finally:
        handle.remove()


def rows(batch: Any, start: int, stop: int, total: int) -> Any:
    """Rows start:stop of every tensor in `batch` whose first dimension is `total`; the rest as is."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == total:
            return value[start:stop]
        return value

    if isinstance(batch, UserDict):  # BatchEncoding: pytree does not open it
        clone = copy.copy(batch)
        clone.data = {key: rows(item, start, stop, total) for key, item in batch.items()}
        return clone
    return _pytree.tree_map(cut, batch)


def check_gradients(window: WindowGradients, *, micro: int, steps: int, precision: str) -> GradientCheck:
    """Run the window and the whole batch through `window` and compare their gradients, with
    micro-batches of the plan's `micro` samples or CHECK_MICRO_BATCH, whichever is fewer."""
    started = time.perf_counter()
    micro = min(CHECK_MICRO_BATCH, micro)
    tolerance = TOLERANCE.get(precision, TOLERANCE["fp32"])
    fields: dict[str, Any] = {"micro_batch": micro, "accumulation_steps": steps, "tolerance": tolerance}
    try:
        accumulated = window(micro, steps)
        whole = window(micro * steps, 1)
    except Exception as exc:  # noqa: BLE001 - the tune's answer stands; the check says it could not run
        return GradientCheck(
            **fields, equivalent=None, seconds=time.perf_counter() - started, error=usercode.describe(exc)
        )
    norm = whole.norm().item()
    if not math.isfinite(norm) or norm == 0.0:
        return GradientCheck(
            **fields,
            equivalent=None,
            seconds=time.perf_counter() - started,
            error=f"the batch's gradient norm is {norm}: nothing to compare with",
        )
    factor = accumulated.norm().item() / norm
    difference = (accumulated - whole).norm().item() / norm
    return GradientCheck(
        **fields,
        factor=factor,
        difference=difference,
        equivalent=difference <= tolerance,
        seconds=time.perf_counter() - started,
    )


def warning(check: GradientCheck | None, fix: str) -> str | None:
    """The plan's warning for a check that failed or could not run, naming `fix`; None when it passed."""
    if check is None or check.equivalent:
        return None
    if check.error is not None:
        return (
            f"the gradient check could not run ({check.error}): whether one accumulation window trains like the "
            "effective batch is unchecked"
        )
    samples = check.micro_batch * check.accumulation_steps
    return (
        f"accumulation does not train like the effective batch: one window of {check.accumulation_steps} "
        f"micro-batches of {check.micro_batch} gave {check.factor:.2f}x the gradient of one batch of the same "
        f"{samples} samples (they differ by {check.difference:.1%}); {fix}"
    )
