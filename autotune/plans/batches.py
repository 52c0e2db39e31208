"""Cutting and joining batches along their sample dimension, and re-slicing a loader into a plan's windows.

A plan's micro-batches can be unequal (`[15, 14]` for 29 per rank) and no `DataLoader` with a
fixed `batch_size` yields them. Grouping whatever the loader yields into windows of
`accumulation_steps` batches then gives every optimizer step the wrong effective batch, silently:
`batch_size=15` with the plan `[15, 14]` runs 30 samples a step, and a short last loader batch
shifts every window after it. So `plan_windows_of` reads the loader's batches as one stream of
samples and cuts it into the plan's sizes, window after window: a loader batch of exactly the
next size passes through untouched (a `PlanBatchSampler` loader costs nothing), a bigger one is
cut into views, and a micro-batch that spans two loader batches is joined (a copy, usually on the
host: move each micro-batch to the device, not the loader's batch).

What can be cut: tensors and arrays along dim 0 (anything with `.shape` and slicing), inside
tuples, lists, namedtuples and mappings, and lists of per-sample values (strings, ids) as the
default collate makes them. A value that is not per sample (a scalar, a tensor whose first
dimension is not the batch's) is kept in every piece, and joining requires it to be the same in
each. What cannot be cut is refused with the fix (`PlanBatchSampler`) before any training step.

Pure Python; torch is imported only to join tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from autotune.errors import ConfigError
from autotune.plans.plan import Plan

B = TypeVar("B")

_FIX = (
    "give the loader the plan's micro-batches instead: "
    "DataLoader(dataset, batch_sampler=PlanBatchSampler(len(dataset), plan)) (autotune.plans.sampler)"
)


def count_samples(batch: object) -> int:
    """The default count: the first dimension of the batch, or of the first element of a tuple,
    list or dict batch (what the default collate makes of `(x, y)` or `{"input_ids": ...}`)."""
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) >= 1:
        return int(shape[0])
    if isinstance(batch, Mapping) and batch:
        return count_samples(next(iter(batch.values())))
    if isinstance(batch, tuple | list) and batch:
        if _per_sample_list(batch):
            return len(batch)
        return count_samples(batch[0])
    raise ConfigError(
        f"cannot count the samples of a {type(batch).__name__} micro-batch: "
        "pass count=, a function returning its number of samples (or tokens)"
    )


def _per_sample_list(value: object) -> bool:
    """A list of plain per-sample values (the default collate's list of strings), not a container of fields."""
    return (
        isinstance(value, list)
        and bool(value)
        and not any(hasattr(v, "shape") or isinstance(v, Mapping | tuple | list) for v in value)
    )


def split_batch(batch: B, size: int) -> list[B]:
    """Cut a micro-batch into pieces of at most `size` samples along the first dimension.

    Tensors (and anything with `.shape` and slicing) are cut; tuples, lists and mappings are cut
    element by element (what the default collate makes of `(x, y)` or `{"input_ids": ...}`);
    other values are repeated in every piece. The pieces are views: cutting allocates nothing."""
    n = count_samples(batch)
    return [_slice(batch, start, min(start + size, n), n) for start in range(0, n, size)]


def _slice(value: Any, start: int, stop: int, n: int) -> Any:
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1 and shape[0] == n:
        return value[start:stop]
    if isinstance(value, Mapping):
        sliced = {k: _slice(v, start, stop, n) for k, v in value.items()}
        kind: Any = type(value)
        try:
            return kind(sliced)
        except TypeError:
            return sliced
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_slice(v, start, stop, n) for v in value))
    if _per_sample_list(value) and len(value) == n:
        return value[start:stop]
    if isinstance(value, tuple | list):
        return type(value)(_slice(v, start, stop, n) for v in value)
    return value


def join_batches(pieces: list[B]) -> B:
    """One batch from pieces cut by `split_batch` (or loader batches of one structure), in order.

    Per-sample values are concatenated along dim 0; a value kept whole in every piece must be the
    same in all of them. Raises ConfigError, naming the field, for anything else."""
    if len(pieces) == 1:
        return pieces[0]
    counts = [count_samples(p) for p in pieces]
    joined: B = _join(pieces, counts, "batch")
    return joined


def _join(values: list[Any], counts: list[int], where: str) -> Any:
    first = values[0]
    shape = getattr(first, "shape", None)
    if (
        shape is not None
        and len(shape) >= 1
        and all(getattr(v, "shape", (None,))[0] == n for v, n in zip(values, counts, strict=True))
    ):
        return _concatenate(values, where)
    if isinstance(first, Mapping):
        if any(not isinstance(v, Mapping) or v.keys() != first.keys() for v in values):
            raise ConfigError(f"the loader's batches differ in their fields ({where}): they cannot be joined; {_FIX}")
        joined = {k: _join([v[k] for v in values], counts, f"{where}[{k!r}]") for k in first}
        kind: Any = type(first)
        try:
            return kind(joined)
        except TypeError:
            return joined
    if _per_sample_list(first) and all(
        _per_sample_list(v) and len(v) == n for v, n in zip(values, counts, strict=True)
    ):
        return [item for v in values for item in v]
    if isinstance(first, tuple | list):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise ConfigError(
                f"the loader's batches differ in their structure ({where}): they cannot be joined; {_FIX}"
            )
        parts = [_join([v[i] for v in values], counts, f"{where}[{i}]") for i in range(len(first))]
        if hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    if all(_same(v, first) for v in values[1:]):
        return first
    raise ConfigError(
        f"{where} is a {type(first).__name__} that is not per sample and differs between the loader's batches: "
        f"a micro-batch spanning two of them cannot be built; {_FIX}"
    )


def _concatenate(values: list[Any], where: str) -> Any:
    first = values[0]
    if type(first).__module__.startswith("torch"):
        import torch

        try:
            return torch.cat(values, dim=0)
        except RuntimeError as exc:  # e.g. sequences padded to different lengths per loader batch
            raise ConfigError(
                f"{where}: the loader's batches cannot be joined into one micro-batch ({exc}); "
                f"padding differs between batches? {_FIX}"
            ) from None
    concatenate = getattr(type(first), "concatenate", None) or _numpy_concatenate(first)
    if concatenate is None:
        raise ConfigError(f"{where}: cannot join {type(first).__name__} values; {_FIX}")
    try:
        return concatenate(values)
    except ValueError as exc:
        raise ConfigError(
            f"{where}: the loader's batches cannot be joined into one micro-batch ({exc}); {_FIX}"
        ) from None


def _numpy_concatenate(value: object) -> Any:
    if type(value).__module__ == "numpy":
        import numpy

        return numpy.concatenate
    return None


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        equal = a == b
        return bool(equal.all()) if hasattr(equal, "all") else bool(equal)
    except (TypeError, ValueError, RuntimeError):  # values that cannot be compared are not the same
        return False


@dataclass(frozen=True)
class PlanWindow:
    """The micro-batches of one optimizer step, cut to the plan's sizes."""

    batches: list[Any]
    samples: int  # in this window (per rank)
    short: bool  # fewer samples than the plan's window: the end of the data


def plan_windows_of(batches: Iterable[Any], plan: Plan) -> Iterator[PlanWindow]:
    """The loader's batches as the plan's windows, whatever size the loader yields.

    Samples are taken in order; the last window of the data is cut into the plan's sizes in
    order (its last micro-batch is what is left) and marked short. A batch that cannot be cut
    is refused (ConfigError with the fix) before its window is yielded."""
    sizes = plan.micro_batches
    window_samples = sum(sizes)
    stream = _SampleStream(iter(batches))
    while True:
        window: list[Any] = []
        taken = 0
        for size in sizes:
            micro = stream.take(size)
            if micro is None:
                break
            window.append(micro[0])
            taken += micro[1]
            if micro[1] < size:
                break
        if not window:
            return
        yield PlanWindow(window, taken, taken < window_samples)
        if taken < window_samples:
            return


def epoch_samples(batches: object) -> int | None:
    """The samples `batches` yields in one pass, when it says so without being read: a DataLoader's
    (its sampler's length, less what `drop_last` drops; a `PlanBatchSampler`'s own count), a list
    of batches'. None for anything else (an iterable dataset, a generator, a batch sampler of
    unknown kind)."""
    if isinstance(batches, list | tuple):
        try:
            return sum(count_samples(batch) for batch in batches)
        except ConfigError:  # not countable: cutting the windows refuses it, with the fix
            return None
    batch_sampler = getattr(batches, "batch_sampler", None)
    if batch_sampler is None:
        return None
    samples = getattr(batch_sampler, "samples", None)
    if callable(samples):  # a PlanBatchSampler
        return int(samples())
    if type(batch_sampler).__name__ != "BatchSampler" or not hasattr(batch_sampler, "sampler"):
        return None
    try:
        total = len(batch_sampler.sampler)
    except TypeError:  # an iterable dataset's endless sampler
        return None
    size = batch_sampler.batch_size
    return total - total % size if batch_sampler.drop_last else total


def plan_micro_batches_of(batches: Iterable[Any], plan: Plan, samples: int) -> Iterator[tuple[int, int, Any, int]]:
    """(window, its samples, micro-batch, its samples) for each of the plan's micro-batches, one at a
    time, from a loader that yields `samples` samples in all: the windows' totals are known before
    any of their micro-batches is read (the last one holds what is left), so nothing is read ahead.
    Refuses a loader that yields other than `samples` with a ConfigError."""
    sizes = plan.micro_batches
    window_samples = sum(sizes)
    stream = _SampleStream(iter(batches))
    number, read = 0, 0
    while read < samples:
        total = min(window_samples, samples - read)
        wanted: list[int] = []
        for size in sizes:
            if sum(wanted) >= total:
                break
            wanted.append(min(size, total - sum(wanted)))
        for size in wanted:
            micro = stream.take(size)
            if micro is None or micro[1] != size:
                got = read + (0 if micro is None else micro[1])
                raise ConfigError(_length_mismatch(samples, f"ended after {got} samples"))
            read += size
            yield number, total, micro[0], size
        number += 1
    if stream.take(1) is not None:
        raise ConfigError(_length_mismatch(samples, "yielded more"))


def _length_mismatch(samples: int, what: str) -> str:
    return (
        f"the loader's length says {samples} samples an epoch, and it {what}: its windows' totals were taken from "
        "that length to weigh each micro-step before the window was read; give it a sampler whose length is what "
        "it yields (or pass count=, which reads each window first)"
    )


class _SampleStream:
    """Batches as a stream of samples: `take(n)` gives the next n (fewer at the end) as one batch."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches
        self.current: Any = None
        self.offset = 0
        self.size = 0

    def _next_batch(self) -> bool:
        for batch in self.batches:
            try:
                size = count_samples(batch)
            except ConfigError:
                raise ConfigError(
                    f"cannot cut a {type(batch).__name__} batch into the plan's micro-batches "
                    f"(no first dimension to count samples along); {_FIX}"
                ) from None
            if size:
                self.current, self.offset, self.size = batch, 0, size
                return True
        self.current = None
        return False

    def take(self, n: int) -> tuple[Any, int] | None:
        pieces: list[Any] = []
        taken = 0
        while taken < n:
            if (self.current is None or self.offset >= self.size) and not self._next_batch():
                break
            want = n - taken
            stop = min(self.offset + want, self.size)
            if self.offset == 0 and stop == self.size:
                piece = self.current  # a whole loader batch (a PlanBatchSampler's): passed through untouched
            else:
                piece = _slice(self.current, self.offset, stop, self.size)
                _check_cut(piece, stop - self.offset)
            pieces.append(piece)
            taken += stop - self.offset
            self.offset = stop
        if not pieces:
            return None
        return join_batches(pieces), taken


def _check_cut(piece: Any, n: int) -> None:
    """A cut piece must count what was cut: a batch whose counted field is not per sample was not cut."""
    if count_samples(piece) != n:
        raise ConfigError(f"a loader batch could not be cut along its samples; {_FIX}")
