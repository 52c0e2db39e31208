"""The worst-case batch: the batch of size B that needs the most memory, built from a job's real data.

Owns the scan that finds it and the batch makers a memory probe calls:

    worst = find_worst_case(dataset, collate)         # or a DataLoader: its dataset and collate_fn
    make_batch = worst_case_maker(dataset, collate, worst)
    batch = make_batch(64, torch.device("cuda"))      # 64 rows cycling through the worst samples

A probe that runs on a random batch measures an average batch, and the job then runs out of
memory on its longest sequence. The scan collates each sample alone through the job's own collate
function (so its padding, truncation and image transforms apply) and measures the bytes of every
tensor in the result. It keeps, for every field, the sample with the most bytes in that field, and
the sample with the most bytes in all. Batches cycle through those samples: a padding collator pads
each field to the longest in the batch, so one batch is padded to the worst of every field at once
(the longest source *and* the longest target of an encoder-decoder set, even when no single sample
has both).

Large datasets are scanned on a seeded random subset, iterable ones on their first items; the
`WorstCase` says which, for the report and the fingerprint. `repeat_batch` does the same job for a
single batch the user gives instead of a dataset: it repeats its rows.
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from autotune.errors import ConfigError, WorkloadError
from autotune.plans.accumulate import count_samples

Collate = Callable[[list[Any]], Any]

# Name of the path of a batch that is one bare tensor (there is no key or position to name it by).
_ROOT = "batch"


@dataclass(frozen=True)
class WorstCase:
    """Which samples make the worst-case batch, how they were found, and the shapes they collate to."""

    indices: tuple[int, ...]  # dataset indices the batches are built from, cycled; worst first
    scanned: int  # how many samples were looked at
    total: int | None  # len(dataset); None for an iterable or unsized dataset
    seed: int | None  # seed of the random subset when not every sample was scanned, else None
    shapes: dict[str, list[int]]  # each tensor of collate(worst samples) at batch size len(indices)
    # An iterable dataset cannot be indexed, so its worst samples are kept to build batches from.
    _samples: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def describe(self) -> str:
        """One line: which samples, out of what, and the shapes of the batch they collate to."""
        which = ", ".join(str(i) for i in self.indices)
        noun = "sample" if len(self.indices) == 1 else "samples"
        if self.total is None:
            where = f"{noun} {which} of an unsized dataset (first {self.scanned} scanned)"
        elif self.seed is None:
            where = f"{noun} {which} of {self.total} (all scanned)"
        else:
            where = f"{noun} {which} of {self.total} ({self.scanned} scanned at random, seed {self.seed})"
        shapes = ", ".join(f"{path} {shape}" for path, shape in self.shapes.items()) or "no tensors"
        return f"{where}: {shapes}"

    def input_spec(self) -> dict[str, str | int | float | bool]:
        """Flat and JSON-ready, for a fingerprint: a different scan result must change the hash."""
        spec: dict[str, str | int | float | bool] = {
            "worst_samples": ",".join(str(i) for i in self.indices),
            "scanned": self.scanned,
        }
        if self.total is not None:
            spec["total"] = self.total
        if self.seed is not None:
            spec["seed"] = self.seed
        for path, shape in self.shapes.items():
            # A field called like one of ours must not overwrite it (or be overwritten).
            key = path if path not in spec else f"shape.{path}"
            spec[key] = "x".join(str(d) for d in shape) or "scalar"
        return spec


def find_worst_case(dataset: Any, collate: Collate | None = None, *, limit: int = 10_000, seed: int = 0) -> WorstCase:
    """Scan `dataset` (or a DataLoader's) for the samples that make the largest batches.

    Every sample when there are at most `limit`; otherwise `limit` distinct ones drawn at random
    with `seed`; the first `limit` of an iterable dataset."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"the scan limit must be an integer >= 1, got {limit!r}")
    dataset, collate_fn = _resolve(dataset, collate)
    total = _length(dataset)
    kept: dict[int, Any] | None = None
    chosen_seed: int | None = None
    if total is None:
        kept = {}
        items: Iterable[tuple[int, Any]] = enumerate(islice(iter(dataset), limit))
    else:
        if total <= limit:
            order: Iterable[int] = range(total)
        else:
            order = _random_indices(total, limit, seed)
            chosen_seed = seed
        items = ((i, _read(dataset, i)) for i in order)

    tally = _Tally()
    for index, sample in items:
        tally.add(index, _sizes(_collate_one(collate_fn, sample, index)))
        if kept is not None:
            kept[index] = sample
            # Only the current leaders can end up in a batch: drop the rest as we go.
            for stale in kept.keys() - tally.leaders():
                del kept[stale]
    if tally.scanned == 0:
        raise WorkloadError("the dataset is empty: there is no sample to build a batch from")

    indices = tally.worst()
    samples = [kept[i] for i in indices] if kept is not None else [_read(dataset, i) for i in indices]
    batch = _collate_many(collate_fn, samples, indices)
    return WorstCase(
        indices=tuple(indices),
        scanned=tally.scanned,
        total=total,
        seed=chosen_seed,
        shapes={path: list(tensor.shape) for path, tensor in _leaves(batch)},
        _samples=tuple(samples) if kept is not None else (),
    )


def worst_case_maker(
    dataset: Any, collate: Collate | None = None, worst: WorstCase | None = None, **find_kwargs: Any
) -> Callable[[int, torch.device], Any]:
    """`make_batch(b, device)`: `b` rows cycling through the worst samples, collated, on `device`.

    `worst` is a `find_worst_case` result for this dataset; without it the dataset is scanned here
    (with `find_kwargs`: limit=, seed=)."""
    if worst is None:
        worst = find_worst_case(dataset, collate, **find_kwargs)
    elif find_kwargs:
        raise ConfigError(f"scan options {sorted(find_kwargs)} have no effect with worst= given: pass one or the other")
    dataset, collate_fn = _resolve(dataset, collate)
    if not worst.indices:
        raise WorkloadError("the worst case names no samples: there is nothing to build a batch from")
    # Read once: the probe builds many batches, and reading can be slow (decoding, augmenting).
    # Copied: a sample of a TensorDataset is a view of the whole data set, which the budget device
    # would count whole the first time a batch reads it (on a GPU the data set is the host's).
    samples = [
        _map_tensors(sample, torch.Tensor.clone) for sample in list(worst._samples) or _fetch(dataset, worst.indices)
    ]
    indices = worst.indices

    def make_batch(size: int, device: torch.device) -> Any:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"a batch size must be an integer >= 1, got {size!r}")
        rows = [samples[j % len(samples)] for j in range(size)]
        return to_device(_collate_many(collate_fn, rows, indices), device)

    return make_batch


def repeat_batch(batch: Any, size: int) -> Any:
    """A batch of `size` rows from one batch of n: rows `arange(size) % n` of every tensor whose
    first dimension is n; other values (scalars, strings, tensors of another length) are kept."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"a batch size must be an integer >= 1, got {size!r}")
    n = count_samples(batch)
    if n < 1:
        raise WorkloadError("the given batch has no rows to repeat")

    def take(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != n:
            return tensor
        # On the tensor's own device, also inside `with torch.device("meta")` (the fingerprint's).
        rows = torch.arange(size, device=tensor.device) % n
        # A copy, not an expanded view: the probe must pay for the rows the job's batch would hold.
        return tensor.index_select(0, rows)

    return _map_tensors(batch, take)


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor moved to `device`, containers and other values as they were."""
    return _map_tensors(batch, lambda tensor: tensor.to(device))


# The scan ---------------------------------------------------------------------------------------
class _Tally:
    """The leaders so far: per field and in all, the sample with the most bytes (ties: lowest index)."""

    def __init__(self) -> None:
        self.scanned = 0
        self.totals: dict[int, int] = {}
        self.by_path: dict[str, tuple[int, int]] = {}  # path -> (bytes, index)
        self.overall: tuple[int, int] | None = None
        self.overall_sizes: dict[str, int] = {}

    def add(self, index: int, sizes: dict[str, int]) -> None:
        self.scanned += 1
        total = sum(sizes.values())
        self.totals[index] = total
        for path, nbytes in sizes.items():
            best = self.by_path.get(path)
            if best is None or _beats(nbytes, index, *best):
                self.by_path[path] = (nbytes, index)
        if self.overall is None or _beats(total, index, *self.overall):
            self.overall = (total, index)
            self.overall_sizes = sizes

    def leaders(self) -> set[int]:
        found = {index for _, index in self.by_path.values()}
        if self.overall is not None:
            found.add(self.overall[1])
        return found

    def worst(self) -> list[int]:
        """The largest sample, and each field's leader that is larger in its field than that one
        (a field as large in every sample, labels of one token say, adds no sample)."""
        if self.overall is None:
            return []
        found = {self.overall[1]}
        found |= {i for path, (nbytes, i) in self.by_path.items() if nbytes > self.overall_sizes.get(path, 0)}
        return sorted(found, key=lambda i: (-self.totals[i], i))


def _beats(nbytes: int, index: int, best_bytes: int, best_index: int) -> bool:
    # Random subsets are scanned in index order, but do not rely on it: ties go to the lowest index.
    return nbytes > best_bytes or (nbytes == best_bytes and index < best_index)


def _sizes(batch: Any) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path, tensor in _leaves(batch):
        sizes[path] = sizes.get(path, 0) + tensor.numel() * tensor.element_size()
    return sizes


def _random_indices(total: int, limit: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    if total <= 8 * limit:
        chosen = torch.randperm(total, generator=generator)[:limit].tolist()
    else:
        # randperm(total) costs 8 bytes a sample (gigabytes for a web-scale set); with limit far
        # below total, draws with replacement rarely repeat, so drawing until enough differ is cheap.
        seen: dict[int, None] = {}
        while len(seen) < limit:
            for i in torch.randint(total, (limit,), generator=generator).tolist():
                seen[i] = None
                if len(seen) == limit:
                    break
        chosen = list(seen)
    # Index order is kinder to datasets on disk (memory-mapped arrow files, shards).
    return sorted(chosen)


# Reading and collating ---------------------------------------------------------------------------
def _resolve(dataset: Any, collate: Collate | None) -> tuple[Any, Collate]:
    if isinstance(dataset, DataLoader):
        if collate is None and dataset.batch_sampler is None:
            # batch_size=None: the loader's collate_fn converts single items, it does not batch.
            raise WorkloadError(
                "the DataLoader has automatic batching off (batch_size=None), so its collate_fn cannot make "
                "batches: pass collate=, or one batch of the job's instead of the loader"
            )
        return dataset.dataset, collate if collate is not None else dataset.collate_fn
    return dataset, collate if collate is not None else default_collate


def _length(dataset: Any) -> int | None:
    # An IterableDataset may define __len__, but it cannot be indexed.
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


def _read(dataset: Any, index: int) -> Any:
    try:
        return dataset[index]
    except Exception as exc:  # user code: whatever it raises is the job's, reported as a workload error
        raise WorkloadError(f"reading sample {index} failed: {type(exc).__name__}: {exc}") from exc


def _fetch(dataset: Any, indices: tuple[int, ...]) -> list[Any]:
    if _length(dataset) is not None:
        return [_read(dataset, i) for i in indices]
    # A WorstCase made elsewhere for an iterable dataset: walk to its positions once.
    wanted = set(indices)
    found = {i: item for i, item in enumerate(islice(iter(dataset), max(indices) + 1)) if i in wanted}
    missing = sorted(wanted - found.keys())
    if missing:
        raise WorkloadError(f"the iterable dataset ended before sample {missing[0]} of the worst case")
    return [found[i] for i in indices]


def _collate_one(collate: Collate, sample: Any, index: int) -> Any:
    try:
        return collate([sample])
    except Exception as exc:  # user code: whatever it raises is the job's, reported as a workload error
        raise WorkloadError(f"collating sample {index} alone failed: {type(exc).__name__}: {exc}") from exc


def _collate_many(collate: Collate, samples: list[Any], indices: Iterable[int]) -> Any:
    try:
        return collate(samples)
    except torch.OutOfMemoryError:
        raise  # a batch too large for the device is what a trial finds out, not a data error
    except Exception as exc:  # user code: whatever it raises is the job's, reported as a workload error
        which = ", ".join(str(i) for i in indices)
        raise WorkloadError(
            f"collating {len(samples)} samples from {which} failed: {type(exc).__name__}: {exc} "
            "(a collate function that does not pad cannot batch samples of different sizes)"
        ) from exc


# Walking batches ---------------------------------------------------------------------------------
def _leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested mappings, namedtuples, tuples and lists."""
    if isinstance(value, torch.Tensor):
        yield ".".join(path) or _ROOT, value
    elif isinstance(value, Mapping):  # UserDict (Hugging Face BatchEncoding) is a Mapping too
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for name, item in zip(value._fields, value, strict=True):
            yield from _leaves(item, (*path, name))
    elif isinstance(value, tuple | list):
        for position, item in enumerate(value):
            yield from _leaves(item, (*path, str(position)))


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `fn` applied to every tensor, each container rebuilt as its own type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, UserDict):
        # A shallow copy keeps what the class holds besides its items (BatchEncoding's encodings).
        clone = copy.copy(value)
        clone.data = {key: _map_tensors(item, fn) for key, item in value.items()}
        return clone
    if isinstance(value, Mapping):
        mapped = {key: _map_tensors(item, fn) for key, item in value.items()}
        kind: Any = type(value)
        try:
            return kind(mapped)
        except TypeError:  # a mapping that cannot be built from a dict (defaultdict, read-only views)
            return mapped
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(item, fn) for item in value))
    if isinstance(value, tuple | list):
        return type(value)(_map_tensors(item, fn) for item in value)
    return value
