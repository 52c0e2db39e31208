"""The memory-curve predictor: two small trials predict the answer, two more verify it.

The peak memory of a training step is not affine in the batch size (the peak moves between
forward, backward and the optimizer step), but the live bytes after each individual op are. So we
record the live-bytes timeline of a whole trial (the same steps a trial runs) at two small batch
sizes p < q, check both ran the same op sequence, and predict

    peak(B) = max over ops t of (a_t + b_t·B)

then hand the largest B with peak(B) <= limit to `search.search_from_guess`, which verifies it
for real (B fits, B + granularity does not) and brackets from it when the prediction misses.
The answer keeps every guarantee of the plain search.

On the budget device the timeline also carries each storage's birth, death and raw size, so the
model can round every storage to the allocator's 512-byte blocks at the predicted size instead of
extrapolating rounded sums (which is off by a block or two for models whose per-sample tensors
are small, e.g. integer targets). On CUDA a dispatch mode reads `torch.cuda.memory_allocated()`
after each op; the cap there applies to reserved memory (allocated plus the caching allocator's
rounding and fragmentation), so the first guess is run as a trial and the allocated/reserved ratio
it measured, at the scale of the answer, refines the guess before the verification.

The timeline trials are real trials: they run the same steps under the same limit, so they are
reported first in the result's trial list, counted in the trial count (`Prediction.probe_trials`
says how many), and reused when the verification asks for the same size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.devices import host
from autotune.devices.allocator import AllocatorOutOfMemory, CachingAllocatorModel
from autotune.devices.budget import ROUNDING
from autotune.devices.device import ProbeDevice
from autotune.devices.host import Site
from autotune.engine.search import (
    MAKE_BATCH_HINT,
    MAX_PREDICTED_BATCH,
    SearchOutcome,
    TrialFn,
    search,
    search_from_guess,
)
from autotune.errors import FlatMemoryError, NothingFitsError
from autotune.results import CurvePoint, Prediction, TrialRecord
from autotune.units import format_bytes
from autotune.workloads.usercode import shown

# Batch 1 can run a different op sequence (a squeezed dimension, a fast path), so the pair starts
# at 2; the third size is the second pair's upper end when the first pair's sequences differ.
PROBE_LADDER = (2, 4, 8)
CURVE_POINTS = 64

Event = tuple[str, Any, int]


# Timelines ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StorageLog:
    """Each storage a trial created: the op index it was born at, died at (-1: still alive) and
    its raw size; plus deaths of storages older than the trial (op index, counted bytes)."""

    base: int
    born_at: tuple[int, ...]
    died_at: tuple[int, ...]
    nbytes: tuple[int, ...]
    older_deaths: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class AllocationTrace:
    """The order of the storages' births and deaths in one trial, and the caching allocator's model
    as the trial found it (the budget device's `AUTOTUNE_ALLOCATOR=cuda`): enough to replay the
    trial's allocations at another batch size and see what the allocator reserves.

    `order`: (0, serial) a storage of the trial born, (1, serial) it died, (2, key) a storage older
    than the trial died; `blocks`: the model's block of each storage alive when the trial began."""

    order: tuple[tuple[int, int], ...]
    allocator: CachingAllocatorModel
    blocks: dict[int, int]


@dataclass(frozen=True)
class Timeline:
    """Live bytes after every op of one trial at one batch size, and the code that ran each op
    (`autotune.devices.host.code_site`: file, line, function; None where no Python code did)."""

    batch: int
    ops: tuple[str, ...]
    live: tuple[int, ...]
    storages: StorageLog | None = None
    trace: AllocationTrace | None = None
    sites: tuple[Site | None, ...] = ()


def parse_events(
    batch: int,
    base: int,
    events: Sequence[Event],
    allocator: tuple[CachingAllocatorModel, dict[int, int]] | None = None,
) -> Timeline:
    """Turn the budget device's event list into a Timeline (see `BudgetDevice.record_timeline`);
    with the allocator model's state at the trial's start, its allocation trace too."""
    order: list[tuple[int, int]] = []
    ops: list[str] = []
    live: list[int] = []
    born_at: list[int] = []
    died_at: list[int] = []
    nbytes: list[int] = []
    older: list[tuple[int, int]] = []
    sites: list[Site | None] = []
    serial_of: dict[int, int] = {}
    for kind, what, value in events:
        if kind == "op":
            ops.append(str(what))
            live.append(value)
        elif kind == "site":
            sites.append(what)
        elif kind == "born":
            serial_of[what] = len(born_at)
            order.append((0, len(born_at)))
            born_at.append(len(ops))
            died_at.append(-1)
            nbytes.append(value)
        elif kind == "died":
            serial = serial_of.pop(what, None)
            if serial is None:
                older.append((len(ops), value))
                order.append((2, what))
            else:
                died_at[serial] = len(ops)
                order.append((1, serial))
    log = StorageLog(base, tuple(born_at), tuple(died_at), tuple(nbytes), tuple(older))
    trace = None if allocator is None else AllocationTrace(tuple(order), allocator[0], allocator[1])
    return Timeline(batch, tuple(ops), tuple(live), log, trace, tuple(sites) if len(sites) == len(ops) else ())


def same_ops(a: Timeline, b: Timeline) -> bool:
    return a.ops == b.ops


def where_ops_differ(timelines: Sequence[Timeline]) -> str:
    """Which code makes the timelines' op sequences differ, for the reason of a fallback: the first
    place (file:line in function) that runs a different number of ops at each size, else the
    first op at which the sequences part and the place that ran it."""
    sizes = "/".join(str(t.batch) for t in timelines)
    if all(t.sites for t in timelines):
        counts = [_ops_per_site(t) for t in timelines]
        order = list(dict.fromkeys(site for t in timelines for site in t.sites))
        for site in order:
            per_size = [c.get(site, 0) for c in counts]
            if len(set(per_size)) > 1:
                return (
                    f"{_place(site)} runs {'/'.join(str(n) for n in per_size)} ops at batch {sizes}: its ops depend "
                    "on the batch size (a loop over the rows?)"
                )
    first, second = timelines[0], timelines[1]
    index = next(
        (i for i, (x, y) in enumerate(zip(first.ops, second.ops, strict=False)) if x != y),
        min(len(first.ops), len(second.ops)),
    )
    ran = [f"{_op(t, index)} at batch {t.batch}" for t in (first, second)]
    site = next((t.sites[index] for t in (first, second) if index < len(t.sites)), None)
    return f"they part at op {index + 1} ({', '.join(ran)}), run by {_place(site)}"


def _ops_per_site(timeline: Timeline) -> dict[Site | None, int]:
    counts: dict[Site | None, int] = {}
    for site in timeline.sites:
        counts[site] = counts.get(site, 0) + 1
    return counts


def _op(timeline: Timeline, index: int) -> str:
    return timeline.ops[index] if index < len(timeline.ops) else "no op (the trial ended)"


def _place(site: Site | None) -> str:
    if site is None:
        return "code outside Python (the autograd engine)"
    filename, line, function = site
    return f"the code at {shown(filename)}:{line} in {function}"


# Models ---------------------------------------------------------------------------------------
class CurveModel(Protocol):
    def peak(self, batch: int) -> int: ...


@dataclass(frozen=True)
class EnvelopeModel:
    """peak(B) = max_t (a_t + b_t·B) from two timelines of the same op sequence."""

    p: int
    q: int
    live_p: np.ndarray
    live_q: np.ndarray

    @classmethod
    def fit(cls, a: Timeline, b: Timeline) -> EnvelopeModel:
        return cls(a.batch, b.batch, np.asarray(a.live, dtype=np.int64), np.asarray(b.live, dtype=np.int64))

    def peak(self, batch: int) -> int:
        # live_p + (live_q - live_p)(B - p)/(q - p), rounded up: never under-predict a point.
        num = self.live_p * (self.q - self.p) + (self.live_q - self.live_p) * (batch - self.p)
        return int((-((-num) // (self.q - self.p))).max())

    def largest(self, limit: int) -> int | None:
        """Largest B >= 1 with peak(B) <= limit, 0 when none, None when memory does not grow."""
        d = self.live_q - self.live_p
        growing = d > 0
        if not growing.any():
            return None if self.peak(1) <= limit else 0
        span = self.q - self.p
        bounds = self.p + ((limit - self.live_p[growing]) * span) // d[growing]
        largest = max(0, int(bounds.min()))
        # An op whose memory does not grow can still be over the limit; smaller B cannot help it.
        if largest and self.peak(largest) > limit:
            return 0
        return largest


@dataclass(frozen=True)
class StorageModel:
    """Live bytes rebuilt storage by storage, each rounded to the allocator's block at size B.

    Exact on the budget device when every storage's raw size is affine in the batch."""

    p: int
    q: int
    ops: int
    base: int
    born_at: np.ndarray
    died_at: np.ndarray
    nbytes_p: np.ndarray
    nbytes_q: np.ndarray
    older_at: np.ndarray
    older_bytes: np.ndarray

    @classmethod
    def fit(cls, a: Timeline, b: Timeline) -> StorageModel | None:
        """None when the two trials' storages do not correspond one to one."""
        la, lb = a.storages, b.storages
        if la is None or lb is None or la.born_at != lb.born_at or la.died_at != lb.died_at:
            return None
        if la.base != lb.base or la.older_deaths != lb.older_deaths:
            return None
        older = la.older_deaths
        model = cls(
            a.batch,
            b.batch,
            len(a.ops),
            la.base,
            np.asarray(la.born_at, dtype=np.int64),
            np.asarray(la.died_at, dtype=np.int64),
            np.asarray(la.nbytes, dtype=np.int64),
            np.asarray(lb.nbytes, dtype=np.int64),
            np.asarray([i for i, _ in older], dtype=np.int64),
            np.asarray([n for _, n in older], dtype=np.int64),
        )
        # The model must reproduce both recordings exactly, or it describes something else.
        if model.timeline(a.batch).tolist() != list(a.live) or model.timeline(b.batch).tolist() != list(b.live):
            return None
        return model

    def timeline(self, batch: int) -> np.ndarray:
        span = self.q - self.p
        raw = -((-(self.nbytes_p * span + (self.nbytes_q - self.nbytes_p) * (batch - self.p))) // span)
        sizes = -((-np.maximum(raw, 0)) // ROUNDING) * ROUNDING
        delta = np.zeros(self.ops + 1, dtype=np.int64)
        np.add.at(delta, self.born_at, sizes)
        dead = self.died_at >= 0
        np.subtract.at(delta, self.died_at[dead], sizes[dead])
        np.subtract.at(delta, self.older_at, self.older_bytes)
        return self.base + np.cumsum(delta)[: self.ops]

    def peak(self, batch: int) -> int:
        return int(self.timeline(batch).max()) if self.ops else self.base

    @property
    def grows(self) -> bool:
        """Whether any storage's raw size depends on the batch (rounding can hide it in live bytes)."""
        return bool((self.nbytes_p != self.nbytes_q).any())


@dataclass(frozen=True)
class ReplayModel:
    """The trial's allocations replayed through the caching allocator's model at batch B: each
    storage at its size at B (as `StorageModel` scales it), born and freed in the order the trial
    ran them, starting from the allocator as the trial found it. `peak(B)` is the reserved peak, or
    one byte over the limit when the allocator model runs out (after freeing its cache and retrying,
    as the real one does): the limit bites on reserved memory, not on the live bytes the other
    models count."""

    storage: StorageModel
    trace: AllocationTrace
    limit: int

    @classmethod
    def fit(cls, a: Timeline, b: Timeline, storage: StorageModel, limit: int) -> ReplayModel | None:
        if a.trace is None or b.trace is None:
            return None
        kinds_a = [kind for kind, _ in a.trace.order]
        kinds_b = [kind for kind, _ in b.trace.order]
        if kinds_a != kinds_b:
            return None
        return cls(storage, a.trace, limit)

    def peak(self, batch: int) -> int:
        storage = self.storage
        span = storage.q - storage.p
        raw = -((-(storage.nbytes_p * span + (storage.nbytes_q - storage.nbytes_p) * (batch - storage.p))) // span)
        sizes = np.maximum(raw, 0).tolist()
        model = copy.deepcopy(self.trace.allocator)
        older = dict(self.trace.blocks)
        handles: dict[int, int] = {}
        model.reset_peak()
        try:
            for kind, index in self.trace.order:
                if kind == 0:
                    handles[index] = model.malloc(sizes[index])
                elif kind == 1:
                    model.free(handles.pop(index))
                else:
                    block = older.pop(index, None)
                    if block is not None:
                        model.free(block)
        except AllocatorOutOfMemory:
            return self.limit + 1
        return model.stats().peak_reserved_bytes


def largest_fitting(model: CurveModel, limit: int, guess: int) -> int:
    """The largest B >= 1 with model.peak(B) <= limit (0 when none), found from `guess` with the
    same walk-and-bisect that verifies a guess on the device: the model is cheap to evaluate."""

    def fits(batch: int) -> TrialRecord:
        return TrialRecord(batch=batch, fits=model.peak(batch) <= limit, seconds=0.0)

    try:
        return search_from_guess(fits, max(1, guess), cap=MAX_PREDICTED_BATCH).max_micro_batch
    except NothingFitsError:
        return 0


def curve(model: CurveModel, upto: int, points: int = CURVE_POINTS) -> list[CurvePoint]:
    """The predicted peak at about `points` batch sizes from 1 to `upto`."""
    upto = max(upto, 2)
    sizes = sorted({1, upto, *np.unique(np.linspace(1, upto, points).round().astype(int)).tolist()})
    return [CurvePoint(batch=b, peak_bytes=model.peak(b)) for b in sizes]


def predict(a: Timeline, b: Timeline, limit: int, *, exact_storages: bool = True) -> tuple[int | None, CurveModel]:
    """Largest predicted batch for two timelines of the same op sequence (None: unbounded)."""
    envelope = EnvelopeModel.fit(a, b)
    first = envelope.largest(limit)
    storage = StorageModel.fit(a, b) if exact_storages else None
    if storage is None:
        return first, envelope
    if first is None:
        if not storage.grows:
            return None, storage
        # Per-sample tensors of a few bytes: the live bytes, rounded to blocks, are the same at
        # both probes, but the raw sizes grow, and the storage model rounds them at any size.
        first = 1
    live = largest_fitting(storage, limit, first)
    replay = ReplayModel.fit(a, b, storage, limit)
    if replay is None:
        return live, storage
    # Reserved is at least allocated: the live-bytes answer bounds the replayed one from above.
    return largest_fitting(replay, limit, max(live, 1)), replay


def allocated_ratio(record: TrialRecord) -> float | None:
    """Peak allocated / peak reserved of one trial: below 1 where an allocator caches and rounds
    blocks (CUDA), exactly 1 on the budget device."""
    if not record.peak_allocated_bytes or not record.peak_reserved_bytes:
        return None
    return min(1.0, record.peak_allocated_bytes / record.peak_reserved_bytes)


def caches_blocks(records: Sequence[TrialRecord]) -> bool:
    """Whether the device reserves more than it allocates (the CUDA caching allocator)."""
    return any((ratio := allocated_ratio(r)) is not None and ratio < 1 for r in records)


# Recording on a device -------------------------------------------------------------------------
class _AllocatedTimeline(TorchDispatchMode):
    """CUDA: the allocator's live bytes after each op (it already counts every tensor)."""

    def __init__(self, read: Callable[[], int], events: list[Event]) -> None:
        super().__init__()
        self.read = read
        self.events = events

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not host.active():  # the job's host-side work (its collate) is no op of the device's
            self.events.append(("op", str(func), self.read()))
            self.events.append(("site", host.code_site(), 0))
        return out


@contextmanager
def _cuda_timeline(device: ProbeDevice) -> Iterator[list[Event]]:
    events: list[Event] = []
    index = device.torch_device.index

    def read() -> int:
        return int(torch.cuda.memory_allocated(index))

    with _AllocatedTimeline(read, events):
        yield events


def recording(device: ProbeDevice) -> AbstractContextManager[list[Event]]:
    """Record a timeline of whatever runs in the block on `device`."""
    record = getattr(device, "record_timeline", None)
    if record is not None:
        context: AbstractContextManager[list[Event]] = record()
        return context
    if device.kind == "cuda":
        return _cuda_timeline(device)
    raise ValueError(f"cannot record a memory timeline on a {device.kind} device")


def record_trial(trial: TrialFn, device: ProbeDevice, batch: int) -> tuple[TrialRecord, Timeline | None]:
    """Run one trial while recording its timeline; no timeline when it ran out of memory."""
    base = device.live_bytes()
    snapshot = getattr(device, "allocator_snapshot", lambda: None)()
    with recording(device) as events:
        record = trial(batch)
    if not record.fits:
        return record, None
    timeline = parse_events(batch, base, events, snapshot)
    if not any(kind in ("born", "died") for kind, _, _ in events):
        timeline = Timeline(batch, timeline.ops, timeline.live, None, sites=timeline.sites)
    return record, timeline


# The predictor-seeded search -------------------------------------------------------------------
@dataclass
class PredictedOutcome:
    outcome: SearchOutcome
    prediction: Prediction
    model: CurveModel | None = None


def probe_ladder(granularity: int) -> tuple[int, ...]:
    """Probe sizes that the search itself could try: multiples of the granularity, never 1."""
    if granularity == 1:
        return PROBE_LADDER
    return tuple(granularity * k for k in (1, 2, 4))


def predicted_search(
    trial: TrialFn,
    device: ProbeDevice,
    *,
    start: int = 1,
    cap: int | None = None,
    granularity: int = 1,
    limit_bytes: int,
) -> PredictedOutcome:
    """Record timelines at two small sizes, predict, then verify with `search_from_guess`.

    Falls back to the plain `search` (reporting why) when the cap is below the probe sizes, a
    probe runs out of memory, or no pair of probes ran the same op sequence.
    """
    ladder = probe_ladder(granularity)
    known: dict[int, TrialRecord] = {}
    timelines: dict[int, Timeline] = {}
    reason: str | None = None
    pair: tuple[Timeline, Timeline] | None = None

    def probe(batch: int) -> bool:
        record, timeline = record_trial(trial, device, batch)
        known[batch] = record
        if timeline is not None:
            timelines[batch] = timeline
        return record.fits

    if cap is not None and cap < ladder[1]:
        reason = f"the cap {cap} is below the probe sizes {ladder[0]} and {ladder[1]}"
    # The larger probe runs first: on CUDA the first trial also allocates lazily created
    # workspaces, which must not pass for memory that grows with the batch.
    elif not probe(ladder[1]) or not probe(ladder[0]):
        failed = ladder[1] if not known[ladder[1]].fits else ladder[0]
        reason = f"probe batch {failed} did not fit: the answer is smaller than the probes"
    elif same_ops(timelines[ladder[0]], timelines[ladder[1]]):
        pair = (timelines[ladder[0]], timelines[ladder[1]])
    elif cap is not None and cap < ladder[2]:
        reason = (
            f"op sequences differ between batch {ladder[0]} and {ladder[1]} "
            f"({where_ops_differ([timelines[b] for b in ladder[:2]])}), and the cap is below {ladder[2]}"
        )
    elif not probe(ladder[2]):
        reason = (
            f"op sequences differ between batch {ladder[0]} and {ladder[1]} "
            f"({where_ops_differ([timelines[b] for b in ladder[:2]])}), and probe batch {ladder[2]} did not fit"
        )
    elif same_ops(timelines[ladder[1]], timelines[ladder[2]]):
        pair = (timelines[ladder[1]], timelines[ladder[2]])
    elif same_ops(timelines[ladder[0]], timelines[ladder[2]]):
        # The first trial (ladder[1]) ran once-only work: FSDP2 initializes lazily in the first
        # forward of a model that later trials reuse.
        pair = (timelines[ladder[0]], timelines[ladder[2]])
    else:
        reason = (
            f"op sequences differ between batch {ladder[0]}, {ladder[1]} and {ladder[2]}, so nothing can be "
            f"extrapolated: {where_ops_differ([timelines[b] for b in ladder])}"
        )

    probes = list(known.values())

    def cached(batch: int) -> TrialRecord:
        # Every size runs once: the verification reuses the probes and the first guess.
        if batch not in known:
            known[batch] = trial(batch)
        return known[batch]

    def on_grid(batch: int) -> int:
        return (batch if cap is None else min(batch, cap)) // granularity * granularity

    predicted: int | None = None
    first_guess: int | None = None
    points: list[CurvePoint] = []
    model: CurveModel | None = None
    if pair is not None:
        raw, model = predict(pair[0], pair[1], limit_bytes)
        if raw is None and isinstance(model, StorageModel):
            # Every storage has the same raw size at both probes: nothing depends on the batch.
            low, high = known[pair[0].batch], known[pair[1].batch]
            raise FlatMemoryError(
                f"memory does not grow with the batch: the timeline trials at batch {low.batch} and {high.batch} "
                f"both peak at {format_bytes(high.peak_allocated_bytes or 0)} and no tensor's size depends on the "
                f"batch, so there is no largest batch that fits: {MAKE_BATCH_HINT}"
            )
        if raw is None:
            # Live bytes rounded to the allocator's blocks: tiny per-sample tensors may not show at
            # the probes. The plain search finds out (it stops when memory does not grow at all).
            reason = f"memory did not grow between batch {pair[0].batch} and {pair[1].batch}: nothing to extrapolate"
        else:
            predicted = on_grid(raw)
            if caches_blocks(probes) and predicted >= granularity and not isinstance(model, ReplayModel):
                # CUDA: the timeline counts allocated bytes, the cap applies to reserved ones, and
                # their ratio at the small probes (mostly small-block segments and the cache) is
                # not the ratio at the answer. One trial at the guess measures it where it matters.
                first_guess = predicted
                first = cached(first_guess)
                ratio = allocated_ratio(first)
                if ratio is not None and ratio < 1:
                    refined = on_grid(largest_fitting(model, int(limit_bytes * ratio), first_guess))
                    # What the trial showed bounds the refinement: no retrying below a fit or above an OOM.
                    bounded = max(refined, first_guess) if first.fits else min(refined, first_guess - granularity)
                    predicted = max(bounded, granularity)
            points = curve(model, max(2 * max(predicted, 1), max(known)))

    if predicted is None:
        outcome = search(cached, start=start, cap=cap, granularity=granularity, limit_bytes=limit_bytes)
    else:
        outcome = search_from_guess(
            cached, max(predicted, granularity), cap=cap, granularity=granularity, limit_bytes=limit_bytes
        )
    # `known` holds every trial once, in the order they ran (probes first).
    outcome.trials = list(known.values())
    prediction = Prediction(
        predicted_max_micro_batch=predicted,
        probe_batches=[t.batch for t in probes],
        probe_trials=len(probes),
        exact=None if predicted is None else predicted == outcome.max_micro_batch,
        first_guess=first_guess,
        fallback_reason=reason,
        curve=points,
    )
    return PredictedOutcome(outcome, prediction, model)
