"""The records a probe produces: each trial, the device it ran on, and the whole result.

These pydantic models are the boundary format: `autotune probe --json` prints a `ProbeResult`,
the service stores and returns it unchanged, and `POST /v1/results` validates against it.
`save_result` and `load_result` are the file a job's script reads (`autotune probe --save`).
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, computed_field

from autotune.errors import ConfigError, UnconfirmedError
from autotune.plans.plan import Plan, Policy, plan_for_loops

# 2: trials run the job's loop (micro-steps, prefetch); `max_micro_batch` holds with accumulation,
# `max_micro_batch_without_accumulation` for one micro-step; fresh-process `confirmation`.
SCHEMA_VERSION = 2
# The exit code of `autotune probe` for an answer that a fresh process did not confirm (a fresh run
# fitted at another peak than the probe's): answered, but not as verified as it says.
NOT_CONFIRMED_EXIT_CODE = 4


class LoopShape(BaseModel):
    """The training loop a trial runs and an answer holds for."""

    model_config = ConfigDict(frozen=True)

    micro_steps: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Micro-batches accumulated per optimizer step. From the second on, each runs with a whole "
        "set of gradients alive, so an answer verified with 2 holds for any number of micro-steps.",
    )
    steps: int = Field(default=2, ge=1, le=100, description="Optimizer steps per trial.")
    prefetch: int = Field(default=0, ge=0, le=16, description="Further batches held on the device during a step.")

    @property
    def accumulates(self) -> bool:
        return self.micro_steps > 1

    def describe(self) -> str:
        """The loop in words, for summaries and messages."""
        micro = (
            f"{self.micro_steps} accumulated micro-steps per optimizer step (from the second on, each runs "
            "with the gradients alive, so it holds for any number)"
            if self.accumulates
            else "one micro-step per optimizer step (no accumulation)"
        )
        held = f", {self.prefetch} batch(es) prefetched on the device" if self.prefetch else ""
        return f"{micro}, {self.steps} optimizer step(s){held}"


# The roles a trial marks storages with; whatever has none is activations and temporaries.
MemoryRole = Literal["parameters", "gradients", "optimizer_state"]


class MemoryBreakdown(BaseModel):
    """What filled the memory at a trial's peak; the parts sum to `total`, the trial's
    `peak_allocated_bytes`, exactly.

    On the CPU budget device every part is exact at the moment of the peak (bytes rounded to 512 B
    as the device counts them): each storage alive at that moment is counted once, under the role
    it had during the trial. `parameters`: the model's parameters and buffers. `gradients`:
    storages that were parameters' `.grad` when an optimizer step began (a gradient of the current
    backward that was alive at the peak counts here even if it became a `.grad` just after).
    `optimizer_state`: tensors in the optimizer's `state` after its step (Adam's moments and step
    counters, momentum buffers). `activations`: everything else alive at the peak: activations
    saved for backward, temporaries, the batch(es), backward's and the optimizer's scratch tensors.
    `peak_op`: the aten op during which the peak was reached ("aten.mm.default").

    On CUDA the moment of the peak is not known (`peak_op` is None): parameters are the model's
    tensors, gradients and optimizer state their largest totals seen at an optimizer step (whether
    or not they were alive at the peak: a peak in forward overstates gradients and understates
    activations), each rounded to 512 B as the caching allocator rounds blocks; `activations` is the
    rest of the allocated peak. The caching allocator's reserved-but-unallocated memory
    (`peak_reserved_bytes - peak_allocated_bytes`) is in none of them.
    """

    model_config = ConfigDict(frozen=True)

    parameters: int = Field(ge=0, description="The model's parameters and buffers at the peak.")
    gradients: int = Field(ge=0, description="Parameters' gradients alive at the peak.")
    optimizer_state: int = Field(ge=0, description="The optimizer's state alive at the peak.")
    activations: int = Field(
        ge=0, description="Activations and temporaries: everything else at the peak, the batch included."
    )
    peak_op: str | None = Field(
        default=None, description="The aten op during which the peak was reached; None where unknown (CUDA)."
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total(self) -> int:
        """The sum of the parts: the trial's peak allocated bytes."""
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def parts(self) -> list[tuple[str, int]]:
        """(label, bytes) of each part, in the order they are drawn and printed."""
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("activations and temporaries", self.activations),
        ]

    def largest(self) -> tuple[str, int]:
        """The part that takes the most memory (label, bytes)."""
        return max(self.parts(), key=lambda part: part[1])

    def lever(self) -> str:
        """What would save the most memory, judged by the largest part."""
        return LEVERS[self.largest()[0]]


# What shrinks each part of a breakdown (keyed by MemoryBreakdown.parts' labels).
LEVERS = {
    "parameters": "lower-precision weights (bf16) or sharded parameters (FSDP, ZeRO-3) would save the most",
    "gradients": "lower-precision or sharded gradients (ZeRO-2, FSDP) would save the most",
    "optimizer state": "a sharded optimizer (ZeRO-1, FSDP) or an 8-bit optimizer would save the most",
    "activations and temporaries": "activation checkpointing (or bf16 autocast) would save the most",
}


class AllocatorState(BaseModel):
    """The caching allocator's counters after an optimizer step: what "settled" compares.

    CUDA's come from `torch.cuda.memory_stats()`; the budget device's from its model of the CUDA
    caching allocator (`AUTOTUNE_ALLOCATOR=cuda`). A step that changed none of them left the
    allocator as it found it: the next step will find the same blocks."""

    model_config = ConfigDict(frozen=True)

    reserved_bytes: int = Field(ge=0, description="Bytes held in segments (reserved_bytes.all.current).")
    segments: int = Field(ge=0, description="Segments held (segment.all.current).")
    retries: int = Field(
        ge=0,
        description="num_alloc_retries so far: a segment allocation failed, the allocator freed its cached "
        "segments and retried (memory so close to the limit that every step pays for it).",
    )
    device_allocations: int = Field(ge=0, description="num_device_alloc so far: segments allocated (cudaMalloc).")


TrialFailure = Literal["oom", "thrashing", "unsettled"]


class TrialRecord(BaseModel):
    """One trial: optimizer steps of `micro_steps` micro-batches each, at one micro-batch size, run
    until the caching allocator settled (where the device has one)."""

    model_config = ConfigDict(frozen=True)

    batch: int = Field(ge=1)
    fits: bool
    micro_steps: int = Field(default=1, ge=1, description="Micro-batches accumulated per optimizer step.")
    prefetch: int = Field(default=0, ge=0, description="Further batches held on the device during each step.")
    peak_allocated_bytes: int | None = Field(
        default=None,
        description="Highest live tensor bytes during the trial (reached or, for an OOM, at the failing allocation).",
    )
    peak_reserved_bytes: int | None = Field(
        default=None,
        description="Highest bytes held by the allocator (CUDA caching allocator; the budget device has no cache).",
    )
    seconds: float = Field(ge=0, description="Wall time of the whole trial.")
    process_seconds: float | None = Field(
        default=None,
        description="For a fresh-process confirmation run: wall time from starting its process to its answer "
        "(what the progress lines count); None for the search's trials.",
    )
    step_seconds: float | None = Field(
        default=None,
        description="Wall time per micro-step of the last (steady-state) optimizer step, for fitting trials.",
    )
    oom_message: str | None = Field(default=None, description="First line of the OOM error, for failed trials.")
    failure: TrialFailure | None = Field(
        default=None,
        description="Why a trial did not fit: oom (an allocation failed), thrashing (the allocator retried "
        "allocations in consecutive steps) or unsettled (its counters still changed after the last step "
        "allowed). None for a fitting trial (and for failed trials stored before it was recorded).",
    )
    steps: int | None = Field(
        default=None, description="Optimizer steps the trial ran (None in results from before it was recorded)."
    )
    limit_bytes: int | None = Field(
        default=None,
        description="For a confirmation run under a limit other than the result's: the limit it ran under (a size at "
        "the allocator's edge runs again with EDGE_MARGIN_BYTES less; see autotune.engine.confirm).",
    )
    allocator: AllocatorState | None = Field(
        default=None,
        description="The caching allocator's counters after the trial's last step; None on a device without "
        "one (the budget device's exact counting).",
    )
    breakdown: MemoryBreakdown | None = Field(
        default=None,
        description="What filled the memory at the peak (for an OOM, at the failing allocation); sums to "
        "peak_allocated_bytes. None where not measured (results from before it was).",
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def samples_per_second(self) -> float | None:
        """Throughput of the steady-state step, for fitting trials."""
        if not self.fits or not self.step_seconds:
            return None
        return self.batch / self.step_seconds


class DeviceInfo(BaseModel):
    """The device a probe ran on."""

    kind: Literal["cuda", "cpu-budget"]
    name: str
    index: int | None = None
    uuid: str | None = None
    total_bytes: int = Field(description="The card's total memory, or the simulated memory of the budget device.")


class ParallelSpec(BaseModel):
    """How the job runs the model across ranks: what a rank's memory was probed under."""

    model_config = ConfigDict(frozen=True)

    strategy: Literal["none", "ddp", "fsdp"] = Field(
        default="none",
        description="none; ddp (DistributedDataParallel); fsdp (FSDP2 fully_shard, per block then root).",
    )
    world_size: int = Field(default=1, ge=1, description="The ranks FSDP shards over (1 for none and ddp).")
    reshard_after_forward: bool = Field(default=True, description="FSDP: free gathered parameters after forward.")
    sharding: str = Field(
        default="per-block",
        description="FSDP: per-block (fully_shard on each ModuleList item, then the root), or the workload's own "
        "sharding function as module.qualname.",
    )


class WorkloadRef(BaseModel):
    """What was probed: a target (built-in example or module:attribute) and its options."""

    target: str
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    precision: Literal["fp32", "bf16", "fp16"]
    optimizer: str
    steps: int
    input_spec: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="What the batch was made of: sizes, or the worst-case samples of the job's data and their shapes.",
    )
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="The parallel setup a rank was probed in.")
    checkpointing: str | None = Field(
        default=None,
        description="The activation checkpointing the model ran with: full or every=K (every K-th repeated block); "
        "None for none.",
    )


class Versions(BaseModel):
    autotune: str
    torch: str
    cuda: str | None
    python: str


class CurvePoint(BaseModel):
    """One point of the predicted peak-memory curve."""

    batch: int
    peak_bytes: int


class Prediction(BaseModel):
    """What the memory-curve predictor expected before the verifying trials ran."""

    predicted_max_micro_batch: int | None
    probe_batches: list[int]
    probe_trials: int = Field(
        default=0,
        description="The first `probe_trials` trials of its loop's search recorded the timelines (in the "
        "accumulating loop, after its first trial, at the one-micro-step answer); they are real trials and count "
        "in the trial count.",
    )
    exact: bool | None = Field(default=None, description="Whether the verified answer equals the prediction.")
    first_guess: int | None = Field(
        default=None,
        description="CUDA: the guess from allocated bytes alone; a trial there measured reserved/allocated, "
        "which refined it into predicted_max_micro_batch.",
    )
    fallback_reason: str | None = None
    curve: list[CurvePoint] = Field(default_factory=list, description="Predicted peak bytes by batch size.")
    seeded_from: str | None = Field(
        default=None,
        description="A prediction made without timeline trials of its own (the accumulating loop, from the "
        "one-micro-step curve plus the gradients that loop's peak did not hold, or plus what accumulating added "
        "under the setting probed before it with --checkpointing auto): what it was made from.",
    )


class ThroughputCandidate(BaseModel):
    """One fitting, timed micro-batch the throughput objective considered."""

    micro_batch: int
    step_seconds: float = Field(description="Steady-state step time measured by its trial.")
    samples_per_second: float
    accumulation_steps: int | None = Field(default=None, description="Steps of the plan, with an effective batch.")
    seconds: float = Field(description="Cost compared: seconds per optimizer step, or per sample without a plan.")


class ThroughputChoice(BaseModel):
    """The micro-batch `--objective throughput` chose: least time per optimizer step (accumulation
    steps × step time) for the planned effective batch, or most samples per second without one."""

    micro_batch: int
    basis: Literal["optimizer-step", "sample"]
    seconds: float
    largest_micro_batch: int = Field(description="The largest fitting micro-batch that was timed.")
    largest_seconds: float
    largest_slowdown: float = Field(
        description="How much slower the largest-that-fits choice is: largest_seconds / seconds - 1."
    )
    candidates: list[ThroughputCandidate]


class LoopAnswer(BaseModel):
    """The largest micro-batch verified for one loop shape: it fitted, and one more did not."""

    loop: LoopShape
    max_micro_batch: int | None = Field(ge=1, description="None when no size fits this loop (`reason` says why).")
    capped: bool
    prediction: Prediction | None = None
    reason: str | None = Field(default=None, description="Why no size fits this loop, when none does.")


class ConfirmationCheck(BaseModel):
    """One answer run again in fresh processes: a new process per size, sizes in the order tried."""

    answer: Literal["plan", "max_micro_batch", "max_micro_batch_without_accumulation"]
    loop: LoopShape
    searched: int = Field(description="The size the search found (or the plan's micro-batch).")
    confirmed: int | None = Field(description="The largest size that passed in a fresh process; None if none did.")
    runs: list[TrialRecord] = Field(description="Each fresh-process run: batch, fits, peaks, seconds.")
    probe_peak_bytes: int | None = Field(
        default=None,
        description="The probe's own peak (allocated) at the confirmed size in the same loop kind, to compare the "
        "fresh run's with; None when the probe ran no trial at that size.",
    )
    mismatch: str | None = Field(
        default=None,
        description="Why the fresh run is not taken as a confirmation although it fitted: its peak differs from "
        "the probe's by more than the tolerance (the step does not repeat what the probe measured).",
    )


class Confirmation(BaseModel):
    """The fresh-process confirmation of the answer the result gives (and of its plan)."""

    status: Literal["passed", "stepped-down", "mismatch", "skipped"]
    passed: bool = Field(
        description="Every searched answer fitted, unchanged, in a fresh process, at the probe's peak (within the "
        "tolerance); `mismatch`: a fresh run's peak differed from the probe's."
    )
    steps: int = Field(description="Optimizer steps each confirmation run trained.")
    checks: list[ConfirmationCheck] = Field(default_factory=list)
    seconds: float = 0.0
    note: str = ""

    @property
    def runs(self) -> int:
        return sum(len(c.runs) for c in self.checks)


AnswerName = Literal["max_micro_batch", "max_micro_batch_without_accumulation", "plan"]


class AnswerVerdict(BaseModel):
    """One answer of a result: the size, the loop it fitted in (and one more did not), and whether a
    fresh process ran it again."""

    answer: AnswerName
    micro_batch: int
    loop: LoopShape = Field(description="The loop the probe verified it in: it fitted there, and one more did not.")
    confirmed: bool | None = Field(
        description="True: it (or a larger size of the same loop kind) fitted again in a fresh process at the "
        "probe's peak; False: a fresh run did not repeat the probe's peak; None: not run again."
    )
    words: str = Field(description="The same, in words, as the summary prints it.")


class Verdict(BaseModel):
    """What a result's answers were verified for and whether they were confirmed, in one place: the
    summary's answer block, `--json`, the saved file and the service print this."""

    status: Literal["confirmed", "not-confirmed", "unconfirmed"] = Field(
        description="confirmed: every answer ran again in a fresh process and fitted there (lowered where it did "
        "not); not-confirmed: a fresh run did not repeat what the probe measured; unconfirmed: not run again "
        "(--no-confirm, or live objects that a fresh process cannot build)."
    )
    exit_code: int = Field(
        description=f"`autotune probe`'s exit code for this result: 0, or {NOT_CONFIRMED_EXIT_CODE} when not confirmed."
    )
    answers: list[AnswerVerdict]
    note: str = Field(description="The status in words, with what was not verified.")


class RunFailure(BaseModel):
    """A training run that ran out of memory at a micro-batch this result had answered (reported
    by the accumulation helper's OOM guard through the service)."""

    micro_batch: int = Field(ge=1)
    accumulates: bool = Field(description="Whether the failed window accumulated (gradients alive).")
    message: str = ""
    reported_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


class AllocatorComparison(BaseModel):
    """The same probe with other caching-allocator settings (unconfirmed): what they change."""

    allocator_config: str = Field(description="The settings compared, as PYTORCH_CUDA_ALLOC_CONF.")
    max_micro_batch: int | None
    max_micro_batch_without_accumulation: int | None
    trials: int = Field(ge=0, description="Trials the second probe ran.")


class CheckpointingCandidate(BaseModel):
    """One activation-checkpointing setting a probe compared: its answers, its plan and the plan's
    measured speed (`--checkpointing auto`)."""

    setting: str = Field(description="none, full or every=K (every K-th repeated block).")
    max_micro_batch: int | None = Field(default=None, description="The answer with accumulation, as searched.")
    max_micro_batch_without_accumulation: int | None = None
    answers: list[LoopAnswer] = Field(default_factory=list, description="Each loop shape searched, and its answer.")
    plan: Plan | None = None
    micro_batch: int | None = Field(default=None, description="The micro-batch timed: the plan's (else the answer).")
    accumulation_steps: int | None = Field(default=None, description="The plan's micro-steps per optimizer step.")
    step_seconds: float | None = Field(default=None, description="Measured seconds per micro-step at micro_batch.")
    seconds: float | None = Field(
        default=None, description="Seconds per optimizer step (accumulation steps x step time), or per sample."
    )
    samples_per_second: float | None = Field(
        default=None, description="The plan's measured samples per second: effective batch / seconds per step."
    )
    peak_bytes: int | None = Field(default=None, description="Peak (reserved) bytes of the timed trial.")
    trials: list[TrialRecord] = Field(default_factory=list, description="This setting's trials, in order.")
    fingerprint: str | None = None
    reason: str | None = Field(default=None, description="Why this setting has no answer (nothing fits).")


class CheckpointingChoice(BaseModel):
    """The activation-checkpointing setting chosen with the micro-batch: every candidate, and why the
    chosen one won (the fastest measured samples per second; within `tie_tolerance` of the fastest, the
    one with less checkpointing). The result's answers, plan and trials are the chosen setting's."""

    chosen: str
    basis: Literal["optimizer-step", "sample"] = Field(
        description="optimizer-step: each plan's time for the effective batch; sample: the answer's samples/s."
    )
    tie_tolerance: float = Field(description="Speeds this close to the fastest (a fraction) are a tie.")
    candidates: list[CheckpointingCandidate]
    reason: str = Field(description="Why the chosen setting won, in words.")

    @property
    def trials(self) -> int:
        """Trials of every setting compared."""
        return sum(len(c.trials) for c in self.candidates)


class JobBatch(BaseModel):
    """A framework job's batch settings: what each device's loader gives one micro-step, how many
    micro-steps make an optimizer step, and over how many processes."""

    micro_batch: int = Field(ge=1, description="Samples per micro-step per device (the loader's batch size).")
    accumulation_steps: int = Field(ge=1)
    world_size: int = Field(ge=1)
    effective_batch: int = Field(ge=1, description="micro_batch × accumulation_steps × world_size.")

    @classmethod
    def of(cls, micro_batch: int, accumulation_steps: int, world_size: int) -> JobBatch:
        return cls(
            micro_batch=micro_batch,
            accumulation_steps=accumulation_steps,
            world_size=world_size,
            effective_batch=micro_batch * accumulation_steps * world_size,
        )


class GradientCheck(BaseModel):
    """One accumulation window against one batch of the same samples, in the framework's own step:
    whether accumulating trains like the effective batch (the loss averaged over the window)."""

    micro_batch: int = Field(ge=1, description="Samples per micro-step of the window checked.")
    accumulation_steps: int = Field(ge=1, description="Micro-steps of the window: the plan's.")
    factor: float | None = Field(
        default=None, description="The window's gradient norm over the whole batch's: 1.0 when equivalent."
    )
    difference: float | None = Field(default=None, description="|window gradient - batch gradient| / |batch gradient|.")
    tolerance: float = Field(description="The largest difference taken for float rounding, at the job's precision.")
    equivalent: bool | None = Field(description="difference <= tolerance; None when the check could not run.")
    seconds: float = 0.0
    error: str | None = Field(default=None, description="Why the check could not run.")


class FrameworkTuning(BaseModel):
    """What an integration (Trainer, Lightning, Accelerate) did with the job: the batch it was
    configured with, the effective batch it planned for and why, what the framework now runs, the
    gradient check, and what tuning cost."""

    framework: Literal["transformers", "lightning", "accelerate"]
    job: JobBatch | None = Field(
        description="The job as configured before tuning; None when its batch size is unknown (a Dataset)."
    )
    effective_batch: int | None = Field(
        description="The effective batch the plan is for; None with effective_batch='max' (no accumulation)."
    )
    effective_batch_from: Literal["job", "argument", "max"] = Field(
        description="job: the job's own (the default); argument: effective_batch=N; max: the largest micro-batch."
    )
    tuned: JobBatch = Field(description="What the framework runs after tuning.")
    gradient_check: GradientCheck | None = Field(
        default=None, description="None when the plan does not accumulate, or the check was turned off."
    )
    trials: int = Field(ge=0, description="Trials of the framework's loop, every loop shape.")
    seconds: float = Field(ge=0, description="The whole tune: the worst-case scan, the trials and the check.")


class ProbeResult(BaseModel):
    """Everything a probe found. Stored by `fingerprint`; `max_micro_batch` is the answer."""

    schema_version: int = SCHEMA_VERSION
    fingerprint: str
    workload: WorkloadRef
    device: DeviceInfo
    budget_policy: Literal["total", "free", "memory"]
    budget_bytes: int = Field(description="Memory the probe was allowed before headroom.")
    headroom_bytes: int = Field(ge=0)
    limit_bytes: int = Field(description="budget_bytes - headroom_bytes: the peak a fitting trial stays under.")
    max_micro_batch: int | None = Field(
        ge=1,
        description="The answer for `loop`: with accumulation (the safe one) unless `loop` says otherwise. None "
        "when no size fits with accumulation while one micro-step fits: `accumulation_failure` says why, and plans "
        "that need no accumulation come from `max_micro_batch_without_accumulation`.",
    )
    accumulation_failure: str | None = Field(
        default=None, description="Why no micro-batch fits the accumulating loop (max_micro_batch is None)."
    )
    capped: bool = Field(description="True when the cap (--max-batch) fitted: the true maximum may be larger.")
    loop: LoopShape = Field(default_factory=LoopShape, description="The loop `max_micro_batch` was verified for.")
    max_micro_batch_without_accumulation: int | None = Field(
        default=None, description="The answer for one micro-step per optimizer step (no gradients alive in forward)."
    )
    answers: list[LoopAnswer] = Field(default_factory=list, description="Each loop shape searched, and its answer.")
    confirmation: Confirmation | None = Field(
        default=None, description="The answer run again in fresh processes; status 'skipped' with --no-confirm."
    )
    batch_norm: bool = Field(
        default=False,
        description="The model has BatchNorm or SyncBatchNorm layers: with accumulation they normalize "
        "each micro-batch by its own statistics, not the effective batch's.",
    )
    run_failures: list[RunFailure] = Field(
        default_factory=list, description="Runs that ran out of memory at an answer; each lowered it below the size."
    )
    max_batch_cap: int | None = None
    granularity: int = 1
    search: Literal["plain", "predict"] = "plain"
    prediction: Prediction | None = None
    objective: Literal["memory", "throughput"] = "memory"
    throughput: ThroughputChoice | None = None
    trials: list[TrialRecord]
    plan: Plan | None = None
    allocator_config: str | None = None
    allocator_comparison: AllocatorComparison | None = Field(
        default=None, description="With compare_allocator_config: the answers under those settings."
    )
    notes: list[str] = Field(
        default_factory=list,
        description="What the probe did or saw beyond the search, in words: a comparison that did not run, memory "
        "the first trials left (counted as the job's own from then on).",
    )
    framework: FrameworkTuning | None = Field(
        default=None, description="Set by the framework integrations: the job's batch, kept or changed, and the check."
    )
    checkpointing: CheckpointingChoice | None = Field(
        default=None,
        description="With --checkpointing auto (or a list of settings): each setting compared and the one chosen; "
        "the answers, plan and trials above are the chosen setting's.",
    )
    versions: Versions
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    duration_seconds: float = 0.0

    @property
    def trial_at_answer(self) -> TrialRecord | None:
        if self.max_micro_batch is None:  # no accumulating answer: the one-micro-step answer's trial
            single = self.max_micro_batch_without_accumulation
            return next((t for t in self.trials if t.batch == single and t.fits and t.micro_steps == 1), None)
        return next((t for t in self.evidence() if t.batch == self.max_micro_batch and t.fits), None)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def breakdown(self) -> MemoryBreakdown | None:
        """What filled the memory at the peak of the trial at the answer (its `trials[].breakdown`):
        parameters, gradients, optimizer state, activations and temporaries, and the op of the peak."""
        at = self.trial_at_answer
        return None if at is None else at.breakdown

    @computed_field  # type: ignore[prop-decorator]
    @property
    def verdict(self) -> Verdict:
        """Each answer's loop and confirmation, and the result's status and exit code."""
        return _verdict(self)

    def loop_trials(self, micro_steps: int | None = None) -> list[TrialRecord]:
        """The trials of one loop shape (the answer's by default)."""
        wanted = self.loop.micro_steps if micro_steps is None else micro_steps
        return [t for t in self.trials if t.micro_steps == wanted]

    def lowered_by_run(self, failure: RunFailure) -> ProbeResult:
        """This result after a run ran out of memory at `failure.micro_batch`: the answer for that
        loop kind drops below it (never below the granularity), and the failure is recorded."""
        below = (failure.micro_batch - 1) // self.granularity * self.granularity
        acc, single = self.max_micro_batch, self.max_micro_batch_without_accumulation
        if below >= self.granularity:
            if failure.accumulates:
                acc = None if acc is None else min(acc, below)
            else:
                single = below if single is None else min(single, below)
                acc = None if acc is None else min(acc, single)
        return self.model_copy(
            update={
                "max_micro_batch": acc,
                "max_micro_batch_without_accumulation": single,
                "capped": self.capped and acc == self.max_micro_batch,
                "run_failures": [*self.run_failures, failure],
            }
        )

    def evidence(self) -> list[TrialRecord]:
        """What shows the answer: fitting runs of its loop kind, and failing runs of its loop kind or
        of one micro-step (a size that fails without accumulation fails with it), from the search
        and from the fresh-process confirmation."""
        accumulates = self.loop.accumulates
        runs = [*self.trials]
        if self.confirmation is not None:
            runs += [r for c in self.confirmation.checks for r in c.runs]
        return [r for r in runs if (r.micro_steps > 1) == accumulates or (accumulates and not r.fits)]

    def make_plan(self, effective_batch: int, world_size: int = 1, policy: Policy | str = Policy.FEWEST_STEPS) -> Plan:
        """A plan that combines each micro-batch only with a loop shape it was verified for: one
        micro-step of E/W when that fits without accumulation, else accumulation with the answer
        verified for it."""
        made = plan_for_loops(
            effective_batch,
            self.max_micro_batch,
            world_size,
            policy,
            without_accumulation=self.max_micro_batch_without_accumulation,
            accumulation_verified=self.loop.accumulates,
            accumulation_failure=self.accumulation_failure,
        )
        return self.with_model_warnings(made)

    def with_model_warnings(self, made: Plan) -> Plan:
        """`made` with what the model makes of its accumulation (BatchNorm's statistics)."""
        if not self.batch_norm or made.accumulation_steps == 1:
            return made
        warning = (
            f"the model has BatchNorm: with {made.accumulation_steps} micro-steps its statistics (and running "
            f"averages) come from micro-batches of at most {made.micro_batch} samples, not from the effective "
            f"batch of {made.effective_batch}; GroupNorm or LayerNorm, or fewer, larger micro-batches, avoid it"
        )
        return made.model_copy(update={"warnings": [*made.warnings, warning]})


def _verdict(result: ProbeResult) -> Verdict:
    confirmation = result.confirmation
    checks = [] if confirmation is None else confirmation.checks
    single_loop = next((a.loop for a in result.answers if not a.loop.accumulates), None) or result.loop.model_copy(
        update={"micro_steps": 1}
    )
    plan: Plan | None = result.__dict__.get("plan")  # the field itself: a loaded result guards `.plan`
    named: list[tuple[AnswerName, int | None, LoopShape]] = [
        ("max_micro_batch", result.max_micro_batch, result.loop),
        ("max_micro_batch_without_accumulation", result.max_micro_batch_without_accumulation, single_loop),
    ]
    if plan is not None:
        named.append(("plan", plan.micro_batch, single_loop if plan.accumulation_steps == 1 else result.loop))
    answers: list[AnswerVerdict] = []
    for name, size, loop in named:
        if size is None:
            continue
        # Its own fresh run, or a larger one of the same loop kind that fitted (memory grows with the batch).
        runs = [
            c
            for c in checks
            if c.loop.accumulates == loop.accumulates and c.confirmed is not None and c.confirmed >= size
        ]
        own = next((c for c in runs if c.answer == name), None)
        check = own or (min(runs, key=lambda c: c.confirmed or 0) if runs else None)
        confirmed: bool | None
        if confirmation is None or confirmation.status == "skipped" or check is None:
            confirmed, again = None, "not run again in a fresh process"
        elif check.mismatch:
            confirmed, again = False, "NOT confirmed: its fresh run did not repeat the probe's peak"
        else:
            covered = "" if check is own else f" (covered by {check.confirmed}'s run)"
            confirmed = True
            again = f"confirmed in a fresh process{covered}"
            if check is own and check.confirmed is not None and check.confirmed < check.searched:
                again += f", lowered there from {check.searched}"
        label = {"max_micro_batch": "max micro-batch", "plan": "the plan's micro-batch"}.get(
            name, "max micro-batch without accumulation"
        )
        words = f"{label} {size}: verified for {loop.describe()}; {again}"
        answers.append(AnswerVerdict(answer=name, micro_batch=size, loop=loop, confirmed=confirmed, words=words))
    if confirmation is None:
        status, note = "unconfirmed", "unconfirmed: this result has no fresh-process confirmation"
    elif confirmation.status == "skipped":
        status, note = "unconfirmed", confirmation.note or "unconfirmed: not run again in a fresh process"
    elif confirmation.status == "mismatch" or any(a.confirmed is False for a in answers):
        status, note = "not-confirmed", confirmation.note.removeprefix("not confirmed: ")
    else:
        status, note = "confirmed", "every answer fitted again in a fresh process"
        if confirmation.status == "stepped-down":
            note += ", where some were lowered"
    return Verdict(
        status=status,  # type: ignore[arg-type]
        exit_code=NOT_CONFIRMED_EXIT_CODE if status == "not-confirmed" else 0,
        answers=answers,
        note=note,
    )


# The result file -------------------------------------------------------------------------------
def write_file(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` as a Unix tool writes a file, whole or not at all: into a new file beside
    the target (same directory, so same file system), flushed to the disk, then renamed over it, so
    that a crash or a full disk never leaves half a file where a job will read one. A symlink is
    written through to its target (which it keeps pointing to); the file keeps an existing file's
    permissions, and a new one has the process's umask's (0644 by default). A FIFO, a device, a
    socket or a directory is refused with one line (ConfigError), not replaced. Returns the file
    written (the symlink's target)."""
    import secrets
    import stat

    given = Path(path).expanduser()
    target = Path(os.path.realpath(given))  # through every symlink, to the file itself
    try:
        existing: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise ConfigError(f"{given}: {file_kind(existing.st_mode)}, not a file: give the path of a file to write")
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never through a link someone put there; mode 0666 less the umask, as `>` creates a file.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        if existing is not None:  # the file it replaces keeps its permissions (and, where we may, owner)
            os.fchmod(handle, stat.S_IMODE(existing.st_mode))
            if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
                with contextlib.suppress(OSError):
                    os.fchown(handle, existing.st_uid, existing.st_gid)
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself, to the disk
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return target


def file_kind(mode: int) -> str:
    import stat

    for test, words in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def save_result(result: ProbeResult, path: str | Path) -> Path:
    """Write `result` as JSON to `path` whole or not at all (`write_file`: a temporary file beside it,
    renamed over it; through a symlink to its target; a new file with the umask's permissions, an
    existing one's kept); a FIFO, a device or a directory is refused (ConfigError). Returns the file
    written."""
    return write_file(path, (result.model_dump_json(indent=2) + "\n").encode("utf-8"))


class SavedResult(ProbeResult):
    """A probe result read from a file, for a job to run: its `.plan` is the plan, checked first.

    `.plan` raises UnconfirmedError when the answers were not confirmed in a fresh process (a fresh
    run did not repeat the probe's peak, or --no-confirm), unless the file was loaded with
    `allow_unconfirmed=True`; and ConfigError naming `--effective-batch` when the probe made no plan.
    Everything else reads as the result's own."""

    _allow_unconfirmed: bool = PrivateAttr(default=False)
    _source: str = PrivateAttr(default="the result")

    def __getattribute__(self, name: str) -> Any:
        if name == "plan":
            return object.__getattribute__(self, "checked_plan")()
        return super().__getattribute__(name)

    def __eq__(self, other: object) -> bool:
        """Equal to the result it was saved from: the same fields, whatever it was loaded with."""
        if isinstance(other, ProbeResult):
            return self.__dict__ == other.__dict__
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as ProbeResult's: a mutable model

    def checked_plan(self) -> Plan:
        """The plan to run; see the class's docstring for what it refuses."""
        plan: Plan | None = self.__dict__.get("plan")
        source = self._source
        if plan is None:
            raise ConfigError(
                f"{source} has no plan: it was probed without --effective-batch. Probe again with "
                "`--effective-batch E` (the samples per optimizer step your job wants), or make one from its "
                "answers with `.make_plan(E)`"
            )
        verdict = self.verdict
        if verdict.status != "confirmed" and not self._allow_unconfirmed:
            raise UnconfirmedError(
                f"{source}'s plan was not confirmed ({verdict.note}): probe again (the exit code says whether the "
                "answer was confirmed), or load it with autotune.load_result(path, allow_unconfirmed=True) to run it "
                "anyway"
            )
        return plan


def load_result(path: str | Path, *, allow_unconfirmed: bool = False) -> SavedResult:
    """The probe result in `path` (`autotune probe --save PATH`, or `--json > PATH`): its `.plan` is the
    plan to run (`plan.sampler(len(dataset))` gives a loader its micro-batches), its answers the sizes.

    `.plan` raises UnconfirmedError for answers a fresh process did not confirm (`verdict.status`
    is not "confirmed"), unless `allow_unconfirmed`, and ConfigError for a result probed without
    --effective-batch. Raises ConfigError naming the file and what is wrong with it."""
    source = Path(path).expanduser()
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{source}: no such file: save a probe's result with `autotune probe TARGET --save {source}`"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot be read ({exc})") from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not JSON (line {exc.lineno}: {exc.msg}): is it a probe's --save file?") from None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        message = data["error"].get("message", "no message")
        raise ConfigError(f"{source} holds a failed probe, not a result: {message}")
    try:
        result = SavedResult.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError
        first = str(exc).splitlines()
        detail = "; ".join(line.strip() for line in first[1:3]) if len(first) > 1 else str(exc)
        raise ConfigError(f"{source} is not a probe result ({detail})") from None
    result._allow_unconfirmed = allow_unconfirmed
    result._source = str(source)
    return result
