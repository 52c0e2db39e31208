"""The memory-curve predictor: two small trials predict the answer, two more verify it.

The peak memory of a training step is not affine in the batch size (the peak moves between
forward, backward and the optimizer step), but the live bytes after each individual op are. So we
record the live-bytes timeline of a whole trial (the same steps a trial runs) at two small batch
sizes p < q, check both ran the same op sequence (over the same optimizer steps, below), and predict

    peak(B) = max over ops t of (a_t + b_t·B)

then hand the largest B with peak(B) <= limit to `search.search_from_guess`, which verifies it
for real (B fits, B + granularity does not) and brackets from it when the prediction misses.
The answer keeps every guarantee of the plain search.

On the budget device the timeline also carries each storage's birth, death and raw size, so the
model can round every storage to the allocator's 512-byte blocks at the predicted size instead of
extrapolating rounded sums (which is off by a block or two for models whose per-sample tensors
are small, e.g. integer targets). With its model of CUDA's caching allocator it also carries the
order of those births and deaths and the model as the trial found it, and `ReplayModel` replays
them at each size to predict the reserved peak, on which the cap bites.

On CUDA the timeline trials record the caching allocator's own history
(`torch.cuda.memory._record_memory_history`, a `_snapshot()` before and after the trial), and
`parse_snapshots` turns it into the same timeline: each allocation's requested size, birth and
death, placed in the op that made it by the allocator's counts after each op, and a model of the
allocator built to the segments the first snapshot shows; `ReplayModel` then predicts the reserved
peak there too, if its replay reproduces the reserved peak each trial's segments showed. Where the
trace cannot be used (its history overflowed, expandable segments or a private pool hold memory,
settings the model does not follow) the timeline is the allocated bytes a dispatch mode reads
after each op; where the two trials' allocations do not pair, or the replay does not reproduce a
trial, the prediction is from live bytes alone. Either way the cap applies to reserved memory
(allocated plus the caching allocator's rounding and fragmentation), so the first guess is run as
a trial and the allocated/reserved ratio it measured, at the scale of the answer, refines the guess
before the verification (`Prediction.first_guess` says it ran). The trace's path is tested on the
budget device's model writing torch's format, and on the H100's recorded traces
(bench/replay_h100.py: the H100's answers, in four trials a loop); not yet live on a GPU.

Two trials pair when, over the same optimizer steps, they ran the same op sequence. Where the
device has a caching allocator, each trial runs until it settles, so two trials can run 3 and 4 steps:
`same_steps` cuts both after the steps both ran (the step ends an optimizer hook marked in the
timeline, `recording`; for a trace recorded without the marks, where the sequences part, if that is
a step's end). Their storages then pair storage for storage, or else by op and size class
(`pair_by_op`: within each op, in order, same lifetime, as large or larger by at most the batch
ratio; what is left over must be a temporary freed in its op, and the larger trial's keep their
size), and `ReplayModel` replays them (paired by class: the larger trial's allocations, in its order).

The timeline trials are real trials: they run the same steps under the same limit, so they are
reported first in the result's trial list, counted in the trial count (`Prediction.probe_trials`
says how many), and reused when the verification asks for the same size.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.devices import host
from autotune.devices.allocator import DEFAULT_CONFIG, AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel
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
    than the trial died, (3, i) `records[i]` = (serial, stream): another stream used the storage
    (record_stream), (4, 0) the streams' work completed (the model's `synchronize`); `streams`: the
    stream each storage of the trial was allocated on, where any was not the default one (0);
    `blocks`: the model's block of each storage alive when the trial began;
    `reserved_peak`: the reserved peak the trial itself showed, where the device recorded it apart
    from the model (CUDA's segment events), for the replay to be checked against; `reserved_peaks`:
    the same through each op (CUDA's trace with its ops), for a timeline cut to fewer steps."""

    order: tuple[tuple[int, int], ...]
    allocator: CachingAllocatorModel
    blocks: dict[int, int]
    reserved_peak: int | None = None
    reserved_peaks: tuple[int, ...] | None = None
    streams: tuple[int, ...] = ()
    records: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Timeline:
    """Live bytes after every op of one trial at one batch size, and the code that ran each op
    (`autotune.devices.host.code_site`: file, line, function; None where no Python code did).

    `step_ends`: how many ops had run when each optimizer step ended (recorded by an optimizer
    hook; empty where none was recorded); `steps`: the optimizer steps the trial ran (its record's),
    which tell where steps end when no hook recorded it (`same_steps`)."""

    batch: int
    ops: tuple[str, ...]
    live: tuple[int, ...]
    storages: StorageLog | None = None
    trace: AllocationTrace | None = None
    sites: tuple[Site | None, ...] = ()
    step_ends: tuple[int, ...] = ()
    steps: int | None = None


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
    step_ends: list[int] = []
    serial_of: dict[int, int] = {}
    streams: dict[int, int] = {}
    records: list[tuple[int, int]] = []
    for kind, what, value in events:
        if kind == "op":
            ops.append(str(what))
            live.append(value)
        elif kind == "site":
            sites.append(what)
        elif kind == "step":
            step_ends.append(len(ops))
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
        elif kind == "stream":
            streams[serial_of[what]] = value
        elif kind == "record" and what in serial_of:  # a storage older than the trial: not replayed
            order.append((3, len(records)))
            records.append((serial_of[what], value))
        elif kind == "sync":
            order.append((4, 0))
    log = StorageLog(base, tuple(born_at), tuple(died_at), tuple(nbytes), tuple(older))
    trace = None
    if allocator is not None:
        stream_of = tuple(streams.get(serial, 0) for serial in range(len(born_at))) if streams else ()
        trace = AllocationTrace(tuple(order), allocator[0], allocator[1], streams=stream_of, records=tuple(records))
    return Timeline(
        batch,
        tuple(ops),
        tuple(live),
        log,
        trace,
        tuple(sites) if len(sites) == len(ops) else (),
        step_ends=tuple(step_ends),
    )


# CUDA's allocation trace ----------------------------------------------------------------------
# An op's name, and the allocations and frees the caching allocator had counted since the trial
# began when the op returned (memory_stats' allocation.all.allocated and allocation.all.freed).
OpMark = tuple[str, int, int]
_OCCUPIED = ("active_allocated", "active_pending_free")  # a block the allocator cannot hand out


class UnusableTrace(ValueError):
    """Snapshots that do not describe a whole trial's allocations; the message says why."""


def parse_snapshots(
    batch: int,
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    *,
    device: int,
    limit_bytes: int,
    total_bytes: int | None = None,
    config: AllocatorConfig = DEFAULT_CONFIG,
    ops: Sequence[OpMark] | None = None,
    sites: Sequence[Site | None] = (),
    step_ends: Sequence[int] = (),
) -> Timeline:
    """Turn two `torch.cuda.memory._snapshot()`s, taken just before and just after a trial while
    the allocator recorded its history, into the trial's Timeline: each allocation's birth, death
    and requested size (the StorageLog), their order and the caching allocator's model built to the
    state the first snapshot shows (the AllocationTrace), so that `ReplayModel` can replay them.

    `ops`: the trial's ops with the allocator's counts after each (`OpMark`), to place each
    allocation and free in the op that made it; without them each is an op of its own ("alloc",
    "free"), and two trials pair when their allocations and frees came in the same order. The live
    bytes after each op are counted as `StorageModel` counts them (each request rounded to 512
    bytes), so that it reproduces them by construction. Raises UnusableTrace when the snapshots do
    not hold the whole trial on cuda:`device`, or show what the model cannot follow."""
    entries = _trial_entries(before, after, device)
    model = CachingAllocatorModel(limit_bytes, config, total_bytes=total_bytes)
    held, base, reserved = _take_over(model, before, device)
    handles = {address: handle for address, (handle, _, _) in held.items()}
    order: list[tuple[int, int]] = []
    steps: list[str] = []  # the allocations and frees in trace order: the ops when `ops` is None
    born: list[tuple[int, int]] = []  # per block of the trial: (its step, its number among the allocations)
    died: list[tuple[int, int] | None] = []  # (step, number among the frees) of its free, if requested
    nbytes: list[int] = []
    older: list[tuple[int, int, int]] = []  # (step, number among the frees, bytes) of blocks older than the trial
    live: dict[int, int] = {}  # address -> the trial's block there until its free completes
    allocs = frees = 0
    peak = reserved
    peaks = [peak]  # the reserved peak through each allocation (its segment came just before it)
    # Entries of another stream are kept in the one pool the model has; the real allocator hands a
    # stream's free blocks only to that stream, so the replay can share blocks it did not: the
    # reserved peak the segment entries show is what catches that (`ReplayModel.fit`).
    for entry in entries:
        action, address, size = entry.get("action"), entry.get("addr", 0), int(entry.get("size", 0))
        if action == "alloc":
            if address in live or address in held:
                raise UnusableTrace(f"an allocation at {address:#x}, where a block is in use")
            allocs += 1
            live[address] = len(nbytes)
            order.append((0, len(nbytes)))
            born.append((len(steps), allocs))
            died.append(None)
            nbytes.append(size)
            steps.append("alloc")
            peaks.append(peak)
        elif action == "free_requested":
            # Allocated bytes drop here (the live bytes); the block is reused only once its free
            # completes (the replay's order), which with one stream is the very next entry.
            frees += 1
            if address in live and died[live[address]] is None:
                died[live[address]] = (len(steps), frees)
            elif address in held and held[address][2]:
                handle, block, _ = held[address]
                older.append((len(steps), frees, block))
                held[address] = (handle, block, False)
            else:
                raise UnusableTrace(f"a free of {address:#x}, where no block is allocated")
            steps.append("free")
        elif action == "free_completed":
            if address in live and died[live[address]] is not None:
                order.append((1, live.pop(address)))
            elif address in held and not held[address][2]:
                del held[address]
                order.append((2, address))
            else:
                raise UnusableTrace(f"a completed free of {address:#x}, whose free was not requested")
        elif action in ("segment_alloc", "segment_map"):
            # The model makes its own segments: these only say what the trial reserved.
            reserved += size
            peak = max(peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "oom":
            raise UnusableTrace("an allocation of the trial ran out of memory, and the trial went on")
    still = set(live) | set(held)
    shown = {b["address"] for seg in _segments(after, device) for b in seg["blocks"] if b["state"] in _OCCUPIED}
    if still != shown:
        raise UnusableTrace(
            f"the trace ends with {len(still)} blocks in use and the snapshot after the trial shows {len(shown)}: "
            "it misses entries"
        )
    if ops is None:
        names = tuple(steps)
        born_at = [step for step, _ in born]
        died_at = [-1 if d is None else d[0] for d in died]
        older_at = [step for step, _, _ in older]
        allocs_by = list(itertools.accumulate(int(step == "alloc") for step in steps))
    else:
        counted_allocs = [n for _, n, _ in ops]
        counted_frees = [n for _, _, n in ops]
        if counted_allocs != sorted(counted_allocs) or counted_frees != sorted(counted_frees):
            raise UnusableTrace("the allocator's counts went down between two ops")
        if ops and (counted_allocs[-1] > allocs or counted_frees[-1] > frees):
            raise UnusableTrace("the allocator counted more allocations or frees than its trace holds")
        names = tuple(name for name, _, _ in ops)
        # The op an allocation belongs to: the first whose count includes it (len(ops): after the last).
        born_at = [bisect_left(counted_allocs, n) for _, n in born]
        died_at = [-1 if d is None else bisect_left(counted_frees, d[1]) for d in died]
        older_at = [bisect_left(counted_frees, n) for _, n, _ in older]
        allocs_by = counted_allocs
    log = StorageLog(
        base,
        tuple(born_at),
        tuple(died_at),
        tuple(nbytes),
        tuple((at, block) for at, (_, _, block) in zip(older_at, older, strict=True)),
    )
    counted = StorageModel(
        batch,
        batch + 1,  # any other size: at `batch` the sizes are the recorded ones
        len(names),
        base,
        np.asarray(log.born_at, dtype=np.int64),
        np.asarray(log.died_at, dtype=np.int64),
        np.asarray(nbytes, dtype=np.int64),
        np.asarray(nbytes, dtype=np.int64),
        np.asarray(older_at, dtype=np.int64),
        np.asarray([block for _, _, block in older], dtype=np.int64),
    )
    trace = AllocationTrace(
        tuple(order), model, handles, reserved_peak=peak, reserved_peaks=tuple(peaks[n] for n in allocs_by)
    )
    live_bytes = tuple(counted.timeline(batch).tolist())
    return Timeline(
        batch,
        names,
        live_bytes,
        log,
        trace,
        tuple(sites) if len(sites) == len(names) else (),
        step_ends=tuple(step_ends),
    )


def _device_trace(snapshot: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    traces = snapshot.get("device_traces", [])
    if device >= len(traces):
        raise UnusableTrace(f"the snapshot has no trace for cuda:{device}")
    return list(traces[device])


def _trial_entries(before: Mapping[str, Any], after: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    """The entries recorded between the two snapshots. Taking a snapshot records a 'snapshot'
    entry, which marks where the trial begins: torch 2.11 records it after copying the trace it
    returns (the H100's traces: the first snapshot's entry opens what the second returns, which ends
    without its own), earlier versions before (each trace ends with its own). Either way the
    trial's entries follow the first snapshot's entry, up to the end or the second's. Where the ring
    buffer (max_entries) wrapped during the trial, the entries before it are no longer where they
    were, and the trial's first entries are gone."""
    first, last = _device_trace(before, device), _device_trace(after, device)
    # Where the first snapshot's entry is: ending the trace it returned, or just after it.
    mark = len(first) - 1 if first and first[-1].get("action") == "snapshot" else len(first)
    if len(last) <= mark or last[mark].get("action") != "snapshot":
        if not last or all(entry.get("action") != "snapshot" for entry in last):
            raise UnusableTrace("the allocator's history was not recorded around the trial")
        raise UnusableTrace("the allocator's history lost the trial's first entries (more than max_entries)")
    if mark and last[mark - 1] != first[mark - 1]:  # the entries before it moved: the buffer wrapped
        raise UnusableTrace("the allocator's history lost the trial's first entries (more than max_entries)")
    end = len(last) - 1 if last[-1].get("action") == "snapshot" and len(last) - 1 > mark else len(last)
    return last[mark + 1 : end]


def _segments(snapshot: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    # Other devices have allocators of their own: nothing of theirs can land on this one.
    return [seg for seg in snapshot.get("segments", []) if seg.get("device", device) == device]


def _take_over(
    model: CachingAllocatorModel, before: Mapping[str, Any], device: int
) -> tuple[dict[int, tuple[int, int, bool]], int, int]:
    """Build `model` to the segments the snapshot shows: (per occupied block, by address: its handle
    in the model, its size and whether it is allocated rather than waiting for its free to
    complete), the bytes allocated, the bytes reserved."""
    held: dict[int, tuple[int, int, bool]] = {}
    allocated = reserved = 0
    for segment in _segments(before, device):
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            raise UnusableTrace("a private pool (a CUDA graph's, a MemPool) holds memory, and the model has none")
        if segment.get("is_expandable", False):
            raise UnusableTrace("an expandable segment holds memory, and the model cannot take one over")
        blocks = segment["blocks"]
        try:
            handles = iter(
                model.add_segment(
                    segment["address"],
                    [(b["size"], b["state"] in _OCCUPIED) for b in blocks],
                    small=segment["segment_type"] == "small",
                )
            )
        except ValueError as exc:
            raise UnusableTrace(f"the snapshot's segments cannot be taken over: {exc}") from exc
        for block in blocks:
            if block["state"] in _OCCUPIED:
                in_use = block["state"] == "active_allocated"
                held[block["address"]] = (next(handles), block["size"], in_use)
                allocated += block["size"] if in_use else 0
        reserved += segment["total_size"]
    return held, allocated, reserved


def same_ops(a: Timeline, b: Timeline) -> bool:
    return a.ops == b.ops


def cut(timeline: Timeline, ops: int, steps: int | None = None) -> Timeline:
    """The timeline of the trial's first `ops` ops (`steps` optimizer steps, where known): storages
    born later left out, deaths later undone (alive at the end), the trace's order and reserved peak
    taken through that op. Where the trace has no reserved peak per op, the cut has none to check."""
    if ops >= len(timeline.ops):
        return timeline
    log, trace = timeline.storages, timeline.trace
    storages = None
    kept = 0
    if log is not None:
        kept = bisect_left(log.born_at, ops)  # storages are numbered in the order they were born
        died = tuple(d if 0 <= d < ops else -1 for d in log.died_at[:kept])
        older = tuple((at, n) for at, n in log.older_deaths if at < ops)
        storages = StorageLog(log.base, log.born_at[:kept], died, log.nbytes[:kept], older)
    if trace is not None and storages is not None and log is not None:
        order: list[tuple[int, int]] = []
        older_deaths = iter(log.older_deaths)  # the (2, key) entries, in the order they died
        passed = False  # an entry of the order (which is in time) lay past the cut
        for kind, index in trace.order:
            if kind == 0:
                keep = index < kept
            elif kind == 1:
                keep = index < kept and storages.died_at[index] >= 0
            elif kind == 2:
                keep = next(older_deaths)[0] < ops
            else:  # a record_stream or a synchronize: kept up to the first entry past the cut (one
                keep = not passed  # after the last kept allocation or free changes no peak)
            passed = passed or not keep
            if keep:
                order.append((kind, index))
        peaks = trace.reserved_peaks
        trace = AllocationTrace(
            tuple(order),
            trace.allocator,
            trace.blocks,
            reserved_peak=None if peaks is None or not ops else peaks[ops - 1],
            reserved_peaks=None if peaks is None else peaks[:ops],
            streams=trace.streams[:kept],
            records=trace.records,
        )
    else:
        trace = None
    ends = tuple(end for end in timeline.step_ends if end <= ops)
    return Timeline(
        timeline.batch,
        timeline.ops[:ops],
        timeline.live[:ops],
        storages,
        trace,
        timeline.sites[:ops],
        step_ends=ends,
        steps=steps if steps is not None else (len(ends) if ends else None),
    )


def same_steps(a: Timeline, b: Timeline) -> tuple[Timeline, Timeline]:
    """The two trials' timelines over the same optimizer steps.

    The settle rule runs each trial until the caching allocator settles, so two trials can run
    different numbers of steps (3 and 4 on the H100): their op sequences then differ by whole steps,
    not by anything the workload does at each size. Both are cut after the steps both ran: at the
    recorded step ends where an optimizer hook recorded them (`recording`), else where the two
    sequences part, provided that is a step's end: the longer trial's next ops repeat its step
    before (a step being (its ops - the other's) / (its steps - the other's) ops). Timelines that
    ran the same steps, or cannot be cut so, come back as they are."""
    if a.ops == b.ops:
        return a, b
    if a.step_ends and b.step_ends:
        steps = min(len(a.step_ends), len(b.step_ends))
        if len(a.step_ends) == len(b.step_ends):
            return a, b
        return cut(a, a.step_ends[steps - 1], steps), cut(b, b.step_ends[steps - 1], steps)
    if a.steps is None or b.steps is None or a.steps == b.steps:
        return a, b
    (short, fewer), (long, more) = sorted(((a, a.steps), (b, b.steps)), key=lambda pair: pair[1])
    per_step, rest = divmod(len(long.ops) - len(short.ops), more - fewer)
    if rest or per_step <= 0:
        return a, b
    end = next((i for i, (x, y) in enumerate(zip(short.ops, long.ops, strict=False)) if x != y), len(short.ops))
    if end < per_step or long.ops[end - per_step : end] != long.ops[end : end + per_step]:
        return a, b
    return cut(a, end, fewer), cut(b, end, fewer)


def paired(a: Timeline, b: Timeline) -> tuple[Timeline, Timeline] | None:
    """`a` and `b` over the same steps (`same_steps`), if they then ran the same op sequence."""
    a, b = same_steps(a, b)
    return (a, b) if same_ops(a, b) else None


def aligned(timelines: Sequence[Timeline]) -> list[Timeline]:
    """Timelines over the steps all of them ran, where each recorded its step ends (for saying
    where they differ: not in steps that only some of them ran)."""
    if len(timelines) < 2 or not all(t.step_ends for t in timelines):
        return list(timelines)
    steps = min(len(t.step_ends) for t in timelines)
    return [cut(t, t.step_ends[steps - 1], steps) for t in timelines]


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


def pair_by_op(a: Timeline, b: Timeline) -> np.ndarray | None:
    """Pair the storages of two trials of the same op sequence by op and size class, not storage
    by storage: for each storage of the larger trial `b`, the bytes of its partner in `a`, or its
    own bytes where it has none; None when they do not pair.

    The rule: within each op, `a`'s storages, in the order they were made, each pair with the first
    storage of `b`'s made by the same op, after the previous pair's, that is of its size class and
    lifetime: as large or larger, by at most the ratio of the batch sizes (plus a 512-byte block),
    and freed in the same op (or alive at the end). What is left unpaired must be a temporary of its
    op (freed in the op that made it: no live bytes after any op), as a reduction's workspace that
    appears from some size on: `b`'s keep their size at every batch, `a`'s are dropped. Any other
    storage left unpaired, and the trials do not pair."""
    la, lb = a.storages, b.storages
    assert la is not None and lb is not None
    made_a: dict[int, list[int]] = {}
    made_b: dict[int, list[int]] = {}
    for serial, op in enumerate(la.born_at):
        made_a.setdefault(op, []).append(serial)
    for serial, op in enumerate(lb.born_at):
        made_b.setdefault(op, []).append(serial)
    partners = np.asarray(lb.nbytes, dtype=np.int64).copy()

    def temporary(log: StorageLog, serials: Sequence[int], op: int) -> bool:
        return all(log.died_at[s] == op for s in serials)

    for op in made_a.keys() | made_b.keys():
        mine, theirs = made_a.get(op, []), made_b.get(op, [])
        start = 0
        for serial in mine:
            size, death = la.nbytes[serial], la.died_at[serial]
            match = next(
                (
                    k
                    for k in range(start, len(theirs))
                    if lb.died_at[theirs[k]] == death
                    and size <= lb.nbytes[theirs[k]]
                    and lb.nbytes[theirs[k]] * a.batch <= size * b.batch + ROUNDING * a.batch
                ),
                None,
            )
            if match is None:
                if death != op:
                    return None
                continue
            if not temporary(lb, theirs[start:match], op):
                return None
            partners[theirs[match]] = size
            start = match + 1
        if not temporary(lb, theirs[start:], op):
            return None
    return partners


@dataclass(frozen=True)
class StorageModel:
    """Live bytes rebuilt storage by storage, each rounded to the allocator's block at size B.

    Exact on the budget device when every storage's raw size is affine in the batch. The storages
    are the larger trial's (`q`'s), each sized at B on the line through its size there and its
    partner's at `p`: the same storage where the two trials' storages correspond one to one
    (`one_to_one`), else the partner `pair_by_op` found, and its own size where it has none."""

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
    one_to_one: bool = True

    @classmethod
    def fit(cls, a: Timeline, b: Timeline) -> StorageModel | None:
        """None when the two trials' storages do not pair (`pair_by_op`), or the model does not
        reproduce both trials' live bytes."""
        la, lb = a.storages, b.storages
        if la is None or lb is None or len(a.ops) != len(b.ops):
            return None
        if la.base != lb.base or la.older_deaths != lb.older_deaths:
            return None
        one_to_one = la.born_at == lb.born_at and la.died_at == lb.died_at
        if not one_to_one and a.batch > b.batch:
            return cls.fit(b, a)  # the larger trial's storages are the ones kept
        partners = np.asarray(la.nbytes, dtype=np.int64) if one_to_one else pair_by_op(a, b)
        if partners is None:
            return None
        older = lb.older_deaths
        model = cls(
            a.batch,
            b.batch,
            len(b.ops),
            lb.base,
            np.asarray(lb.born_at, dtype=np.int64),
            np.asarray(lb.died_at, dtype=np.int64),
            partners,
            np.asarray(lb.nbytes, dtype=np.int64),
            np.asarray([i for i, _ in older], dtype=np.int64),
            np.asarray([n for _, n in older], dtype=np.int64),
            one_to_one,
        )
        # The model must reproduce both recordings exactly, or it describes something else. (What
        # `pair_by_op` leaves unpaired is freed in the op that made it: no live bytes after an op.)
        if model.timeline(a.batch).tolist() != list(a.live) or model.timeline(b.batch).tolist() != list(b.live):
            return None
        return model

    def raw_sizes(self, batch: int) -> np.ndarray:
        """Each storage's bytes at `batch`, on the line through its sizes at p and q (rounded up)."""
        span = self.q - self.p
        return np.maximum(-((-(self.nbytes_p * span + (self.nbytes_q - self.nbytes_p) * (batch - self.p))) // span), 0)

    def timeline(self, batch: int) -> np.ndarray:
        sizes = -((-self.raw_sizes(batch)) // ROUNDING) * ROUNDING
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
class Replayed:
    """What the allocator's model did with one replay: whether every allocation fitted, the reserved
    peak, the allocation retries (the cache freed and the segment asked again), and for one that did
    not fit: the request, the segment it asked for (what CUDA's message names) and what was reserved
    then."""

    fits: bool
    reserved_peak: int
    retries: int
    requested: int | None = None
    segment: int | None = None
    reserved: int | None = None


@dataclass(frozen=True)
class ReplayModel:
    """The trial's allocations replayed through the caching allocator's model at batch B: each
    storage at its size at B (as `StorageModel` scales it), born and freed in the order the trial
    ran them, starting from the allocator as the trial found it. `peak(B)` is the reserved peak, or
    one byte over the limit when the allocator model runs out (after freeing its cache and retrying,
    as the real one does): the limit bites on reserved memory, not on the live bytes the other
    models count. The order is a trial's own: the larger one's where the storages paired by class
    (those `StorageModel` keeps), else the smaller one's."""

    storage: StorageModel
    trace: AllocationTrace
    limit: int

    @classmethod
    def fit(cls, a: Timeline, b: Timeline, storage: StorageModel, limit: int) -> ReplayModel | None:
        if a.trace is None or b.trace is None:
            return None
        if storage.one_to_one:
            kinds_a = [kind for kind, _ in a.trace.order]
            kinds_b = [kind for kind, _ in b.trace.order]
            if kinds_a != kinds_b:
                return None
            replay = cls(storage, a.trace, limit)
            checked: tuple[Timeline, ...] = (a, b)
        else:
            larger = a if a.batch == storage.q else b
            assert larger.trace is not None
            replay = cls(storage, larger.trace, limit)
            # The smaller trial did not make the larger one's temporaries: only the larger one's
            # allocations are replayed as they were.
            checked = (larger,)
        # As the storage model must reproduce the live bytes, the replay must reproduce the reserved
        # peak each trial showed: where it does not (other streams, a setting it does not follow),
        # it describes another allocator.
        for timeline in checked:
            assert timeline.trace is not None
            shown = timeline.trace.reserved_peak
            if shown is not None and replay.peak(timeline.batch) != shown:
                return None
        return replay

    def peak(self, batch: int) -> int:
        replayed = self.run(batch)
        return replayed.reserved_peak if replayed.fits else self.limit + 1

    def run(self, batch: int, limit: int | None = None) -> Replayed:
        """Replay the allocations at `batch`, under `limit` rather than the trial's where given (a
        size at the allocator's edge runs again with less: `autotune.engine.confirm`)."""
        sizes = self.storage.raw_sizes(batch).tolist()
        model = copy.deepcopy(self.trace.allocator)
        older = dict(self.trace.blocks)
        if limit is not None and limit != model.limit_bytes:
            model, older = _capped(model, older, limit)
        retries = model.stats().num_alloc_retries
        handles: dict[int, int] = {}
        streams = self.trace.streams
        model.reset_peak()
        try:
            for kind, index in self.trace.order:
                if kind == 0:
                    handles[index] = model.malloc(sizes[index], streams[index] if streams else 0)
                elif kind == 1:
                    model.free(handles.pop(index))
                elif kind == 2:
                    block = older.pop(index, None)
                    if block is not None:
                        model.free(block)
                elif kind == 3:
                    serial, stream = self.trace.records[index]
                    if serial in handles:
                        model.record_stream(handles[serial], stream)
                else:
                    model.synchronize()
        except AllocatorOutOfMemory as exc:
            stats = model.stats()
            return Replayed(
                False,
                stats.peak_reserved_bytes,
                stats.num_alloc_retries - retries,
                requested=exc.requested,
                segment=exc.alloc_size,
                reserved=exc.stats.reserved_bytes,
            )
        stats = model.stats()
        return Replayed(True, stats.peak_reserved_bytes, stats.num_alloc_retries - retries)


def _capped(
    model: CachingAllocatorModel, blocks: dict[int, int], limit: int
) -> tuple[CachingAllocatorModel, dict[int, int]]:
    """The model's segments and blocks in a model capped at `limit` (its other settings kept), and
    `blocks`' handles there. Raises ValueError for a model whose segments cannot be taken over
    (expandable segments)."""
    capped = CachingAllocatorModel(
        limit, model.config, total_bytes=model.total_bytes, outside_bytes=model.outside_bytes
    )
    handle_of: dict[int, int] = {}
    for address, small, parts in model.layout():
        handles = iter(capped.add_segment(address, [(size, h is not None) for _, size, h in parts], small=small))
        for _, _, handle in parts:
            if handle is not None:
                handle_of[handle] = next(handles)
    return capped, {key: handle_of[handle] for key, handle in blocks.items() if handle in handle_of}


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
# Enough for a trial of a large model's several steps; a trial with more entries than this loses
# its first ones, and the predictor falls back to the live bytes (`_trial_entries`).
HISTORY_ENTRIES = 1 << 20


class _AllocatedTimeline(TorchDispatchMode):
    """CUDA: the allocator's live bytes after each op (it already counts every tensor), and how
    many allocations and frees it had counted by then."""

    def __init__(self, read: Callable[[], tuple[int, int, int]], events: list[Event]) -> None:
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
            allocated, allocs, frees = self.read()
            self.events.append(("op", str(func), allocated))
            self.events.append(("site", host.code_site(), 0))
            self.events.append(("count", (allocs, frees), 0))
        return out


def _cuda_counts(index: int | None) -> tuple[int, int, int]:
    """Allocated bytes, allocations and frees so far: one memory_stats() call, as memory_allocated()
    itself makes."""
    stats = torch.cuda.memory_stats(index)
    return (
        int(stats.get("allocated_bytes.all.current", 0)),
        int(stats.get("allocation.all.allocated", 0)),
        int(stats.get("allocation.all.freed", 0)),
    )


def _start_history() -> bool:
    """Record the caching allocator's history (its trace, without stacks), unless it is already
    recorded: that recording (a profiler's, the job's own) is someone else's to configure and end."""
    recording_already = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if recording_already is not None and recording_already():
        return False
    try:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=HISTORY_ENTRIES)
    except RuntimeError:  # an allocator with no history (backend:cudaMallocAsync)
        return False
    return True


@contextmanager
def _cuda_timeline(device: ProbeDevice) -> Iterator[list[Event]]:
    """The per-op allocated bytes, and, recorded around them, the allocator's trace: a snapshot
    before and one after (("trace", (before, after, counts at the start), 0), last)."""
    events: list[Event] = []
    index = device.torch_device.index
    tracing = _start_history()
    try:
        before = torch.cuda.memory._snapshot() if tracing else None
        _, allocs, frees = _cuda_counts(index)
        with _AllocatedTimeline(lambda: _cuda_counts(index), events):
            yield events
        if before is not None:
            events.append(("trace", (before, torch.cuda.memory._snapshot(), (allocs, frees)), 0))
    finally:
        if tracing:
            torch.cuda.memory._record_memory_history(None)  # which also empties the history


def recording(device: ProbeDevice) -> AbstractContextManager[list[Event]]:
    """Record a timeline of whatever runs in the block on `device`, with the end of each optimizer
    step marked (("step", None, 0), by a hook on every torch optimizer's step) for `same_steps`."""
    record = getattr(device, "record_timeline", None)
    if record is not None:
        context: AbstractContextManager[list[Event]] = record()
    elif device.kind == "cuda":
        context = _cuda_timeline(device)
    else:
        raise ValueError(f"cannot record a memory timeline on a {device.kind} device")
    return _marking_steps(context)


@contextmanager
def _marking_steps(context: AbstractContextManager[list[Event]]) -> Iterator[list[Event]]:
    with context as events:

        def stepped(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            events.append(("step", None, 0))

        handle = register_optimizer_step_post_hook(stepped)
        try:
            yield events
        finally:
            handle.remove()


def traced_timeline(batch: int, device: ProbeDevice, events: Sequence[Event]) -> Timeline:
    """The Timeline of a CUDA trial from its trace (`parse_snapshots`), its allocations placed in
    the ops `_cuda_timeline` recorded. Raises UnusableTrace when it has none or cannot be used."""
    index = device.torch_device.index
    return timeline_of_trace(
        batch,
        events,
        device=torch.cuda.current_device() if index is None else index,
        limit_bytes=device.limit_bytes,
        total_bytes=device.total_bytes,
        allocator_config=device.allocator_config,
    )


def timeline_of_trace(
    batch: int,
    events: Sequence[Event],
    *,
    device: int,
    limit_bytes: int,
    total_bytes: int | None,
    allocator_config: str | None,
) -> Timeline:
    """`traced_timeline` of events recorded on cuda:`device` (here, or on a GPU and kept: the
    H100's traces in bench/results replay on the CPU through this)."""
    recorded = next((what for kind, what, _ in events if kind == "trace"), None)
    if recorded is None:
        raise UnusableTrace("no trace was recorded (the allocator's history is off, or already recorded)")
    before, after, (allocs, frees) = recorded
    try:
        config = AllocatorConfig.parse(allocator_config)
    except ValueError as exc:
        raise UnusableTrace(f"the model does not follow the allocator's settings: {exc}") from exc
    ops: list[OpMark] = []
    sites: list[Site | None] = []
    step_ends: list[int] = []
    name = ""
    for kind, what, _ in events:
        if kind == "op":
            name = str(what)
        elif kind == "site":
            sites.append(what)
        elif kind == "count":
            ops.append((name, what[0] - allocs, what[1] - frees))
        elif kind == "step":
            step_ends.append(len(ops))
    return parse_snapshots(
        batch,
        before,
        after,
        device=device,
        limit_bytes=limit_bytes,
        total_bytes=total_bytes,
        config=config,
        ops=ops,
        sites=sites,
        step_ends=step_ends,
    )


def record_trial(trial: TrialFn, device: ProbeDevice, batch: int) -> tuple[TrialRecord, Timeline | None]:
    """Run one trial while recording its timeline; no timeline when it ran out of memory."""
    base = device.live_bytes()
    snapshot = getattr(device, "allocator_snapshot", lambda: None)()
    with recording(device) as events:
        record = trial(batch)
    if not record.fits:
        return record, None
    if any(kind == "trace" for kind, _, _ in events):
        try:
            return record, dataclasses.replace(traced_timeline(batch, device, events), steps=record.steps)
        except UnusableTrace:
            # The per-op allocated bytes below stand in: predicted from live bytes, the guess is
            # then refined by one trial's allocated/reserved ratio (`predicted_search`).
            pass
    timeline = dataclasses.replace(parse_events(batch, base, events, snapshot), steps=record.steps)
    if not any(kind in ("born", "died") for kind, _, _ in events):
        timeline = dataclasses.replace(timeline, storages=None, trace=None)
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
    elif (pair := paired(timelines[ladder[0]], timelines[ladder[1]])) is not None:
        pass
    elif cap is not None and cap < ladder[2]:
        reason = (
            f"op sequences differ between batch {ladder[0]} and {ladder[1]} "
            f"({where_ops_differ(aligned([timelines[b] for b in ladder[:2]]))}), and the cap is below {ladder[2]}"
        )
    elif not probe(ladder[2]):
        reason = (
            f"op sequences differ between batch {ladder[0]} and {ladder[1]} "
            f"({where_ops_differ(aligned([timelines[b] for b in ladder[:2]]))}), and probe batch {ladder[2]} did "
            "not fit"
        )
    elif (pair := paired(timelines[ladder[1]], timelines[ladder[2]])) is not None:
        pass
    elif (pair := paired(timelines[ladder[0]], timelines[ladder[2]])) is not None:
        # The first trial (ladder[1]) ran once-only work: FSDP2 initializes lazily in the first
        # forward of a model that later trials reuse.
        pass
    else:
        reason = (
            f"op sequences differ between batch {ladder[0]}, {ladder[1]} and {ladder[2]}, so nothing can be "
            f"extrapolated: {where_ops_differ(aligned([timelines[b] for b in ladder]))}"
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
