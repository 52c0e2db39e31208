"""The service's wire format: request bodies and responses, as served in the OpenAPI document.

Result documents are `autotune.results.ProbeResult` unchanged, plans are `autotune.plan.Plan`.
Sizes accept a byte count or a string with a unit ("512MiB"); headroom a fraction (0.05), a
percentage ("5%") or a size ("2GiB"). Every field is bounded: a request is either valid and
cheap to serve, or a 422 naming the field.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from autotune.errors import ConfigError
from autotune.plan import Plan, Policy
from autotune.registry import NAME_PATTERN
from autotune.results import ProbeResult, TrialRecord
from autotune.store import JobError, JobStatus
from autotune.units import parse_headroom, parse_size

MAX_BATCH = 2**20  # samples: more than any micro-batch or effective batch we have seen asked for
MAX_STEPS = 20  # training steps per trial: 2 reach the steady state, a few more smooth timings
MAX_WAIT = 60.0  # seconds a plan query may block; clients loop for longer waits
DEVICE_PATTERN = r"^(cpu|cuda|cuda:\d{1,3})$"


def size_value(value: object) -> int | None:
    """A byte size from JSON or a query string; ValueError (a 422) for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("a size is a number of bytes or a string such as 512MiB")
    if isinstance(value, str) and len(value) > 32:
        raise ValueError("a size is at most 32 characters")
    try:
        size = parse_size(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    if size < 1:
        raise ValueError("a size must be at least 1 byte")
    return size


def headroom_value(value: object) -> float | int | None:
    """Headroom from JSON or a query string; ValueError (a 422) for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("headroom is a fraction (0.05), a percentage ('5%') or a size ('2GiB')")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("headroom must be finite")
    if isinstance(value, str) and len(value) > 32:
        raise ValueError("headroom is at most 32 characters")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("headroom in bytes must not be negative")
        return value
    try:
        return parse_headroom(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


class _MemoryFields(BaseModel):
    """Parses the `memory` and `headroom` that probe requests and plan queries both take."""

    @field_validator("memory", mode="before", check_fields=False)
    @classmethod
    def _memory(cls, value: object) -> int | None:
        return size_value(value)

    @field_validator("headroom", mode="before", check_fields=False)
    @classmethod
    def _headroom(cls, value: object) -> float | int | None:
        return headroom_value(value)


class ProbeCreate(_MemoryFields):
    """`POST /v1/probes`: probe a registered workload. Omitted fields take the server's defaults
    (AUTOTUNE_* settings) and the workload's registered ones."""

    model_config = ConfigDict(extra="forbid")

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload's name (GET /v1/workloads).")
    device: str | None = Field(
        default=None,
        pattern=DEVICE_PATTERN,
        description="cpu (the budget device), cuda or cuda:N. Default: cuda:0 when the node has a GPU, else cpu.",
    )
    memory: int | str | None = Field(
        default=None, description="Probe as if the device had this much memory: bytes or e.g. '24GiB'."
    )
    budget: Literal["total", "free"] | None = Field(default=None, description="GPU budget: the card's total or free.")
    headroom: float | int | str | None = Field(default=None, description="Kept free: 0.05, '5%' or '2GiB'.")
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS, description="Training steps per trial.")
    max_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH, description="Never try more than this.")
    granularity: int | None = Field(default=None, ge=1, le=4096, description="Only try multiples of this.")
    refresh: bool = Field(default=False, description="Probe again even when a result is stored.")


class PlanQuery(_MemoryFields):
    """`GET /v1/plan` query parameters. Parameters it does not know are ignored, as usual in a
    query string."""

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload.")
    effective_batch: int = Field(ge=1, le=MAX_BATCH, description="Samples per optimizer step, over all ranks.")
    world_size: int = Field(default=1, ge=1, le=65536, description="Data-parallel ranks.")
    policy: Policy = Field(default=Policy.FEWEST_STEPS, description="fewest-steps, or exact (equal micro-batches).")
    device: str | None = Field(default=None, pattern=DEVICE_PATTERN, description="cpu, cuda or cuda:N.")
    memory: int | None = Field(default=None, description="Probe as if the device had this much: bytes or e.g. 24GiB.")
    headroom: float | int | None = Field(default=None, description="Kept free: 0.05, 5% or 2GiB.")
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    wait: float = Field(
        default=0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="Seconds to wait for a probe to finish."
    )


class RunFailureReport(_MemoryFields):
    """`POST /v1/run-failures`: a run of a planned job ran out of memory at `micro_batch`."""

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload.")
    device: str | None = Field(default=None, pattern=DEVICE_PATTERN, description="cpu, cuda or cuda:N.")
    memory: int | None = Field(default=None, description="As in the plan query: bytes or e.g. 24GiB.")
    headroom: float | int | None = Field(default=None, description="As in the plan query: 0.05, 5% or 2GiB.")
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    micro_batch: int = Field(ge=1, le=MAX_BATCH, description="The micro-batch that ran out of memory in the run.")
    accumulates: bool = Field(default=True, description="Whether the failed window accumulated micro-steps.")
    message: str = Field(default="", max_length=2000, description="The OOM message the run saw.")


class RunFailureRecorded(BaseModel):
    """What the service now answers for that query."""

    request_key: str
    max_micro_batch: int
    max_micro_batch_without_accumulation: int | None
    detail: str


def query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    """OpenAPI `parameters` for a model read from the query string (enums inlined: a query
    parameter's schema cannot point into the model's own `$defs`)."""
    schema = model.model_json_schema()
    definitions = schema.get("$defs", {})
    required = set(schema.get("required", []))
    parameters = []
    for name, field in schema["properties"].items():
        reference = field.pop("$ref", None)
        if reference is not None:
            field = {**definitions[reference.rsplit("/", 1)[-1]], **field}
        description = field.pop("description", "")
        field.pop("title", None)
        parameters.append(
            {"name": name, "in": "query", "required": name in required, "description": description, "schema": field}
        )
    return parameters


class ProbeView(BaseModel):
    """A probe job: its status, the trials so far, then the result or the error."""

    id: str | None = Field(description="The job's id; None for a result stored without a job here (published).")
    status: JobStatus
    workload: str
    device: str
    request_key: str = Field(description="The canonical key of what was asked: identical requests share it.")
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    trials: list[TrialRecord] = Field(default_factory=list)
    result: ProbeResult | None = None
    error: JobError | None = None


class PlanView(BaseModel):
    """`GET /v1/plan` with a stored result: the plan and what it was made from."""

    workload: str
    device: str
    fingerprint: str = Field(description="The stored result's fingerprint.")
    max_micro_batch: int
    capped: bool = Field(description="The probe's cap fitted: a larger micro-batch may fit too.")
    plan: Plan


class PlanPending(BaseModel):
    """`GET /v1/plan` with no stored result yet: the probe that will produce it."""

    status: JobStatus
    detail: str
    probe: ProbeView


class PlanFailed(BaseModel):
    """`GET /v1/plan` when the probe for it failed: what went wrong."""

    detail: str
    probe: ProbeView


class WorkloadView(BaseModel):
    name: str
    target: str
    options: dict[str, Any]
    description: str
    precision: str
    optimizer: str
    steps: int
    max_batch: int | None
    granularity: int


class Published(BaseModel):
    """`POST /v1/results`: where the result is stored and which plan queries it now answers."""

    fingerprint: str
    workload: str = Field(description="The registered workload the result is for.")
    request_key: str | None = Field(
        description="The key of the plan queries it answers; None for a free-memory budget, which answers none."
    )
    detail: str


class StoredView(BaseModel):
    """`GET /v1/results/{fingerprint}`."""

    source: Literal["probe", "published"]
    stored_at: datetime
    result: ProbeResult


class GpuView(BaseModel):
    """One GPU (or MIG instance) as CUDA will number it, with what NVML reports about it."""

    id: str = Field(description="cuda:N: what requests name (CUDA_VISIBLE_DEVICES applied).")
    nvml_index: int
    uuid: str | None
    name: str | None
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None
    processes: list[dict[str, Any]] | None
    mig: bool = Field(description="A MIG instance rather than a whole GPU.")
    queue_depth: int = Field(description="Probe jobs queued or running on it.")


class BudgetDeviceView(BaseModel):
    id: Literal["cpu"] = "cpu"
    total_bytes: int = Field(description="Default size of the simulated device (AUTOTUNE_CPU_MEMORY).")
    max_bytes: int = Field(description="The largest size a request may ask (AUTOTUNE_MAX_CPU_MEMORY).")
    queue_depth: int


class DevicesView(BaseModel):
    """`GET /v1/devices`: the GPUs NVML sees, or why it sees none; the CPU budget device always."""

    nvml_available: bool
    reason: str | None = Field(description="Why there are no GPUs to list, when there are none.")
    driver_version: str | None
    gpus: list[GpuView]
    budget_device: BudgetDeviceView
    warnings: list[str] = Field(default_factory=list)


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    store: bool
    devices: list[str]
    results: int = Field(description="Request keys with a stored result, held in memory.")
    problems: list[str] = Field(default_factory=list)
    gpus: str | None = Field(
        default=None,
        description="Why no GPU is listed (no NVML library, no driver, no permission...): the node "
        "still serves the CPU budget device and stored results, so it is ready.",
    )


class ErrorView(BaseModel):
    detail: Any
