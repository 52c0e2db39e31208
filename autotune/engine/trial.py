"""Running one trial: the job's loop at one micro-batch size for a few optimizer steps, then undoing it.

A trial runs what the job's loop runs. Each of its `steps` optimizer steps is made of
`micro_steps` micro-batches whose gradients accumulate (forward under the job's precision, loss,
backward, scaled for fp16), then `optimizer.step()` and `zero_grad(set_to_none=True)`. From the
second micro-step on, forward and backward run with a whole set of gradients alive: that is what
accumulation costs, and an isolated step (one micro-step) never shows it. Every micro-step gets
fresh inputs, as from a loader: with `prefetch = 0` the previous micro-batch is dropped before the
next one is made (a loop that moves each batch to the device itself); with `prefetch = N`, N further
batches are held on the device during each step and the next one is made while the current one is
still referenced (Accelerate's prepared loader, CUDA prefetchers).

The optimizer is created fresh for each trial so that its state is allocated lazily at the first
step, as in the job; the second step is the steady state. After every trial, fitting or not, the
runner restores the parameters and buffers from a host copy and drops the gradients, so trials are
independent.

A framework's own loop can replace this one (`train=`: the Trainer's `train()`, Lightning's
training step): the runner still counts, classifies OOMs and undoes each trial the same way.

Recovery from an OOM happens after the `except` block: inside it the traceback still holds the
failed step's tensors.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from autotune import parallel
from autotune.devices.budget import local_storages
from autotune.devices.device import ProbeDevice
from autotune.engine import oom
from autotune.errors import KeptMemoryError, LeakError, NotAnOOMError, NothingFitsError, NotRepeatableError
from autotune.progress import ProgressCallback, TrialProgress
from autotune.results import AllocatorState, LoopShape, TrialFailure, TrialRecord
from autotune.units import format_bytes
from autotune.workloads import usercode
from autotune.workloads.workload import Precision, Workload

# A trial on a device with a caching allocator runs at least this many optimizer steps (the
# optimizer's state exists from step 1; two more steps unchanged are the evidence of a steady state)
# and at most --max-steps.
SETTLE_MIN_STEPS = 3
DEFAULT_MAX_STEPS = 10
# A job's live memory after each optimizer step is the same from step 2 on (parameters, optimizer
# state, the loader's held batches). Growth after that is a leak (a kept loss holds its graph), also
# when it starts late; it takes two increases to call it one, since a single increase can be a cache
# built once: a trial whose last step grew runs one step more to tell them apart. The least steps
# that show a leak from the start: three (two increases).
LEAK_EVIDENCE_STEPS = 3

_AUTOCAST = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}

# A training loop at (micro-batch, loop shape), run inside the device's counting; returns the
# seconds per micro-step of its last optimizer step.
TrainLoop = Callable[[int, LoopShape], float]


class TrialRunner:
    """Builds the model once on the device and runs independent trials on it."""

    def __init__(
        self,
        workload: Workload,
        device: ProbeDevice,
        steps: int = 2,
        on_step: Callable[[int, int], None] | None = None,
        model: nn.Module | None = None,
        *,
        micro_steps: int = 1,
        prefetch: int = 0,
        train: Callable[[TrialRunner], TrainLoop] | None = None,
        on_progress: ProgressCallback | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
    ) -> None:
        """`steps` optimizer steps of `micro_steps` accumulated micro-batches each, with `prefetch`
        further batches held on the device (the default loop; `run` takes others). On a device with
        a caching allocator, a trial runs at least SETTLE_MIN_STEPS and up to `max_steps` steps,
        until the allocator settles (`settled`).

        `model`: an already built model to use as is (the estimator's fake-tensor model, which
        `.to()` cannot move); by default the workload builds one on the device.
        `train`: makes the job's own loop over this runner's model, run instead of the workload's step.
        `on_progress`: told as each micro-step begins (`micro_step`), for a person to watch."""
        self.loop = LoopShape(micro_steps=micro_steps, steps=steps, prefetch=prefetch)
        self.max_steps = max_steps
        # Whether the device has a caching allocator to settle: asked once (on CUDA each question
        # is a memory_stats() call, and step_budget is asked at every micro-step).
        self.settles = device.allocator_state() is not None
        self.states: list[AllocatorState] = []  # the allocator after each step of the running trial
        self.live_after_steps: list[int] = []  # live bytes after each step of the running trial
        self.steps_run = 0
        self.workload = workload
        self.device = device
        self._on_step = on_step
        self._on_progress = on_progress
        self._trial_started = time.perf_counter()
        if model is not None:
            self.model = model
        else:
            self.model = _build(workload, device)
        self.model.train()
        self._state = [t for t in (*self.model.parameters(), *self.model.buffers())]
        device.track(self._state)
        device.mark(self._state, "parameters")
        self._parameter_ids = {id(p) for p in self.model.parameters()}
        # The host copy is outside the device's memory on purpose: it must not shrink the budget.
        self._snapshot = [t.detach().to("cpu", copy=True) for t in self._state]
        # What every trial must start from and end at: the model, and what the job's loop creates
        # once and keeps (cuBLAS workspaces, a cache built at the first step). Until a trial has
        # fitted (run the whole loop), what trials leave joins it; from then on, memory a trial
        # leaves is memory it kept (`kept_memory`).
        self.baseline_bytes = device.live_bytes()
        self._baseline_storages = device.live_storages()
        self.trials_run = 0
        self.fitted_once = False
        self.kept_once: str | None = None  # what the trials before the first fitting one left, in words
        self._batch_shapes: dict[int, tuple[object, ...]] = {}  # batch size -> the shapes make_batch gave
        self._train_loop: TrainLoop = self._train if train is None else train(self)

    @property
    def steps(self) -> int:
        return self.loop.steps

    # One trial ---------------------------------------------------------------------------
    def __call__(self, batch: int) -> TrialRecord:
        return self.run(batch, self.loop)

    def trial_fn(self, loop: LoopShape) -> Callable[[int], TrialRecord]:
        """A trial function of the batch size alone, for the search, in `loop`."""
        return lambda batch: self.run(batch, loop)

    def run(self, batch: int, loop: LoopShape) -> TrialRecord:
        """One trial of `loop` at micro-batch `batch`, undone afterwards.

        Raises LeakError (memory grew from step to step), KeptMemoryError (the trial left memory
        behind), NotRepeatableError (make_batch gave other shapes at this size) or NotAnOOMError."""
        self.trials_run += 1
        self.device.reset_peak()
        started = self._trial_started = time.perf_counter()
        self.states, self.live_after_steps, self.steps_run = [], [], 0
        step_seconds: float | None = None
        failure: str | None = None
        kind: TrialFailure | None = None
        not_oom: str | None = None
        details: str | None = None
        cause: BaseException | None = None
        kept: list[tuple[BaseException, TracebackType | None]] = []
        refused: NotRepeatableError | None = None
        try:
            with self.device.active(), self._marking_roles():
                step_seconds = self._train_loop(batch, loop)
            kind, failure = self.unsettled(loop)
        except NotRepeatableError as exc:  # our own refusal, raised once the trial is undone
            refused = exc
            oom.release(exc)
        except BaseException as exc:  # classified right here; non-OOMs stop the probe
            if not isinstance(exc, Exception) and not usercode.raised_by_code(exc):
                raise  # Ctrl-C, SIGTERM, an exit: not the workload's error
            reason = oom.classify(exc)
            if reason is not None and reason.kind is oom.OOMKind.OOM:
                kind, failure = "oom", reason.message
            elif reason is not None:
                not_oom = (
                    f"an ambiguous error, not counted as out-of-memory: {type(exc).__name__}: {exc} "
                    "(cuDNN and CUDA report it both for inputs they do not support and for "
                    "workspaces they could not allocate; check the input, or probe with more headroom)"
                )
            else:
                not_oom = f"an error that is not out-of-memory: {usercode.describe(exc)}"
            if not_oom is not None:
                details = usercode.formatted(exc)  # for --debug; before release() clears the frames
                # The job's error travels as the cause, with the job's frames only (released of
                # their locals: the step's tensors), for an integration to raise as the job's own.
                cause, kept = exc, usercode.users_tracebacks(exc)
            oom.release(exc)
        leak = None if not_oom is not None or refused is not None else self.leak(batch, ran_out=kind == "oom")
        seconds = time.perf_counter() - started
        peak_allocated = self.device.peak_allocated_bytes()
        peak_reserved = self.device.peak_reserved_bytes()
        breakdown = self.device.peak_breakdown()
        self.recover()
        if refused is not None:
            raise refused
        if leak is not None:
            raise leak
        kept_error = self.kept_memory(batch, loop, fitted=failure is None)
        if kept_error is not None:
            raise kept_error
        if not_oom is not None:
            error = NotAnOOMError(f"batch {batch} failed with {not_oom}", batch=batch, original=not_oom)
            error.traceback = details
            usercode.restore(kept)
            raise error from cause
        return TrialRecord(
            batch=batch,
            fits=failure is None,
            peak_allocated_bytes=peak_allocated,
            peak_reserved_bytes=peak_reserved,
            seconds=seconds,
            step_seconds=step_seconds,
            oom_message=failure,
            failure=kind,
            steps=self.steps_run,
            allocator=self.states[-1] if self.states else self.device.allocator_state(),
            micro_steps=loop.micro_steps,
            prefetch=loop.prefetch,
            breakdown=breakdown,
        )

    @contextmanager
    def _marking_roles(self) -> Iterator[None]:
        """Tell the device, at every optimizer step of the trial (whichever loop runs it: ours, a
        framework's), which tensors are this model's gradients (as the step begins) and the
        optimizer's state (after it): what `peak_breakdown` splits the peak by. Optimizers over
        other parameters are ignored. Costs one pass over the parameters per optimizer step."""
        ours = self._parameter_ids
        device = self.device

        def params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
            return [p for group in optimizer.param_groups for p in group["params"] if id(p) in ours]

        def before(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            device.mark([p.grad for p in params(optimizer) if p.grad is not None], "gradients")

        def after(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            state = optimizer.state
            tensors = [
                value
                for p in params(optimizer)
                for value in state.get(p, {}).values()
                if isinstance(value, torch.Tensor) and value.device == p.device
            ]
            device.mark(tensors, "optimizer_state")

        handles = [
            register_optimizer_step_pre_hook(before),
            register_optimizer_step_post_hook(after),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _train(self, batch: int, loop: LoopShape) -> float:
        """Run `loop`; return the seconds per micro-step of the last (steady-state) optimizer step."""
        workload, device, model = self.workload, self.device, self.model
        dtype = _AUTOCAST.get(workload.precision)
        device_type = device.torch_device.type
        step_seconds = 0.0
        optimizer = workload.make_optimizer(model.parameters())
        scaler = torch.amp.GradScaler(device_type, enabled=workload.precision is Precision.FP16)
        # held[0] is the micro-batch being trained on; the rest are the loader's prefetched ones.
        held: deque[object] = deque(self._made(batch) for _ in range(loop.prefetch))
        for step in range(self.step_budget(loop)):
            started = time.perf_counter()
            for micro in range(loop.micro_steps):
                self.micro_step(batch, loop, step, micro)
                if not loop.prefetch:
                    held.clear()
                held.append(self._made(batch))
                if len(held) > loop.prefetch + 1:
                    held.popleft()
                # DDP: no gradient sync but on the window's last micro-step, as a DDP job accumulates.
                with parallel.accumulating_context(model, last=micro == loop.micro_steps - 1):
                    with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
                        loss = workload.loss(model, held[0])
                    if loop.micro_steps > 1:
                        loss = loss / loop.micro_steps
                    scaler.scale(loss).backward()
                del loss
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            device.synchronize()
            step_seconds = (time.perf_counter() - started) / loop.micro_steps
            self.stepped(batch, step)
            if self.done(loop):
                break
        return step_seconds

    def _made(self, batch: int) -> object:
        """The workload's batch of `batch` samples, refused unless its shapes are the ones this size
        gave before: the answer holds for a batch of fixed shape (the worst case), and peaks measured
        on shapes that change from call to call belong to no size."""
        made = self.workload.make_batch(batch, self.device.torch_device)
        shapes = _shapes(made)
        first = self._batch_shapes.setdefault(batch, shapes)
        if shapes != first:
            raise NotRepeatableError(
                f"make_batch({batch}) is not repeatable: it gave {_shapes_words(first)} once and "
                f"{_shapes_words(shapes)} later, at the same size, so no trial's peak holds for that size; make "
                "make_batch return the worst case (the longest sequence, the largest image) at every call"
            )
        return made

    def stepped(self, batch: int, step: int) -> None:
        """Record the allocator's state after an optimizer step of a trial at `batch`, and tell the
        caller's `on_step` (every loop calls it after each optimizer step)."""
        self.steps_run += 1
        self.live_after_steps.append(self.device.live_bytes())
        state = self.device.allocator_state()
        if state is not None:
            self.states.append(state)
        if self._on_step is not None:
            self._on_step(batch, step)

    # Settling --------------------------------------------------------------------------------
    # On a GPU the limit bites on the caching allocator's reserved memory, whose blocks keep moving
    # for a few steps after the optimizer's state exists: a size that fitted two steps ran out of
    # memory at step 3 or 4 of a real run (H100, ../shared/h100). So a trial runs until two
    # consecutive steps changed none of the allocator's counters (reserved bytes, segments, retries,
    # segment allocations), at least SETTLE_MIN_STEPS, at most `max_steps`. A device without an
    # allocator (the budget device's exact counting, identical from step 2 on) runs `loop.steps`.
    def step_budget(self, loop: LoopShape) -> int:
        """The most optimizer steps a trial of `loop` may run."""
        if not self.settles:
            # The step past loop.steps runs only when the last one grew (a leak, or a cache built once?).
            return max(loop.steps + 1, LEAK_EVIDENCE_STEPS)
        # Two steps past the asked ones: a run of 20 steps (a confirmation) may still settle.
        return max(loop.steps + 2, SETTLE_MIN_STEPS, self.max_steps)

    def settled(self, loop: LoopShape) -> bool:
        """Whether the running trial has reached the allocator's steady state."""
        states = self.states
        if not states:
            return self.steps_run >= loop.steps
        if self.steps_run < max(loop.steps, SETTLE_MIN_STEPS):
            return False
        return states[-1] == states[-2] == states[-3]

    def thrashing(self) -> bool:
        """Whether the last two steps each retried an allocation after freeing the cache: memory so
        close to the limit that every step pays for it (Composer lowers the batch on this too)."""
        states = self.states
        return len(states) >= 3 and states[-1].retries > states[-2].retries > states[-3].retries

    def done(self, loop: LoopShape) -> bool:
        """Whether a loop should stop after the step just run: settled, or thrashing (no use waiting);
        never right after a step whose live memory grew while the evidence of a leak is short (one
        more step tells a leak from a cache built once)."""
        grew = self.grew_at()
        if grew and grew[-1] == self.steps_run and len(grew) < 2:
            return False
        return self.settled(loop) or (self.steps_run >= SETTLE_MIN_STEPS and self.thrashing())

    # Leaks -----------------------------------------------------------------------------------
    def grew_at(self) -> list[int]:
        """The optimizer steps (counted from 1) of the running trial after which live memory was
        higher than after the step before: none, from step 2 on, in a loop that keeps nothing."""
        live = self.live_after_steps
        return [step for step, (before, after) in enumerate(itertools.pairwise(live), 2) if after > before]

    def growing(self) -> bool:
        """Whether live memory grew at every optimizer step of the running trial after its first."""
        live = self.live_after_steps
        return len(live) >= 2 and len(self.grew_at()) == len(live) - 1

    def leak(self, batch: int, *, ran_out: bool) -> LeakError | None:
        """The running trial's leak, if it showed one: live memory that grew after two steps, from
        the start or late (one, when it grew at every step and then ran out of memory)."""
        live = self.live_after_steps
        grew = self.grew_at()
        if len(grew) < 2 and not (ran_out and grew and self.growing()):
            return None
        # A single step-2 increase before a later leak is the cache built once: the leak starts after it.
        start = grew[1] if grew[0] == 2 and len(grew) > 1 and grew[1] > 3 else grew[0]
        since = live[start - 2]
        per_step = (live[-1] - since) // max(1, len(live) - start + 1)
        after = ", ".join(f"{format_bytes(b)} after step {i}" for i, b in enumerate(live, 1))
        late = f" from step {start} on" if start > 2 else ""
        error = LeakError(
            f"the workload leaks memory: live memory after each optimizer step grew{late} by {format_bytes(per_step)} "
            f"per step at micro-batch {batch} ({after}){' and then ran out of memory' if ran_out else ''}; a run's "
            "memory would grow until it runs out, so no micro-batch holds for it. "
            f"{_surviving_tensors(self.device, self._state)}"
            "Keep no reference to a step's tensors past the step (a list of losses or outputs: keep loss.item() "
            "or out.detach().cpu() instead)"
        )
        error.bytes_per_step = per_step
        error.started_at_step = start
        return error

    def kept_memory(self, batch: int, loop: LoopShape, *, fitted: bool) -> KeptMemoryError | None:
        """Memory the trial just undone left on the device (call after `recover`): the next trial
        would start with it, and run out of memory early. Before the first trial that fitted, what
        trials leave joins the baseline (a cache the job builds once, cuBLAS's workspaces); after
        it, anything left is kept by the workload's code from this trial."""
        live = self.device.live_bytes()
        left = live - self.baseline_bytes
        if not self.fitted_once:
            if left > 0:
                words = f"{format_bytes(left)} left by trial {self.trials_run} (batch {batch})"
                self.kept_once = words if self.kept_once is None else f"{self.kept_once}; {words}"
            if left != 0:
                self.baseline_bytes = live
                self._baseline_storages = self.device.live_storages()
            self.fitted_once = fitted
            return None
        if left <= 0:
            return None
        error = KeptMemoryError(
            f"memory kept between trials: trial {self.trials_run} (micro-batch {batch}, {loop.micro_steps} "
            f"micro-step(s) per optimizer step) ended with {format_bytes(left)} more live on the device than it "
            f"started with, after its gradients, optimizer and batches were dropped. "
            f"{_surviving_tensors(self.device, self._state, since=self._baseline_storages)}"
            "Every later trial would run with it and run out of memory early, so the probe stops instead of answering "
            "low: keep no device tensor past the step (a cache keyed by the batch's size or shape, a list of "
            "outputs or losses: keep loss.item() or out.detach().cpu(), or clear the cache at each step)"
        )
        error.trial = self.trials_run
        error.batch = batch
        error.kept_bytes = left
        return error

    def unsettled(self, loop: LoopShape) -> tuple[TrialFailure | None, str | None]:
        """Why a trial that raised nothing still does not fit: thrashing, or an allocator still moving."""
        if not self.states or self.settled(loop):
            return None, None
        first, last = self.states[0], self.states[-1]
        if self.thrashing():
            return "thrashing", (
                f"allocation retries in consecutive optimizer steps (thrashing: num_alloc_retries {first.retries} "
                f"after step 1, {last.retries} after step {self.steps_run}): each step freed the allocator's cache "
                "to fit, so this size runs at the edge of the limit"
            )
        return "unsettled", (
            f"the caching allocator did not settle in {self.steps_run} optimizer steps (reserved "
            f"{format_bytes(first.reserved_bytes)} after step 1, {format_bytes(last.reserved_bytes)} after step "
            f"{self.steps_run}; segments {first.segments} -> {last.segments}): counted as not fitting; raise "
            "--max-steps to wait longer"
        )

    def micro_step(self, batch: int, loop: LoopShape, step: int, micro: int) -> None:
        """Tell the caller's `on_progress` that micro-step `micro` of optimizer step `step` (both
        counted from 0) of a trial at `batch` begins (loops call it)."""
        if self._on_progress is not None:
            self._on_progress(
                TrialProgress(
                    batch=batch,
                    step=step + 1,
                    steps=self.step_budget(loop) if self.settles else max(loop.steps, step + 1),
                    micro_step=micro + 1,
                    micro_steps=loop.micro_steps,
                    seconds=time.perf_counter() - self._trial_started,
                )
            )

    # Undoing a trial -----------------------------------------------------------------------
    def recover(self) -> None:
        """Return the device to its state before the trial: no grads, original weights, no cache."""
        # First the parallel wrapper's own reset: FSDP2 puts the sharded parameters (and their
        # gradients) back on the modules only then, and frees gathered ones by resizing their
        # storages, which the device counts inside `active()`.
        with self.device.active():
            parallel.after_failed_step(self.model)  # after a trial that ended, a no-op
        for p in self.model.parameters():
            p.grad = None
        with torch.no_grad():
            for tensor, saved in zip(self._state, self._snapshot, strict=True):
                tensor.copy_(saved)
        self.device.empty_cache()
        if self.device.live_bytes() > self.baseline_bytes:
            # Only a reference cycle can still hold the step's tensors; a full collection costs
            # ~0.2 s with torch imported, so pay it only when memory says it is needed.
            gc.collect()
            self.device.empty_cache()
        self.device.reset_peak()


def _surviving_tensors(
    device: ProbeDevice, own: list[torch.Tensor], shown: int = 3, since: frozenset[int] | None = None
) -> str:
    """The largest kinds of tensor on `device` that Python still references, other than the model's
    own (and, with `since`, other than the storages live then): where a leak's memory went, and,
    where the device can tell, the op that allocated it. A sharded (DTensor) tensor is its local
    shard's storages, as the devices count it."""
    owned = {key for t in own for key, _ in _storages(t)}
    found: dict[int, tuple[torch.Tensor, int]] = {}  # storage -> a tensor on it, its bytes
    for obj in gc.get_objects():
        # type(), not isinstance: some objects (torch.distributed's deprecated aliases) warn on __class__.
        if issubclass(type(obj), torch.Tensor) and not issubclass(type(obj), nn.Parameter) and device.holds(obj):
            for key, storage in _storages(obj):
                if key not in owned and storage.nbytes() and (since is None or id(storage) not in since):
                    found.setdefault(key, (obj, storage.nbytes()))
    kinds: dict[str, list[int]] = {}
    for tensor, nbytes in found.values():
        made_by = f", grad_fn {type(tensor.grad_fn).__name__}" if tensor.grad_fn is not None else ""
        op = device.allocated_by(tensor)
        allocated = f", allocated by {op}" if op is not None else ""
        kind = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}{made_by}{allocated}"
        kinds.setdefault(kind, []).append(nbytes)
    largest = sorted(kinds.items(), key=lambda item: sum(item[1]), reverse=True)[:shown]
    if not largest:
        return ""
    described = [f"{len(sizes)} x {kind} ({format_bytes(sum(sizes))} in all)" for kind, sizes in largest]
    return f"Tensors still alive, the largest kinds: {'; '.join(described)}. "


def _storages(tensor: torch.Tensor) -> list[tuple[int, torch.UntypedStorage]]:
    """(its data pointer, the storage) of each storage holding a tensor's bytes on its device; none
    for a storage that cannot be read (freed, or a wrapper's without data)."""
    found = []
    for storage in local_storages(tensor):
        try:
            found.append((storage.data_ptr(), storage))
        except RuntimeError:
            continue
    return found


def _shapes(batch: object) -> tuple[object, ...]:
    """The shapes and dtypes of a batch's tensors, in order (what fixes a step's memory), and the
    length of any list of other things (a batch of strings)."""
    found: list[object] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append((tuple(value.shape), value.dtype))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                found.append(key)
                walk(item)
        elif isinstance(value, (list, tuple)):
            if value and not any(isinstance(item, (torch.Tensor, Mapping, list, tuple)) for item in value):
                found.append(len(value))
            else:
                for item in value:
                    walk(item)

    walk(batch)
    return tuple(found)


def _shapes_words(shapes: tuple[object, ...]) -> str:
    tensors = [
        f"{str(dtype).removeprefix('torch.')}{list(shape)}"
        for shape, dtype in (s for s in shapes if isinstance(s, tuple))
    ]
    return ", ".join(tensors[:4]) + (", ..." if len(tensors) > 4 else "") if tensors else "no tensor"


def _build(workload: Workload, device: ProbeDevice) -> nn.Module:
    """Build the model on the device; a model that alone exceeds the limit is 'nothing fits'."""
    failure: str | None = None
    try:
        with device.active():
            model = workload.build_model().to(device.torch_device)
            workload.checkpoint(model)  # activation checkpointing, as the job sets it (none: nothing)
            # Wrapped as the job wraps it (DDP's buckets, FSDP's shards), inside the counting.
            return parallel.wrap(
                model, workload.parallel, device.torch_device, _AUTOCAST.get(workload.precision), workload.shard
            )
    except Exception as exc:  # classified here; anything but an OOM propagates
        reason = oom.classify(exc)
        if reason is None or reason.kind is not oom.OOMKind.OOM:
            raise
        failure = reason.message
        oom.release(exc)
    needed = device.peak_allocated_bytes()
    device.empty_cache()
    raise NothingFitsError(
        f"the model alone does not fit within a limit of {format_bytes(device.limit_bytes)} "
        f"({failure}): give the probe more memory (--memory, less --headroom) or a smaller model",
        peak_bytes=needed,
        limit_bytes=device.limit_bytes,
    )
