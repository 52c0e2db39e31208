"""The records a probe produces: each trial, the device it ran on, and the whole result.

These pydantic models are the boundary format: `autotune probe --json` prints a `ProbeResult`,
the service stores and returns it unchanged, and `POST /v1/results` validates against it.
Nothing here imports torch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from autotune.plan import Plan

SCHEMA_VERSION = 1


class TrialRecord(BaseModel):
    """One trial: `steps` full training steps at one micro-batch size."""

    model_config = ConfigDict(frozen=True)

    batch: int = Field(ge=1)
    fits: bool
    peak_allocated_bytes: int | None = Field(
        default=None,
        description="Highest live tensor bytes during the trial (reached or, for an OOM, at the failing allocation).",
    )
    peak_reserved_bytes: int | None = Field(
        default=None,
        description="Highest bytes held by the allocator (CUDA caching allocator; the budget device has no cache).",
    )
    seconds: float = Field(ge=0, description="Wall time of the whole trial.")
    step_seconds: float | None = Field(
        default=None, description="Wall time of the last (steady-state) step, for fitting trials."
    )
    oom_message: str | None = Field(default=None, description="First line of the OOM error, for failed trials.")

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


class WorkloadRef(BaseModel):
    """What was probed: a target (built-in example or module:attribute) and its options."""

    target: str
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    precision: Literal["fp32", "bf16", "fp16"]
    optimizer: str
    steps: int


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
        description="The first `probe_trials` entries of the result's trials recorded the timelines; "
        "they are real trials and count in the trial count.",
    )
    exact: bool | None = Field(default=None, description="Whether the verified answer equals the prediction.")
    first_guess: int | None = Field(
        default=None,
        description="CUDA: the guess from allocated bytes alone; a trial there measured reserved/allocated, "
        "which refined it into predicted_max_micro_batch.",
    )
    fallback_reason: str | None = None
    curve: list[CurvePoint] = Field(default_factory=list, description="Predicted peak bytes by batch size.")


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
    max_micro_batch: int = Field(ge=1)
    capped: bool = Field(description="True when the cap (--max-batch) fitted: the true maximum may be larger.")
    max_batch_cap: int | None = None
    granularity: int = 1
    search: Literal["plain", "predict"] = "plain"
    prediction: Prediction | None = None
    objective: Literal["memory", "throughput"] = "memory"
    throughput: ThroughputChoice | None = None
    trials: list[TrialRecord]
    plan: Plan | None = None
    allocator_config: str | None = None
    versions: Versions
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    duration_seconds: float = 0.0

    @property
    def trial_at_answer(self) -> TrialRecord | None:
        return next((t for t in self.trials if t.batch == self.max_micro_batch), None)
