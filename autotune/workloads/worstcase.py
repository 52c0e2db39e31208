"""The worst-case batch: the batch of size B that needs the most memory, built from a job's real data.

Owns the scan that finds it and the batch makers a memory probe calls:

    worst = find_worst_case(dataset, collate)         # or a DataLoader: its dataset and collate_fn
    make_batch = worst_case_maker(dataset, collate, worst)
    batch = make_batch(64, torch.device("cuda"))      # 64 rows cycling through the worst samples

A probe that runs on a random batch measures an average batch, and the job then runs out of
memory on its longest sequence. The scan collates each sample alone through the job's own collate
function (so its padding, truncation and image transforms apply) and measures every tensor in the
result. It keeps the sample with the most bytes in all, for every field the sample with the most
bytes in it, and for every dimension of every field the sample that is largest along it (the
tallest image and the widest, the longest source and the longest target). Batches cycle through
those samples: a padding collator pads each dimension to the largest in the batch, so one batch is
padded to the worst of every dimension at once, as the job's loader pads its worst batch (images of
both orientations pad to the tallest height *and* the widest width, which no single image has). A
batch smaller than that set of samples takes the subset whose collated batch is largest.

The collate runs on the host (`autotune.devices.host.on_host`): the device holds the collated
batch, copied to it as a loader moves it (`to_device`), not the samples or the collate's work.

Large datasets are scanned on a seeded random subset, iterable ones on their first items; the
`WorstCase` says which, for the report and the fingerprint. `repeat_batch` does the same job for a
single batch the user gives instead of a dataset: it repeats its rows.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import UserDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import combinations, islice
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from autotune.devices.host import on_host
from autotune.errors import ConfigError, WorkloadError
from autotune.plans.accumulate import count_samples
from autotune.workloads import usercode

Collate = Callable[[list[Any]], Any]

# Name of the path of a batch that is one bare tensor (there is no key or position to name it by).
_ROOT = "batch"
# A batch smaller than the worst samples takes the subset that collates largest: every subset is
# tried up to this many, beyond it the samples are added one at a time, the largest gain first.
_SUBSETS = 64


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
        collated = _collate_one(collate_fn, sample, index)
        tally.add(index, _sizes(collated), _shapes(collated))
        if kept is not None:
            kept[index] = sample
            # Only the current leaders can end up in a batch: drop the rest as we go.
            for stale in kept.keys() - tally.leaders():
                del kept[stale]
    if tally.scanned == 0:
        raise WorkloadError("the dataset is empty: there is no sample to build a batch from")

    indices = tally.worst()
    samples = [kept[i] for i in indices] if kept is not None else [_read(dataset, i) for i in indices]
    with on_host():
        batch = _collate_many(collate_fn, samples, indices)
    return WorstCase(
        indices=tuple(indices),
        scanned=tally.scanned,
        total=total,
        seed=chosen_seed,
        shapes=field_shapes(batch),
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
    fewer: dict[int, list[int]] = {}  # a batch smaller than the worst samples: which of them, by size

    def make_batch(size: int, device: torch.device) -> Any:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"a batch size must be an integer >= 1, got {size!r}")
        # On the host, as a loader collates: the device holds the batch it is given, not the
        # samples nor the collate's own tensors (whose ops also grow with the rows).
        with on_host():
            if size < len(samples) and size not in fewer:
                fewer[size] = _largest_subset(collate_fn, samples, indices, size)
            positions = fewer[size] if size < len(samples) else [j % len(samples) for j in range(size)]
            batch = _collate_many(collate_fn, [samples[j] for j in positions], [indices[j] for j in positions])
        return to_device(batch, device)

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


def field_shapes(batch: Any) -> dict[str, list[int]]:
    """The shape of every tensor in a batch, by its path of keys and positions (`input_ids`,
    `0`, `pixel_values`; `batch` for a bare tensor)."""
    return {path: list(tensor.shape) for path, tensor in _leaves(batch)}


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor moved to `device`, containers and other values as they were.

    A loader's batch is the host's until it is moved; on the CPU budget device host and device are
    one memory, so a tensor already there is copied into memory allocated on the device (which the
    budget device counts) from the host's (which it does not), as a transfer to a GPU would."""
    return _map_tensors(batch, lambda tensor: _transfer(tensor, device))


def _transfer(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cpu" or tensor.device != device or tensor.layout is not torch.strided:
        return tensor.to(device)
    moved = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    with on_host():  # the read is the host's: the source is not device memory
        moved.copy_(tensor)
    return moved


# The scan ---------------------------------------------------------------------------------------
class _Tally:
    """The leaders so far: in all, per field (bytes) and per field's dimension (size), the sample
    with the most (ties: the lowest index)."""

    def __init__(self) -> None:
        self.scanned = 0
        self.totals: dict[int, int] = {}
        self.by_path: dict[str, tuple[int, int]] = {}  # path -> (bytes, index)
        self.by_dim: dict[tuple[str, int], tuple[int, int]] = {}  # (path, dimension) -> (size, index)
        self.overall: tuple[int, int] | None = None
        self.sizes: dict[int, dict[str, int]] = {}  # of the leaders only: what worst() compares
        self.shapes: dict[int, dict[str, tuple[int, ...]]] = {}

    def add(self, index: int, sizes: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> None:
        self.scanned += 1
        total = sum(sizes.values())
        self.totals[index] = total
        leads = False
        for path, nbytes in sizes.items():
            best = self.by_path.get(path)
            if best is None or _beats(nbytes, index, *best):
                self.by_path[path] = (nbytes, index)
                leads = True
        for path, shape in shapes.items():
            for dim, length in enumerate(shape):
                best = self.by_dim.get((path, dim))
                if best is None or _beats(length, index, *best):
                    self.by_dim[(path, dim)] = (length, index)
                    leads = True
        if self.overall is None or _beats(total, index, *self.overall):
            self.overall = (total, index)
            leads = True
        if leads:
            self.sizes[index], self.shapes[index] = sizes, shapes
            for stale in self.sizes.keys() - self.leaders():
                del self.sizes[stale], self.shapes[stale]

    def leaders(self) -> set[int]:
        found = {index for _, index in self.by_path.values()} | {index for _, index in self.by_dim.values()}
        if self.overall is not None:
            found.add(self.overall[1])
        return found

    def worst(self) -> list[int]:
        """The largest sample, then each field's leader that has more bytes in its field than the
        samples already kept, then each dimension's leader that is larger along it than they are
        (a field as large in every sample, labels of one token say, adds no sample), largest first."""
        if self.overall is None:
            return []
        found = [self.overall[1]]

        def kept_most(measure: Callable[[int], int]) -> int:
            return max(measure(i) for i in found)

        for path, (nbytes, i) in sorted(self.by_path.items()):
            if nbytes > kept_most(lambda k, path=path: self.sizes[k].get(path, 0)):  # type: ignore[misc]
                found.append(i)
        for (path, dim), (length, i) in sorted(self.by_dim.items()):
            if length > kept_most(lambda k, path=path, dim=dim: _along(self.shapes[k], path, dim)):  # type: ignore[misc]
                found.append(i)
        return sorted(set(found), key=lambda i: (-self.totals[i], i))


def _along(shapes: dict[str, tuple[int, ...]], path: str, dim: int) -> int:
    shape = shapes.get(path, ())
    return shape[dim] if dim < len(shape) else 0


def _beats(nbytes: int, index: int, best_bytes: int, best_index: int) -> bool:
    # Random subsets are scanned in index order, but do not rely on it: ties go to the lowest index.
    return nbytes > best_bytes or (nbytes == best_bytes and index < best_index)


def _sizes(batch: Any) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path, tensor in _leaves(batch):
        sizes[path] = sizes.get(path, 0) + tensor.numel() * tensor.element_size()
    return sizes


def _shapes(batch: Any) -> dict[str, tuple[int, ...]]:
    return {path: tuple(tensor.shape) for path, tensor in _leaves(batch)}


def _largest_subset(collate: Collate, samples: list[Any], indices: tuple[int, ...], size: int) -> list[int]:
    """Positions of the `size` worst samples whose collated batch has the most bytes: with fewer rows
    than worst samples, the pair of the tallest and the widest image outweighs the largest one."""

    def nbytes(positions: Iterable[int]) -> int:
        chosen = list(positions)
        return sum(_sizes(_collate_many(collate, [samples[j] for j in chosen], [indices[j] for j in chosen])).values())

    if math.comb(len(samples), size) <= _SUBSETS:
        # Ties go to the first in order: the samples are ordered largest first.
        return list(max(combinations(range(len(samples)), size), key=nbytes))
    chosen: list[int] = []
    while len(chosen) < size:
        rest = [j for j in range(len(samples)) if j not in chosen]
        chosen.append(max(rest, key=lambda j: nbytes(sorted([*chosen, j]))))
    return sorted(chosen)


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
        raise usercode.attach(WorkloadError(f"reading sample {index} failed: {usercode.describe(exc)}"), exc) from exc


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
        with on_host():
            return collate([sample])
    except Exception as exc:  # user code: whatever it raises is the job's, reported as a workload error
        missing = _missing_field(exc, sample, index)
        failed = f"collating sample {index} alone failed: {usercode.describe(exc)}{missing}; {_named(collate)}"
        raise usercode.attach(WorkloadError(failed), exc) from exc


def _collate_many(collate: Collate, samples: list[Any], indices: Iterable[int]) -> Any:
    try:
        return collate(samples)
    except torch.OutOfMemoryError:
        raise  # a batch too large for the device is what a trial finds out, not a data error
    except Exception as exc:  # user code: whatever it raises is the job's, reported as a workload error
        order = list(indices)
        which = ", ".join(str(i) for i in dict.fromkeys(order))
        fields = _differing_fields(samples, order)
        if collate is default_collate:
            fix = (
                "torch's default_collate stacks samples of one size only: pass collate=, the collate function "
                "of the job's DataLoader (a DataLoader brings its own)"
            )
        else:
            fix = f"{_named(collate)} (a collate function that does not pad cannot batch samples of different sizes)"
        raise usercode.attach(
            WorkloadError(
                f"collating {len(samples)} samples from {which} failed: {usercode.describe(exc)}{fields}; {fix}"
            ),
            exc,
        ) from exc


def _named(collate: Collate) -> str:
    """The collate function and where it is defined, for an error message."""
    if collate is default_collate:
        return "the collate function: torch's default_collate"
    target: Any = collate.func if isinstance(collate, functools.partial) else collate
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    call = type(target).__dict__.get("__call__") or getattr(type(target), "__call__", None)  # noqa: B004
    code = getattr(target, "__code__", None) or getattr(call, "__code__", None)
    if code is None:
        return f"the collate function: {name}"
    return f"the collate function: {name} at {usercode.shown(code.co_filename)}:{code.co_firstlineno}"


def _missing_field(exc: Exception, sample: Any, index: int) -> str:
    """A KeyError naming a field the sample does not have: which fields it has."""
    if not isinstance(exc, KeyError) or not isinstance(sample, Mapping) or not exc.args or exc.args[0] in sample:
        return ""
    return f": sample {index} has no field {exc.args[0]!r} (its fields: {', '.join(str(k) for k in sample)})"


def _differing_fields(samples: list[Any], indices: list[int]) -> str:
    """The fields whose sizes differ between the samples (what a collate that stacks cannot batch)."""
    shapes = [_field_sizes(sample) for sample in samples]
    named = []
    for path in shapes[0]:
        seen = {indices[i]: s.get(path) for i, s in enumerate(shapes)}
        if len(set(seen.values())) > 1:
            sizes = ", ".join(f"{list(shape) if shape else 'absent'} in sample {i}" for i, shape in seen.items())
            named.append(f"field {path!r} is {sizes}")
    return f" ({'; '.join(named[:2])})" if named else ""


def _field_sizes(value: Any, path: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor, and the length of each list of numbers, in a raw sample."""
    if isinstance(value, torch.Tensor):
        return {".".join(path) or _ROOT: tuple(value.shape)}
    if isinstance(value, Mapping):
        return {k: v for key, item in value.items() for k, v in _field_sizes(item, (*path, str(key))).items()}
    if isinstance(value, list | tuple) and value and all(isinstance(v, int | float) for v in value):
        return {".".join(path) or _ROOT: (len(value),)}
    if isinstance(value, tuple | list):
        found: dict[str, tuple[int, ...]] = {}
        for position, item in enumerate(value):
            found.update(_field_sizes(item, (*path, str(position))))
        return found
    return {}


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
