"""The gradient check: does one accumulation window train like one batch of the same samples?

A framework accumulates by scaling each micro-step's loss: Lightning and Accelerate divide it by the
accumulation steps, and the Trainer divides it too, unless the model takes `num_items_in_batch`
(then the model is trusted to normalize by the window's count). Whether the window's summed
gradients are the effective batch's gradient depends on the loss: a classification head that takes
`**kwargs` but ignores `num_items_in_batch` gets no division in the Trainer (8 micro-steps gave 8x
the gradient), and a loss summed over its samples gets 1/steps of it under Lightning or Accelerate.
Either way the plan's accumulation trains at another learning rate, and nothing fails.

A framework also weighs every micro-step alike, so a loss that is a mean over each micro-batch's
tokens (a language model's cross-entropy with ignore_index padding) weighs a short micro-batch's
tokens more than a long one's: on sequences of unequal lengths the window is not the batch, while on
samples of one length it is. So the window is made of the job's own samples (`JobSamples`): picked
from its first `CHECK_SCAN`, from the smallest to the largest and in that order, each micro-batch
collated by the job's collate function as its loader collates it. The worst case's (or the given
batch's) rows only where the job has no samples to read (`RowsOf`).

So, after the probe, when the plan accumulates, the integration runs the framework's own step over
one window of the plan's accumulation steps, each a micro-batch of `CHECK_MICRO_BATCH` samples, and
over one batch of the same samples, with every forward in eval mode (no dropout, BatchNorm on its
running statistics: both runs compute the same function) and no optimizer step, on the job's
device, outside the probe's counting. It compares the two gradients (a strided sample of at most
`SAMPLED` elements, in float64 on the host): `factor` is the ratio of their norms, `difference` the
norm of their difference over the batch's; beyond `TOLERANCE` at the job's precision the plan gets a
warning with what was measured and the framework's fix: for a window off by a factor (a sum, a
division missing) or for one weighed otherwise (a token mean), which `scaled_only` tells apart. It
costs collating up to `CHECK_SCAN` samples alone, then one forward and backward of 2 x steps
samples, twice (about 1 s for docs/frameworks.md's Trainer example on a CPU, whose two runs are
`train()`'s). `check_gradients=False` skips it.
"""

from __future__ import annotations

import copy
import math
import time
from collections import UserDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import _pytree
from torch.utils.data import DataLoader, IterableDataset, default_collate

from autotune.devices.host import on_host
from autotune.errors import WorkloadError
from autotune.results import GradientCheck
from autotune.workloads import usercode, worstcase

CHECK_MICRO_BATCH = 2
# The window's samples are picked from at least this many of the job's first samples (each collated
# alone to measure it), so that its micro-batches differ in size where the job's samples do.
CHECK_SCAN = 64
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


# The samples of a window --------------------------------------------------------------------------
class CheckSamples(Protocol):
    """Where a window's micro-batches come from: `batches(micro, steps, device)` is `steps` batches of
    `micro` samples each, on `device`, cut from the same `micro * steps` samples whatever the split (so
    that the window and the one batch hold the same samples); `described` says which samples."""

    described: str

    def batches(self, micro: int, steps: int, device: torch.device) -> list[Any]: ...


class JobSamples:
    """The job's own samples, collated by its own collate function as its loader collates them: each
    micro-batch on its own (padded to its own longest), the one batch of all of them at once.

    The `count` samples of a window are picked from the first max(CHECK_SCAN, count) samples of the
    dataset (its first items, for an iterable one), each collated alone and measured (elements in
    all): an even spread from the smallest to the largest, in that order, so that the window's first
    micro-batch holds the shortest samples and its last the longest, as a length-grouped sampler would
    make them. A loss that weighs its micro-batches by something that differs between them (a mean
    over each micro-batch's tokens) is then as far from the batch's as the job's data can make it;
    samples all of one size make micro-batches of one size. A dataset with fewer samples than the
    window repeats them."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.collate = collate if collate is not None else default_collate
        self.described = "the job's samples"
        self._chosen: list[tuple[int, Any]] = []

    @classmethod
    def of_loader(cls, loader: Any) -> JobSamples | None:
        """A DataLoader's dataset and collate function; None when it has automatic batching off (its
        collate function converts single items and cannot make a micro-batch)."""
        if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
            return None
        return cls(loader.dataset, loader.collate_fn)

    def _first(self, count: int) -> list[tuple[int, Any]]:
        if isinstance(self.dataset, IterableDataset) or not hasattr(self.dataset, "__getitem__"):
            return list(enumerate(islice(iter(self.dataset), count)))
        return [(i, self.dataset[i]) for i in range(min(count, len(self.dataset)))]

    def chosen(self, count: int) -> list[tuple[int, Any]]:
        """(dataset index, sample) of the window's `count` samples, smallest first."""
        if len(self._chosen) == count:
            return self._chosen
        scanned = self._first(max(CHECK_SCAN, count))
        if not scanned:
            raise WorkloadError("the dataset is empty: there is no sample to check the gradients on")
        with on_host():
            sized = sorted(
                ((_elements(self.collate([sample])), i, sample) for i, sample in scanned), key=lambda s: (s[0], s[1])
            )
        n = len(sized)
        if n >= count:
            picks = [round(j * (n - 1) / (count - 1)) for j in range(count)] if count > 1 else [n - 1]
        else:
            picks = sorted(j % n for j in range(count))
        self._chosen = [(sized[p][1], sized[p][2]) for p in picks]
        smallest, largest = sized[picks[0]][0], sized[picks[-1]][0]
        spread = (
            f"from the smallest to the largest: {smallest} to {largest} elements, each collated alone"
            if smallest != largest
            else "all of one size"
        )
        self.described = f"{count} of the job's first {n} samples, {spread}"
        return self._chosen

    def batches(self, micro: int, steps: int, device: torch.device) -> list[Any]:
        samples = [sample for _i, sample in self.chosen(micro * steps)]
        made = []
        for i in range(steps):
            with on_host():  # as a loader collates: on the host, then moved
                batch = self.collate(samples[i * micro : (i + 1) * micro])
            made.append(worstcase.to_device(batch, device))
        return made


class RowsOf:
    """Rows of one batch made by `make_batch(samples, device)`: the worst case's, where the job has
    no samples to read (a loader with automatic batching off), or the rows of the one batch given."""

    def __init__(self, make_batch: Callable[[int, torch.device], Any], described: str) -> None:
        self.make_batch, self.described = make_batch, described

    def batches(self, micro: int, steps: int, device: torch.device) -> list[Any]:
        samples = micro * steps
        whole = self.make_batch(samples, device)
        if steps == 1:
            return [whole]
        return [rows(whole, i * micro, (i + 1) * micro, samples) for i in range(steps)]


def _elements(batch: Any) -> int:
    return sum(math.prod(shape) for shape in worstcase.field_shapes(batch).values())


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


def scaled_only(check: GradientCheck) -> bool:
    """Whether the window's gradient is the batch's times a factor (every micro-step scaled alike:
    a summed loss, a division missing), not a differently weighted sum of the same samples' (a
    mean over each micro-batch's tokens): for a pure scale, the difference is |factor - 1|."""
    assert check.factor is not None and check.difference is not None
    return check.difference - abs(check.factor - 1.0) <= check.tolerance


def warning(check: GradientCheck | None, fix: str, weights_fix: str | None = None, samples: str = "") -> str | None:
    """The plan's warning for a check that failed or could not run; None when it passed. `fix`
    names the fix for a window scaled as a whole, `weights_fix` the one for micro-batches weighed
    unlike the batch weighs their samples (by default `fix`); `samples` says which samples."""
    if check is None or check.equivalent:
        return None
    if check.error is not None:
        return (
            f"the gradient check could not run ({check.error}): whether one accumulation window trains like the "
            "effective batch is unchecked"
        )
    total = check.micro_batch * check.accumulation_steps
    which = f" ({samples})" if samples else ""
    window = f"one window of {check.accumulation_steps} micro-batches of {check.micro_batch}{which}"
    if scaled_only(check) or weights_fix is None:
        return (
            f"accumulation does not train like the effective batch: {window} gave {check.factor:.2f}x the gradient "
            f"of one batch of the same {total} samples (they differ by {check.difference:.1%}); {fix}"
        )
    return (
        f"accumulation does not train like the effective batch: the gradient of {window} differs by "
        f"{check.difference:.1%} from the gradient of one batch of the same {total} samples ({check.factor:.2f}x its "
        f"norm), more than a scale: the micro-batches are weighed unlike the batch weighs their samples; "
        f"{weights_fix}"
    )
