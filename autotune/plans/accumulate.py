"""The accumulation helper: per micro-step loss weights, the optimizer-step schedule and DDP's no_sync.

Owns what a training loop needs to turn a plan's micro-batches into gradients equal to the
gradient of one big batch:

    for step in accumulate(loader, plan):
        x, y = step.batch
        with step.sync_context(model):  # model.no_sync() except on the window's last micro-step
            step.scale(loss_fn(model(x), y)).backward()  # loss_fn: mean over the micro-batch
        if step.should_step:
            optimizer.step()
            optimizer.zero_grad()

A window is the micro-batches accumulated into one optimizer step (`plan.accumulation_steps` of
them, fewer at the end of an epoch). Each micro-step's weight divides by what is actually in its
window, counted by `count` (samples by default, or tokens), never by the configured step count:
the naive `loss / steps` is wrong for a short last window and for token-weighted losses. A window's
total must be known before its first backward. With a Plan, samples as the count, and a loader
whose length says how many samples it yields (a DataLoader over a sized dataset, a
`PlanBatchSampler`, a list), the totals come from the plan's window sizes and that length, and the
micro-batches are read one at a time: no more of them is held than the probe counted. Otherwise
(tokens, a bare step count, an iterable of unknown length) the helper reads the whole window
first, so one window of micro-batches is held at a time: keep the loader's batches on the host and
move each micro-batch to the device where it is used (a warning says so when they are not), or
probe with `--prefetch` (steps - 1) so that the answer counts them.

Losses, with n = count(micro-batch) and N = the window's total (over all ranks with `AcrossRanks`):
    mean over the n units  -> step.scale(loss)                   == loss * n / N
    sum over the n units   -> step.scale(loss, reduction="sum")  == loss / N
Both make the accumulated gradient that of the mean over all N units of the window. With
`AcrossRanks` both are also multiplied by the world size, undoing DDP's average over ranks.

The weight arithmetic is pure functions; nothing here imports torch at import time, so
`import autotune` stays light.
"""

from __future__ import annotations

import array
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from autotune.errors import AutotuneError, ConfigError, DoubleScalingError, RunOutOfMemoryError
from autotune.plans.batches import (
    PlanWindow,
    count_samples,
    epoch_samples,
    plan_micro_batches_of,
    plan_windows_of,
    split_batch,
)
from autotune.plans.plan import Plan

_log = logging.getLogger("autotune")

if TYPE_CHECKING:
    import torch

B = TypeVar("B")


def mean_loss_weights(counts: Sequence[int], total: int | None = None, world_size: int = 1) -> list[float]:
    """Weights for per-micro-batch mean losses: `world_size · n_i / total` for each count n_i.

    `total` defaults to the sum of `counts` (one rank); with DDP it is the window's total over all
    ranks, and the factor `world_size` undoes DDP's averaging of gradients across ranks. A window
    with nothing in it (total 0, e.g. all padding) gets weight 0: there is no mean to take.
    """
    total = _check(counts, total, world_size)
    if total == 0:
        return [0.0] * len(counts)
    return [world_size * n / total for n in counts]


def sum_loss_weight(total: int, world_size: int = 1) -> float:
    """Weight for a summed loss (sum over the units `count` counts): `world_size / total`."""
    if total < 0:
        raise ConfigError(f"a window total cannot be negative, got {total}")
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    return world_size / total if total else 0.0


def _check(counts: Sequence[int], total: int | None, world_size: int) -> int:
    if any(n < 0 for n in counts):
        raise ConfigError(f"micro-batch counts cannot be negative, got {list(counts)}")
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    local = sum(counts)
    if total is None:
        return local
    # The total over ranks includes this rank's window; less means the reduction is wrong.
    if total < local:
        raise ConfigError(f"window total {total} is less than this rank's own total {local}")
    return total


def _to_count(value: object) -> int:
    # Tensors (mask.sum()) become Python numbers; a fractional count is a bug in `count`.
    item = getattr(value, "item", None)
    number = item() if callable(item) else value
    if isinstance(number, bool) or not isinstance(number, int | float) or number != int(number) or number < 0:
        raise ConfigError(f"count must return a whole number of samples or tokens >= 0, got {value!r}")
    return int(number)


@dataclass(frozen=True)
class AcrossRanks:
    """Normalize by a window's total over all DDP ranks, not this rank's alone.

    Needed when ranks' windows hold different amounts (token counts, or an uneven last window):
    DDP averages gradients over ranks, which equals the global mean only if every rank's total
    is the same. `total` sums an integer over ranks (a collective: every rank must run the same
    number of windows, as DDP already requires). `group` and `device`, set by `from_process_group`,
    are also where `OOMGuard` agrees across ranks.
    """

    world_size: int
    total: Callable[[int], int]
    group: Any = field(default=None, compare=False)
    device: Any = field(default=None, compare=False)

    @classmethod
    def from_process_group(cls, device: torch.device | str | None = None, group: Any = None) -> AcrossRanks:
        """Sum with `torch.distributed.all_reduce` in the default (or given) process group.

        `device` must suit the backend: a CUDA device for NCCL, the CPU for gloo.
        """
        import torch
        import torch.distributed as dist

        def total(count: int) -> int:
            summed = torch.tensor([count], dtype=torch.int64, device=device)
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
            return int(summed.item())

        return cls(world_size=dist.get_world_size(group), total=total, group=group, device=device)


@dataclass(frozen=True)
class MicroStep(Generic[B]):
    """One micro-batch and what the loop must do with it."""

    batch: B
    window: int  # which window of the iterable, from 0
    index: int  # position within the window, from 0
    window_size: int  # micro-batches in this window (fewer than the plan's steps at the end)
    count: int  # samples or tokens in this micro-batch
    total: int  # samples or tokens in the whole window (over all ranks with AcrossRanks)
    weight: float  # multiply a mean loss by this
    sum_weight: float  # multiply a summed loss by this
    # The window holds fewer samples than the plan's (the end of the data): its optimizer step sees
    # a smaller effective batch. Only known when `accumulate` was given a Plan.
    short: bool = False

    @property
    def should_step(self) -> bool:
        """Whether this micro-step ends its window: run optimizer.step() and zero_grad() after it."""
        return self.index == self.window_size - 1

    def scale(self, loss: torch.Tensor, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """The loss to call backward() on: `loss` is the mean or the sum over the units `count` counts."""
        if reduction == "mean":
            return loss * self.weight
        if reduction == "sum":
            return loss * self.sum_weight
        raise ConfigError(f"reduction must be 'mean' or 'sum', got {reduction!r}")

    def sync_context(self, model: object) -> AbstractContextManager[object]:
        """Wrap this micro-step's forward and backward in it.

        `model.no_sync()` on all but the window's last micro-step, so DDP all-reduces gradients
        once per window instead of once per micro-step; a plain context for models without
        `no_sync` (a bare module) and on the last micro-step.
        """
        no_sync = getattr(model, "no_sync", None)
        if self.should_step or not callable(no_sync):
            return nullcontext()
        context: AbstractContextManager[object] = no_sync()
        return context


def _window_size(steps: Plan | int) -> int:
    size = steps.accumulation_steps if isinstance(steps, Plan) else steps
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"accumulation steps must be an integer >= 1, got {size!r}")
    return size


def _windows(batches: Iterable[B], size: int) -> Iterator[list[B]]:
    iterator = iter(batches)
    while window := list(islice(iterator, size)):
        yield window


def _plan_windows(batches: Iterable[B], steps: Plan | int) -> Iterator[PlanWindow]:
    """A plan's windows cut from whatever the loader yields; with a bare step count, its batches as they come."""
    if isinstance(steps, Plan):
        for window in plan_windows_of(batches, steps):
            if window.short:
                _log.info(
                    "autotune: the last window holds %d samples of the plan's %d per rank (the end of the data): "
                    "its optimizer step sees a smaller effective batch",
                    window.samples,
                    sum(steps.micro_batches),
                )
            yield window
        return
    for grouped in _windows(batches, _window_size(steps)):
        yield PlanWindow(grouped, 0, False)


def accumulate(
    batches: Iterable[B],
    steps: Plan | int,
    *,
    count: Callable[[B], int | torch.Tensor] | None = None,
    ranks: AcrossRanks | None = None,
) -> Iterator[MicroStep[B]]:
    """Yield a `MicroStep` per micro-batch, window after window: one window per optimizer step.

    With a Plan, the windows are the plan's micro-batches whatever batch size the loader has:
    the batches are read as one stream of samples and cut (or joined) to the plan's sizes, so
    every optimizer step sees exactly the plan's effective batch; the last window of the data
    may be short (`step.short`). A batch that cannot be cut is refused with the fix
    (`PlanBatchSampler`). With a bare number of steps, `steps` batches make a window as they come.

    `count(batch)` says how many units the loss averages over: samples by default (the first
    dimension), tokens for token-weighted losses (e.g. `lambda b: b["mask"].sum()`). With a Plan,
    samples and a loader that says its length, micro-batches are read one at a time (the windows'
    totals come from the plan and the length); otherwise a window's micro-batches are read before
    its first micro-step is yielded, to know the window's total.
    """
    samples = epoch_samples(batches) if isinstance(steps, Plan) and count is None else None
    if isinstance(steps, Plan) and samples is not None:
        yield from _streamed(batches, steps, samples, ranks)
        return
    held = False
    for number, window in enumerate(_plan_windows(batches, steps)):
        if not held:
            held = _warn_if_held_on_a_device(window.batches)
        yield from accumulate_window(number, window.batches, count=count, ranks=ranks, short=window.short)


def _streamed(batches: Iterable[B], plan: Plan, samples: int, ranks: AcrossRanks | None) -> Iterator[MicroStep[B]]:
    """`accumulate`'s micro-steps read one at a time: each window's total from the plan and the loader's length."""
    _refuse_double_scaling()
    world_size = ranks.world_size if ranks is not None else 1
    window_samples = sum(plan.micro_batches)
    current, total, index, steps_in_window = -1, 0, 0, 0
    for number, samples_in_window, batch, n in plan_micro_batches_of(batches, plan, samples):
        if number != current:
            current, index = number, 0
            total = ranks.total(samples_in_window) if ranks is not None else samples_in_window
            steps_in_window = _pieces(plan.micro_batches, samples_in_window)
            if samples_in_window < window_samples:
                _log.info(
                    "autotune: the last window holds %d samples of the plan's %d per rank (the end of the data): "
                    "its optimizer step sees a smaller effective batch",
                    samples_in_window,
                    window_samples,
                )
        yield MicroStep(
            batch=batch,
            window=number,
            index=index,
            window_size=steps_in_window,
            count=n,
            total=total,
            weight=mean_loss_weights([n], total, world_size)[0] if total else 0.0,
            sum_weight=sum_loss_weight(total, world_size),
            short=samples_in_window < window_samples,
        )
        index += 1


def _pieces(sizes: Sequence[int], samples: int) -> int:
    """How many of the plan's micro-batches a window of `samples` holds (the last one what is left)."""
    pieces = taken = 0
    for size in sizes:
        if taken >= samples:
            break
        pieces, taken = pieces + 1, taken + size
    return pieces


def _warn_if_held_on_a_device(window: list[Any]) -> bool:
    """Say once that a window read whole sits on an accelerator: the probe counted one micro-batch
    there, not the window. True once said (or when there is nothing to say after the first window)."""
    import torch
    from torch.utils import _pytree

    devices = {
        leaf.device
        for leaf in _pytree.tree_leaves(window)
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"
    }
    if devices and len(window) > 1:
        _log.warning(
            "autotune.accumulate read a window of %d micro-batches to count it before its first backward, and they "
            "are on %s: the probe counted one micro-batch there. Keep the loader's batches on the host and move each "
            "micro-batch to the device in the loop, or probe with --prefetch %d to count the window",
            len(window),
            ", ".join(sorted(str(d) for d in devices)),
            len(window) - 1,
        )
    return True


# The OOM guard ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShrinkEvent:
    """A window ran out of memory and is redone with smaller micro-batches."""

    window: int
    old_micro_batch: int
    new_micro_batch: int
    message: str
    micro_steps: int = 1  # micro-steps of the attempt that failed: more than 1 means gradients were alive
    # Under DDP: whether this rank ran out of memory (False: another rank did, and this one shrinks with it).
    ran_out: bool = True


class OOMGuard:
    """Accumulation that survives an out-of-memory error in a micro-step, gradient unchanged.

        guard = OOMGuard(model, on_shrink=print)
        for window in guard.windows(loader, plan):
            window.run(lambda step: step.scale(loss_fn(model(step.batch[0]), step.batch[1])).backward())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    `window.run(fn)` calls `fn(step)` for each micro-step (inside `step.sync_context(model)`, or
    `model.no_sync()` on every micro-step when the ranks agree); `fn` runs forward and backward.
    When one runs out of memory (a longer sequence than probed, fragmentation hours in), the
    guard releases the failed step after the `except` block (inside it the traceback still holds
    the step's tensors), drops the window's partial gradients, cuts the window's samples into
    micro-batches of half the size, and redoes the window. The weights
    divide by the same window total, so the optimizer sees exactly the gradient of the window's
    mean loss. The smaller size is kept for later windows; `on_shrink` (and the `autotune` logger)
    hear of each change, e.g. to report it to the service (`AutotuneClient.report_run_oom`).

    Under torch.distributed (initialized, more than one rank in `group`, the DDP model's or the
    default one), the ranks agree after every attempt at a window whether any of them ran out of
    memory, and all shrink together to the same size: see `_RankAgreement` for how, and why no
    rank is left waiting in a collective. `agree=False` turns that off, `agree=True` insists
    on it (an error without torch.distributed; also with one rank).

    The guard assumes the window starts with no gradients (`zero_grad(set_to_none=True)` after
    each optimizer step, the default). BatchNorm's running statistics see the failed part of the
    window twice.
    """

    def __init__(
        self,
        model: Any,
        *,
        on_shrink: Callable[[ShrinkEvent], None] | None = None,
        count: Callable[[Any], int | torch.Tensor] | None = None,
        ranks: AcrossRanks | None = None,
        group: Any = None,
        agree: bool | None = None,
    ) -> None:
        self.model = model
        self.on_shrink = on_shrink
        self.count = count
        self.ranks = ranks
        self.group = group if group is not None else getattr(ranks, "group", None)
        self.agree = agree
        self.micro_batch_limit: int | None = None  # set by the first shrink
        self.events: list[ShrinkEvent] = []
        self._agreement: _RankAgreement | None = None
        self._resolved = False

    def windows(self, batches: Iterable[B], steps: Plan | int) -> Iterator[GuardedWindow[B]]:
        """One `GuardedWindow` per optimizer step: the plan's micro-batches (cut from whatever the loader
        yields, as `accumulate` does), or `steps` batches as they come."""
        for number, window in enumerate(_plan_windows(batches, steps)):
            yield GuardedWindow(self, number, window.batches)

    def _ranks(self) -> _RankAgreement | None:
        """How this guard agrees across ranks, or None in a single process (decided at the first window)."""
        if not self._resolved:
            device = getattr(self.ranks, "device", None)
            self._agreement = _RankAgreement.resolve(self.model, self.agree, self.group, device)
            self._resolved = True
        return self._agreement

    def _micro_steps(self, number: int, window: list[Any], total: int | None) -> list[MicroStep[Any]]:
        pieces = window
        if self.micro_batch_limit is not None:
            pieces = [piece for batch in window for piece in split_batch(batch, self.micro_batch_limit)]
        return list(accumulate_window(number, pieces, count=self.count, ranks=self.ranks, total=total))

    def _current(self, window: list[Any]) -> int:
        """The micro-batch size the window runs at now."""
        return self.micro_batch_limit or max(count_samples(b) for b in window)

    def _shrink(self, number: int, window: list[Any], message: str, micro_steps: int = 1) -> None:
        current = self._current(window)
        if current <= 1:
            raise RunOutOfMemoryError(
                f"window {number} ran out of memory even with micro-batches of 1 sample: {message}"
            )
        self._record(ShrinkEvent(number, current, -(-current // 2), message, micro_steps))

    def _record(self, event: ShrinkEvent) -> None:
        self.micro_batch_limit = event.new_micro_batch
        self.events.append(event)
        _log.warning(
            "autotune: window %d ran out of memory at micro-batch %d; redoing it with micro-batches of %d (%s)",
            event.window,
            event.old_micro_batch,
            event.new_micro_batch,
            event.message,
        )
        if self.on_shrink is not None:
            self.on_shrink(event)


class GuardedWindow(Generic[B]):
    """The micro-batches of one optimizer step, run by `run` with the guard's recovery."""

    def __init__(self, guard: OOMGuard, number: int, batches: list[B]) -> None:
        self.guard = guard
        self.number = number
        self.batches = batches

    def run(self, micro_step: Callable[[MicroStep[B]], object]) -> list[object]:
        """Run `micro_step(step)` for each micro-step of the window; return what each returned
        (of the attempt that completed)."""
        from autotune.engine import oom

        guard = self.guard
        agreement = guard._ranks()
        total: int | None = None  # the window's total, summed over ranks once: a redo must not all-reduce again
        while True:
            failure: str | None = None
            error: Exception | None = None
            outputs: list[object] = []
            steps = guard._micro_steps(self.number, self.batches, total)
            total = steps[0].total if steps else 0
            try:
                if agreement is None:
                    for step in steps:
                        with step.sync_context(guard.model):
                            outputs.append(micro_step(step))
                    return outputs
                # Under DDP: no collective from here to `agree`, whatever the user's step does to DDP.
                agreement.before_attempt()
                for step in steps:
                    with agreement.no_sync():
                        outputs.append(micro_step(step))
                agreement.fill_gradients()
            except Exception as exc:
                reason = oom.classify(exc)
                if reason is not None and reason.kind is oom.OOMKind.OOM:
                    failure = reason.message
                    oom.release(exc)
                elif agreement is None:
                    raise
                else:
                    error = exc  # raised once the other ranks know, so that none waits for this one
            # Outside the `except` block: the failed step's tensors are gone with the traceback.
            if failure is not None:
                outputs = []
                _drop_gradients(guard.model)
            if agreement is None:
                guard._shrink(self.number, self.batches, failure or "", len(steps))
                continue
            current = guard._current(self.batches)
            verdict = agreement.agree(failure is not None, error is not None, current)
            if verdict.error_rank is not None:
                if error is not None:
                    raise error
                raise AutotuneError(
                    f"window {self.number}: rank {verdict.error_rank} failed with an error that is not out of "
                    "memory; every rank stops here instead of waiting for it in a collective"
                )
            if verdict.oom_rank is None:
                agreement.sync(verdict.used)
                return outputs
            if failure is None:  # another rank ran out of memory: this one redoes the window too
                outputs = []
                _drop_gradients(guard.model)
            message = failure if failure is not None else f"rank {verdict.oom_rank} ran out of memory"
            if verdict.size < 1:
                raise RunOutOfMemoryError(
                    f"window {self.number} ran out of memory on rank {verdict.oom_rank} even with micro-batches "
                    f"of 1 sample: {message}"
                )
            if failure is not None or verdict.size != current:  # a rank already at 1 sample redoes it as it is
                guard._record(ShrinkEvent(self.number, current, verdict.size, message, len(steps), failure is not None))


# Agreement across ranks ------------------------------------------------------------------------
def _has_distributed_parameters(model: Any) -> bool:
    """Whether any parameter is a DTensor (FSDP2's shards, tensor parallelism): its collectives run
    inside forward and backward, where no agreement can reach them."""
    from torch.distributed.tensor import DTensor

    parameters = getattr(model, "parameters", None)
    return callable(parameters) and any(isinstance(p, DTensor) for p in parameters())


@dataclass(frozen=True)
class _Verdict:
    oom_rank: int | None  # the lowest rank that ran out of memory, if any did
    error_rank: int | None  # the lowest rank that failed otherwise, if any did
    # The micro-batch this rank redoes the window with: when any rank ran out, every rank halves its
    # own (all shrink alike; a mixed plan's ranks keep their proportions); 0 when a rank that ran out
    # was at one sample already.
    size: int
    used: list[bool]  # per DDP parameter: whether any rank has a gradient for it


class _RankAgreement:
    """One all-reduce per attempt at a window, so that all ranks shrink together or none does.

    The deadlock this prevents: DDP all-reduces gradient buckets inside the backward of the
    window's last micro-step. A rank that runs out of memory before that backward, or in it before
    its last bucket, never enters (all of) those all-reduces, and the ranks that do wait forever;
    agreeing just before the last backward would still hang on an OOM inside that backward.

    So no collective runs while anything can run out of memory on one rank only:
    1. Before the attempt (every rank gets there: no user code has run since the last agreement),
       DDP's pending work that would otherwise run inside a forward is done or turned off: the
       bucket rebuild after its first synced iteration, and the buffer broadcast.
    2. Every micro-step runs under `no_sync()`, so forward and backward run no collective; an OOM
       anywhere in them (or in `fill_gradients`) is caught on that rank alone.
    3. `agree`: every rank, OOM or not, enters one MAX all-reduce of a small int64 vector of
       preallocated memory (filled through a Python buffer, so it allocates nothing and cannot
       itself run out): whether this rank ran out, whether it failed otherwise, whether it ran
       out with micro-batches of one sample, its rank if it ran out or failed (negated, to name
       the lowest) and, per DDP parameter, whether it has a gradient. When any rank ran out,
       every rank halves its own micro-batch (ranks of a mixed plan keep their proportions).
    4. Only when no rank failed, `sync` all-reduces the gradients in place (nothing to allocate)
       and divides them by the world size (DDP's average), then broadcasts DDP's buffers from
       rank 0 in place: the same number of collectives in the same order on every rank.
    Otherwise every rank drops its gradients and redoes the window at the agreed size, or every
    rank raises. The cost: one all-reduce of (5 + parameters) integers per attempt, and the
    gradient all-reduce runs after the backward instead of overlapping its last micro-step.
    Collectives in the user's own step (SyncBatchNorm, tensor parallelism) are beyond this.
    """

    _HEADER = 5  # ran out, failed otherwise, ran out at one sample, -lowest rank that ran out, -lowest that failed

    def __init__(self, model: Any, ddp: Any, group: Any, device: torch.device) -> None:
        import torch
        import torch.distributed as dist

        self.model, self.ddp, self.group = model, ddp, group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ignored: set[str] = getattr(ddp, "parameters_to_ignore", set())
        # The parameters DDP synchronizes: those that require grad and are not ignored.
        self.params: list[torch.Tensor] = (
            []
            if ddp is None
            else [p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]
        )
        self.used: list[bool] = [False] * len(self.params)
        # Allocated once: the agreement itself must not allocate (an OOM there would leave the others waiting).
        self.buffer = array.array("q", bytes(8 * (self._HEADER + len(self.params))))
        self.host = torch.frombuffer(self.buffer, dtype=torch.int64)
        self.flags = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)

    @classmethod
    def resolve(cls, model: Any, agree: bool | None, group: Any, device: Any) -> _RankAgreement | None:
        if agree is False:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if agree:
                raise ConfigError("OOMGuard(agree=True) needs torch.distributed: call init_process_group first")
            return None
        from torch.nn.parallel import DistributedDataParallel

        inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
        ddp = inner if isinstance(inner, DistributedDataParallel) else None
        if group is None and ddp is not None:
            group = ddp.process_group
        if agree is None and dist.get_world_size(group) < 2:
            return None
        if ddp is not None and (getattr(ddp, "static_graph", False) or getattr(ddp, "_delay_all_reduce_params", None)):
            raise ConfigError(
                "DDP(static_graph=True) (or delay_all_reduce_named_params) all-reduces inside backward even "
                "under no_sync, where an OOM on one rank would leave the others waiting; OOMGuard syncs the "
                "gradients itself: wrap the model without it"
            )
        if ddp is None and (callable(getattr(model, "no_sync", None)) or _has_distributed_parameters(inner)):
            # FSDP1 has no_sync; FSDP2 (fully_shard) and tensor parallelism have DTensor parameters.
            raise ConfigError(
                f"OOMGuard agrees across ranks for DDP models and modules that run no collective in backward; "
                f"{type(model).__name__} (FSDP or FSDP2?) syncs gradients inside backward, where an OOM on one "
                "rank would leave the others waiting. Pass agree=False to run it unguarded across ranks"
            )
        return cls(model, ddp, group, _flag_device(group, model, device))

    def no_sync(self) -> AbstractContextManager[object]:
        if self.ddp is None:
            return nullcontext()
        context: AbstractContextManager[object] = self.ddp.no_sync()
        return context

    def before_attempt(self) -> None:
        import torch

        if self.ddp is None:
            return
        # DDP broadcasts buffers at the start of a forward after a synced one (and its first); `sync` does it.
        self.ddp.require_forward_param_sync = False
        # After a synced iteration run before the guard, DDP rebuilds its buckets (a broadcast) in the next forward.
        rebuild = getattr(getattr(self.ddp, "reducer", None), "_rebuild_buckets", None)
        if callable(rebuild) and torch.is_grad_enabled():
            rebuild()

    def fill_gradients(self) -> None:
        """Zeros for parameters without a gradient on this rank, so that all ranks all-reduce the
        same tensors; allocated before agreeing, where an OOM is still the window's."""
        import torch

        self.used = [p.grad is not None for p in self.params]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def agree(self, ran_out: bool, failed: bool, current: int) -> _Verdict:
        """The collective every rank enters once per attempt, whatever happened in it."""
        import torch.distributed as dist

        values = self.buffer
        values[0], values[1] = int(ran_out), int(failed)
        values[2] = int(ran_out and current <= 1)
        # Negated ranks: the MAX is the lowest rank that ran out (or failed), which messages name.
        values[3] = -(self.rank if ran_out else self.world_size)
        values[4] = -(self.rank if failed else self.world_size)
        ok = not (ran_out or failed)
        for index, used in enumerate(self.used):
            values[self._HEADER + index] = int(ok and used)
        if self.flags is not self.host:
            self.flags.copy_(self.host)
        dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=self.group)
        if self.flags is not self.host:
            self.host.copy_(self.flags)
        oom, error, stuck = values[0], values[1], values[2]
        size = 0 if stuck else -(-current // 2) if oom else current
        return _Verdict(
            oom_rank=-values[3] if oom else None,
            error_rank=-values[4] if error else None,
            size=size,
            used=[bool(v) for v in values[self._HEADER :]],
        )

    def sync(self, used: list[bool]) -> None:
        """DDP's gradient average and buffer broadcast, after every rank said its window completed."""
        import torch
        import torch.distributed as dist

        if self.ddp is None:
            return
        with torch.no_grad():
            works = []
            for p, any_rank in zip(self.params, used, strict=True):
                if not any_rank:
                    p.grad = None  # no rank used it: DDP leaves such a gradient alone
                elif p.grad is not None:
                    works.append(dist.all_reduce(p.grad, group=self.group, async_op=True))
            for work in works:
                work.wait()
            for p, any_rank in zip(self.params, used, strict=True):
                if any_rank and p.grad is not None:
                    p.grad.div_(self.world_size)
            reassigned = getattr(self.ddp, "_assign_modules_buffers", None)  # a list of the current buffers
            if callable(reassigned):
                reassigned()
            if getattr(self.ddp, "forward_sync_buffers", False) and self.ddp.modules_buffers:
                source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
                works = [
                    dist.broadcast(b, src=source, group=self.group, async_op=True) for b in self.ddp.modules_buffers
                ]
                for work in works:
                    work.wait()


def _flag_device(group: Any, model: Any, device: Any) -> torch.device:
    """Where the agreement's tensor lives: the CPU for gloo (and MPI), a CUDA device for NCCL."""
    import torch
    import torch.distributed as dist

    if device is not None:
        return torch.device(device)
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    params = [p.device for p in model.parameters()]
    if "nccl" in backend:
        cuda = [d for d in params if d.type == "cuda"]
        return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
    return params[0] if params else torch.device("cpu")


def accelerate_divides_by() -> int:
    """What `accelerator.backward` divides every loss by: Accelerate's gradient_accumulation_steps
    (1 when Accelerate is not in use). Read from its shared state, without importing it."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if not shared:
        return 1
    return int(shared.get("plugin_kwargs", {}).get("num_steps", 1))


def _refuse_double_scaling() -> None:
    divides = accelerate_divides_by()
    if divides > 1:
        raise DoubleScalingError(
            f"Accelerate divides every loss by gradient_accumulation_steps={divides} in accelerator.backward, and "
            "autotune.accumulate's weights already make each window's gradient the mean over the window: together "
            f"the gradient would be 1/{divides} of the true one. Use one of them: "
            "Accelerator(gradient_accumulation_steps=1) with autotune.accumulate (exact for unequal and short "
            "windows), or accelerator.accumulate alone with equal micro-batches (the setting outlives the "
            "Accelerator object: set accelerator.gradient_accumulation_steps = 1 to use autotune.plans.accumulate)"
        )


def accumulate_window(
    number: int,
    window: list[B],
    *,
    count: Callable[[B], int | torch.Tensor] | None = None,
    ranks: AcrossRanks | None = None,
    total: int | None = None,
    short: bool = False,
) -> Iterator[MicroStep[B]]:
    """The micro-steps of one window (what `accumulate` yields for it); `total`, when known, is
    the window's total (over ranks), which cutting the window into pieces does not change."""
    _refuse_double_scaling()
    counter: Callable[[B], object] = count if count is not None else count_samples
    world_size = ranks.world_size if ranks is not None else 1
    counts = [_to_count(counter(batch)) for batch in window]
    if total is None:
        total = ranks.total(sum(counts)) if ranks is not None else sum(counts)
    weights = mean_loss_weights(counts, total, world_size)
    per_unit = sum_loss_weight(total, world_size)
    for index, (batch, n, weight) in enumerate(zip(window, counts, weights, strict=True)):
        yield MicroStep(
            batch=batch,
            window=number,
            index=index,
            window_size=len(window),
            count=n,
            total=total,
            weight=weight,
            sum_weight=per_unit,
            short=short,
        )


def _drop_gradients(model: Any) -> None:
    """Forget the window's partial gradients and give cached blocks back before the redo."""
    import gc

    import torch

    for p in model.parameters():
        p.grad = None
    # A reference cycle in user code can still hold the failed step's tensors; an OOM in a run
    # is rare enough to pay for a full collection.
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
