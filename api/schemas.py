"""The service's wire format: request bodies and responses, as served in the OpenAPI document.

Result documents are `autotune.results.ProbeResult` unchanged, plans are `autotune.plans.plan.Plan`.
Sizes accept a byte count or a string with a unit ("512MiB"); headroom a fraction (0.05), a
percentage ("5%") or a size ("2GiB"). Every field is bounded: a request is either valid and
cheap to serve, or a 422 naming the field.

The document states exactly what is accepted: the grammar of a size or a headroom is one regular
expression (`SIZE_PATTERN`, `HEADROOM_PATTERN`), and the server checks a string against that same
expression before parsing it, so the schema and the server never disagree about a value. What a
schema cannot state (headroom against memory, memory against the device, an effective batch
against the world size) is a 422 whose `detail` is a message, not a list of field errors.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from autotune.errors import ConfigError
from autotune.plans.mixed import MixedPlan, Mode
from autotune.plans.plan import Plan, Policy
from autotune.request import parallel_spec
from autotune.results import SCHEMA_VERSION, ParallelSpec, ProbeResult, TrialRecord, Verdict
from autotune.store import JobError, JobWait
from autotune.units import parse_headroom, parse_size
from autotune.workloads.registry import NAME_PATTERN

MAX_BATCH = 2**20  # samples: more than any micro-batch or effective batch we have seen asked for
MAX_STEPS = 20  # training steps per trial: 2 reach the steady state, a few more smooth timings
MAX_WAIT = 60.0  # seconds a plan query may block; clients loop for longer waits
MAX_SIZE = 2**53  # bytes (8 PiB): a byte count as JSON numbers carry it exactly
DEVICE_PATTERN = r"^(cpu|cuda|cuda:[0-9]{1,3})$"
# An activation-checkpointing setting (none, full, every=K), auto, or a list of settings.
_SETTING = "(none|full|every=[1-9][0-9]{0,2})"
CHECKPOINTING_PATTERN = rf"^(auto|{_SETTING}(,{_SETTING}){{0,7}})$"
# A GPU model as NVML and torch name it ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"), or part of it.
MODEL_NAME = r"[A-Za-z0-9]([A-Za-z0-9 ._()+/-]{0,98}[A-Za-z0-9)])?"
GROUP_DEVICE_PATTERN = rf"^(cuda:[0-9]{{1,3}}|{MODEL_NAME})$"
MAX_GROUPS = 16
JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
FINGERPRINT_PATTERN = r"^[0-9a-f]{64}$"

# A size as a string, as `autotune.units.parse_size` reads it, and never less than one byte: a
# number from 1 (no leading zero) with an optional unit ("128MiB", "3.5GiB", "80GB", "134217728"),
# or a number below 1 with a unit large enough ("0.5GiB", "0.25MB", "0.5KiB": its first nonzero
# digit within as many decimals as the unit has thousands).
_NUMBER = r"[1-9][0-9]{0,15}(\.[0-9]{1,6})?"
_UNIT = r"([KkMmGgTt]([Ii]?[Bb])?|[Bb])"
_BELOW_ONE = r"0\.0{0,5}[1-9][0-9]{0,5} ?[MmGgTt]([Ii]?[Bb])?|0\.0{0,2}[1-9][0-9]{0,5} ?[Kk]([Ii]?[Bb])?"
_SIZE_WITH_UNIT = rf"{_NUMBER} ?{_UNIT}|{_BELOW_ONE}"
SIZE_PATTERN = rf"^({_NUMBER} ?{_UNIT}?|{_BELOW_ONE})$"
# Headroom as a string: a fraction below 1 ("0.05"), a percentage below 100 ("5%", "12.5%"), or
# a size with its unit ("2GiB": a bare "5" would be ambiguous, so a size needs its unit).
HEADROOM_PATTERN = rf"^(0(\.[0-9]{{1,6}})?|([0-9]|[1-9][0-9])(\.[0-9]{{1,6}})?%|{_SIZE_WITH_UNIT})$"
_SIZE_TEXT = re.compile(SIZE_PATTERN.replace("$", r"\Z"))
_HEADROOM_TEXT = re.compile(HEADROOM_PATTERN.replace("$", r"\Z"))
_BARE_NUMBER = re.compile(r"[0-9]{1,20}(\.[0-9]{1,6})?\Z")

_SIZE_HELP = "a byte count (1 to 2^53) or a string such as 512MiB, 24GiB or 80GB"
_HEADROOM_HELP = "a fraction in [0, 1) (0.05), a percentage below 100 ('5%') or a size with its unit ('2GiB')"
SIZE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "integer", "minimum": 1, "maximum": MAX_SIZE},
        {"type": "string", "pattern": SIZE_PATTERN},
    ]
}
# A bare number is a fraction, as on the command line: "headroom": 5 meant as 5% would otherwise
# be 5 bytes of headroom, so a size needs its unit (a string) here too.
HEADROOM_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        {"type": "string", "pattern": HEADROOM_PATTERN},
    ]
}
# In a query string every value is text: headroom is its string form only.
HEADROOM_QUERY_SCHEMA: dict[str, Any] = {"type": "string", "pattern": HEADROOM_PATTERN}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [*schema.get("anyOf", [schema]), {"type": "null"}]}


Size = Annotated[int | str | None, WithJsonSchema(_nullable(SIZE_SCHEMA))]
Headroom = Annotated[float | int | str | None, WithJsonSchema(_nullable(HEADROOM_SCHEMA))]


def size_value(value: object) -> int | None:
    """A byte size from JSON or a query string; ValueError (a 422) for anything else."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON Schema counts 5.0 as the integer 5
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"a size is {_SIZE_HELP}")
    if isinstance(value, int):
        if not 1 <= value <= MAX_SIZE:
            raise ValueError(f"a size in bytes is from 1 to 2^53, not {value}")
        return value
    if not _SIZE_TEXT.match(value):
        raise ValueError(f"a size is {_SIZE_HELP}: {value[:40]!r} is not")
    try:
        return parse_size(value)
    except ConfigError as exc:  # not expected: the pattern admits only what parses
        raise ValueError(str(exc)) from None


def headroom_value(value: object) -> float | int | None:
    """Headroom from JSON or a query string; ValueError (a 422) for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"headroom is {_HEADROOM_HELP}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError("headroom must be finite")
        shown = str(value) if isinstance(value, int) else f"{value:g}"
        if value >= 1:
            try:  # the command line's words: "did you mean 5%?"
                parse_headroom(shown)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        if not 0 <= value < 1:
            raise ValueError(f"headroom is {_HEADROOM_HELP}, not {shown}")
        return value
    if not _HEADROOM_TEXT.match(value):
        if _BARE_NUMBER.match(value):  # "5" in a query string: the command line's "did you mean 5%?"
            try:
                parse_headroom(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        raise ValueError(f"headroom is {_HEADROOM_HELP}: {value[:40]!r} is not")
    try:
        return parse_headroom(value)
    except ConfigError as exc:  # not expected: the pattern admits only what parses
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


# Rules across fields, stated in the schema so that a client (or a schema-driven tester) can tell a
# valid request from the document alone: FSDP shards over two ranks or more. JSON Schema states it
# as "parallel is not fsdp, or world_size is given and at least 2" (world_size's default is 1).
FSDP_RULE: dict[str, Any] = {
    "anyOf": [
        {"properties": {"parallel": {"enum": ["none", "ddp"]}}},
        {"required": ["world_size"], "properties": {"world_size": {"minimum": 2}}},
    ]
}
# A mixed plan's world is the sum of its groups' ranks: two groups, or one of two ranks or more.
MIXED_FSDP_RULE: dict[str, Any] = {
    "anyOf": [
        {"properties": {"parallel": {"enum": ["none", "ddp"]}}},
        {"properties": {"groups": {"minItems": 2}}},
        {"properties": {"groups": {"contains": {"required": ["ranks"], "properties": {"ranks": {"minimum": 2}}}}}},
    ]
}


class _ParallelFields(BaseModel):
    """How the job runs the model across ranks: what a rank holds, so part of the request key."""

    model_config = ConfigDict(json_schema_extra=FSDP_RULE)

    parallel: Literal["none", "ddp", "fsdp"] = Field(
        default="none",
        description="none; ddp: each rank's model in DistributedDataParallel (its gradient buckets counted); fsdp: "
        "FSDP2 over world_size ranks, rank 0 of the job simulated on one device.",
    )
    world_size: int = Field(default=1, ge=1, le=65536, description="Data-parallel ranks (FSDP shards over them).")
    reshard_after_forward: bool = Field(
        default=True, description="FSDP with autotune's per-block sharding: free gathered parameters after forward."
    )

    def parallel_spec(self) -> ParallelSpec:
        """Raises ConfigError (422) for FSDP over one rank: a rule across fields, which the
        schema cannot state."""
        if self.parallel == "fsdp" and self.world_size < 2:
            raise ConfigError("parallel=fsdp shards over world_size ranks: give world_size 2 or more")
        return parallel_spec(self.parallel, self.world_size, self.reshard_after_forward)


class ProbeCreate(_ParallelFields, _MemoryFields):
    """`POST /v1/probes`: probe a registered workload. Omitted fields take the server's defaults
    (AUTOTUNE_* settings) and the workload's registered ones."""

    model_config = ConfigDict(extra="forbid")

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload's name (GET /v1/workloads).")
    device: str | None = Field(
        default=None,
        pattern=DEVICE_PATTERN,
        description="cpu (the budget device), cuda or cuda:N. Default: cuda:0 when the node has a GPU, else cpu.",
    )
    memory: Size = Field(default=None, description=f"Probe as if the device had this much memory: {_SIZE_HELP}.")
    budget: Literal["total", "free"] | None = Field(default=None, description="GPU budget: the card's total or free.")
    headroom: Headroom = Field(default=None, description=f"Kept free: {_HEADROOM_HELP}.")
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS, description="Training steps per trial.")
    max_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH, description="Never try more than this.")
    granularity: int | None = Field(default=None, ge=1, le=4096, description="Only try multiples of this.")
    refresh: bool = Field(default=False, description="Probe again even when a result is stored.")


class PlanQuery(_ParallelFields, _MemoryFields):
    """`GET /v1/plan` query parameters. Parameters it does not know are ignored, as usual in a
    query string. Frozen once validated: `memory` and `headroom` hold what they parse to, so two
    spellings of one query (memory=128MiB, memory=134217728) are equal and hash alike."""

    model_config = ConfigDict(frozen=True)

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload.")
    effective_batch: int = Field(ge=1, le=MAX_BATCH, description="Samples per optimizer step, over all ranks.")
    policy: Policy = Field(default=Policy.FEWEST_STEPS, description="fewest-steps, or exact (equal micro-batches).")
    device: str | None = Field(default=None, pattern=DEVICE_PATTERN, description="cpu, cuda or cuda:N.")
    memory: Annotated[int | None, WithJsonSchema(SIZE_SCHEMA)] = Field(
        default=None, description=f"Probe as if the device had this much memory: {_SIZE_HELP}."
    )
    headroom: Annotated[float | int | None, WithJsonSchema(HEADROOM_QUERY_SCHEMA)] = Field(
        default=None, description=f"Kept free: {_HEADROOM_HELP}."
    )
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    wait: float = Field(
        default=0.0, ge=0, le=MAX_WAIT, allow_inf_nan=False, description="Seconds to wait for a probe to finish."
    )
    checkpointing: str | None = Field(
        default=None,
        pattern=CHECKPOINTING_PATTERN,
        description="Activation checkpointing of the model's repeated blocks: none, full or every=K (a setting), or "
        "auto (none and full) or a list (none,every=2,full): the probe times each setting's plan for this "
        "effective batch and the plan runs with the fastest; the answer says which (`checkpointing`).",
    )


class MixedGroupQuery(_MemoryFields):
    """One group of a mixed world: the ranks of one GPU model."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field(
        pattern=GROUP_DEVICE_PATTERN,
        description="cpu, cuda or cuda:N of this node (as in GET /v1/plan), or a GPU model as NVML names it "
        "('NVIDIA A100-SXM4-40GB', or a part naming one model: 'A100-SXM4-40GB') whose result is stored, "
        "probed on any node (POST /v1/results).",
    )
    ranks: int = Field(ge=1, le=65536, description="Data-parallel ranks on this GPU model.")
    memory: Annotated[int | None, WithJsonSchema(_nullable(SIZE_SCHEMA))] = Field(
        default=None, description=f"As in the plan query: {_SIZE_HELP}."
    )
    headroom: Annotated[float | int | None, WithJsonSchema(_nullable(HEADROOM_SCHEMA))] = Field(
        default=None, description=f"As in the plan query: {_HEADROOM_HELP}."
    )


class MixedPlanQuery(BaseModel):
    """`POST /v1/plan/mixed`: one plan for a job whose ranks span GPU models, from each model's stored result."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=MIXED_FSDP_RULE)

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload.")
    effective_batch: int = Field(ge=1, le=MAX_BATCH, description="Samples per optimizer step, over all ranks.")
    groups: list[MixedGroupQuery] = Field(
        min_length=1,
        max_length=MAX_GROUPS,
        description="The ranks of each GPU model; ranks are numbered in this order.",
    )
    mode: Mode = Field(
        default=Mode.PER_MODEL,
        description="per-model: each model's micro-batches up to its own answer, with loss weights from the global "
        "sample count; uniform: every rank the same micro-batches, at most the smallest answer.",
    )
    policy: Policy = Field(default=Policy.FEWEST_STEPS, description="fewest-steps, or exact (mode uniform only).")
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    parallel: Literal["none", "ddp", "fsdp"] = Field(
        default="none",
        description="As in the plan query; FSDP shards over every rank of every group (their sum is its world size).",
    )
    reshard_after_forward: bool = Field(default=True, description="As in the plan query.")

    def world_size(self) -> int:
        return sum(group.ranks for group in self.groups)

    def parallel_spec(self) -> ParallelSpec:
        """Raises ConfigError (422) for FSDP over one rank in all."""
        if self.parallel == "fsdp" and self.world_size() < 2:
            raise ConfigError("parallel=fsdp shards over the ranks of all groups: give 2 or more ranks in all")
        return parallel_spec(self.parallel, self.world_size(), self.reshard_after_forward)


class RunFailureReport(_ParallelFields, _MemoryFields):
    """`POST /v1/run-failures`: a run of a planned job ran out of memory at `micro_batch`."""

    workload: str = Field(pattern=NAME_PATTERN, description="A registered workload.")
    device: str | None = Field(default=None, pattern=DEVICE_PATTERN, description="cpu, cuda or cuda:N.")
    memory: Annotated[int | None, WithJsonSchema(_nullable(SIZE_SCHEMA))] = Field(
        default=None, description=f"As in the plan query: {_SIZE_HELP}."
    )
    headroom: Annotated[float | int | None, WithJsonSchema(_nullable(HEADROOM_SCHEMA))] = Field(
        default=None, description=f"As in the plan query: {_HEADROOM_HELP}."
    )
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    optimizer: Literal["sgd", "adam", "adamw"] | None = None
    micro_batch: int = Field(ge=1, le=MAX_BATCH, description="The micro-batch that ran out of memory in the run.")
    accumulates: bool = Field(default=True, description="Whether the failed window accumulated micro-steps.")
    message: str = Field(default="", max_length=2000, description="The OOM message the run saw.")


def _published_schema(schema: dict[str, Any]) -> None:
    # What a published result must be that the schema can state: this version, a sha256, and a
    # limit the server works out itself (budget minus headroom), so that it cannot disagree.
    properties = schema["properties"]
    properties["schema_version"] = {**properties["schema_version"], "const": SCHEMA_VERSION}
    properties["fingerprint"] = {**properties["fingerprint"], "pattern": FINGERPRINT_PATTERN}
    properties["limit_bytes"] = {
        **properties["limit_bytes"],
        "readOnly": True,
        "description": "budget_bytes - headroom_bytes, worked out by the server; when sent, it must be that.",
    }
    schema["required"] = [name for name in schema.get("required", []) if name != "limit_bytes"]


def _whole(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


class PublishedResult(ProbeResult):
    """`POST /v1/results`: a result as `autotune probe --json` writes it (`limit_bytes` may be left out)."""

    model_config = ConfigDict(json_schema_extra=_published_schema)

    @model_validator(mode="before")
    @classmethod
    def _limit(cls, data: Any) -> Any:
        if isinstance(data, dict) and "limit_bytes" not in data:
            budget, headroom = data.get("budget_bytes"), data.get("headroom_bytes")
            if _whole(budget) and _whole(headroom):  # JSON Schema counts 5.0 as an integer too
                return {**data, "limit_bytes": int(budget) - int(headroom)}  # type: ignore[arg-type]
        return data


class RunFailureRecorded(BaseModel):
    """What the service now answers for that query."""

    request_key: str
    max_micro_batch: int | None = Field(description="With accumulation; null when no size fits with it.")
    max_micro_batch_without_accumulation: int | None
    detail: str


def query_parameters(model: type[BaseModel], description: str) -> list[dict[str, Any]]:
    """OpenAPI `parameters` for a model read from the query string: one parameter whose schema is
    the model's object, serialized as `form` with `explode` (each field its own `name=value`, as
    separate parameters would be), so that the object can state the rules across fields (`anyOf`)
    that separate parameters cannot. Enums are inlined (a parameter's schema cannot point into the
    model's own `$defs`); no `null` (a query string has none: a field is present or absent)."""
    schema = model.model_json_schema()
    definitions = schema.get("$defs", {})
    properties = {}
    for name, field in schema["properties"].items():
        field = _inline(field, definitions)
        field.pop("title", None)
        if field.get("default", ...) is None:
            del field["default"]
        branches = [b for b in field.pop("anyOf", []) if b.get("type") != "null"]
        if len(branches) == 1:
            field = {**field, **branches[0]}
        elif branches:
            field["anyOf"] = branches
        properties[name] = field
    query: dict[str, Any] = {"type": "object", "properties": properties, "required": schema.get("required", [])}
    for rule in ("anyOf", "allOf"):
        if rule in schema:
            query[rule] = schema[rule]
    return [
        {
            "name": "query",
            "in": "query",
            "style": "form",
            "explode": True,
            "required": True,
            "description": description,
            "schema": query,
        }
    ]


def _inline(field: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    reference = field.pop("$ref", None)
    if reference is not None:
        field = {**definitions[reference.rsplit("/", 1)[-1]], **field}
    if "anyOf" in field:
        field["anyOf"] = [_inline(dict(branch), definitions) for branch in field["anyOf"]]
    return field


ProbeStatus = Literal["queued", "waiting", "running", "succeeded", "failed"]


class ProbeView(BaseModel):
    """A probe job: its status, the trials so far, then the result or the error.

    `queued`: no worker has taken it yet (again, after a worker running it stopped: `interruptions`);
    `waiting`: a worker has taken it and waits for the device, which another probe holds (`waiting`
    says who and since when); `running`: probing, since `started_at`; `succeeded`, `failed`: ended at
    `finished_at`, when the probe ended (not when the store recorded it). `waiting` is left out but
    while it waits, and `interruptions` while it is 0: a job that ran once, undisturbed, reads as it
    always did."""

    id: str | None = Field(description="The job's id; None for a result stored without a job here (published).")
    status: ProbeStatus
    workload: str
    device: str
    request_key: str = Field(description="The canonical key of what was asked: identical requests share it.")
    created_at: datetime | None = None
    started_at: datetime | None = Field(default=None, description="When its probe took the device and started.")
    finished_at: datetime | None = Field(default=None, description="When its probe ended.")
    trials: list[TrialRecord] = Field(default_factory=list)
    result: ProbeResult | None = None
    error: JobError | None = None
    waiting: JobWait | None = Field(
        default=None,
        exclude_if=lambda value: value is None,
        description="While `waiting` (and only then): since when, and who holds the device (the service, the CLI "
        "or a script).",
    )
    interruptions: int = Field(
        default=0,
        exclude_if=lambda value: not value,
        description="How often the worker running it stopped (killed, crashed, out of memory): each time it was "
        "queued again under this id and ran again. Left out while 0.",
    )


class PlanCheckpointing(BaseModel):
    """The activation checkpointing a plan runs with (a plan query that asked for it)."""

    setting: str = Field(description="none, full or every=K: what the job sets (the Trainer: gradient_checkpointing).")
    reason: str | None = Field(default=None, description="With a choice among settings: why this one won.")
    candidates: list[str] = Field(default_factory=list, description="The settings compared (a choice).")


class PlanView(BaseModel):
    """`GET /v1/plan` with a stored result: the plan and what it was made from."""

    workload: str
    device: str
    fingerprint: str = Field(description="The stored result's fingerprint.")
    max_micro_batch: int | None = Field(
        description="The answer with accumulation; null when no size fits with it (plans then run one micro-step)."
    )
    capped: bool = Field(description="The probe's cap fitted: a larger micro-batch may fit too.")
    parallel: ParallelSpec = Field(description="What a rank was probed in: the answer is per rank of such a job.")
    plan: Plan
    verdict: Verdict = Field(
        description="The stored result's answers, each with the loop it was verified for and whether a fresh "
        "process confirmed it; `status` is not 'confirmed' for a result whose answers were not run again or did "
        "not repeat there (the client refuses such a plan unless asked to allow it)."
    )
    checkpointing: PlanCheckpointing | None = Field(
        default=None, description="Only for a query with `checkpointing`: the setting the plan runs with."
    )


class MixedGroupView(BaseModel):
    """The stored result a group of a mixed plan was planned from."""

    name: str = Field(description="The group's name in the plan: its device as asked (numbered when repeated).")
    device: str = Field(description="The device as asked.")
    model: str = Field(description="The device model the result was probed on.")
    ranks: int
    request_key: str
    fingerprint: str = Field(description="The stored result's fingerprint.")
    max_micro_batch: int | None = Field(description="With accumulation; null when no size fits with it.")
    max_micro_batch_without_accumulation: int | None
    capped: bool = Field(description="The probe's cap fitted: a larger micro-batch may fit too.")


class MixedPlanView(BaseModel):
    """`POST /v1/plan/mixed`: what each rank runs, and the results it was made from."""

    workload: str
    groups: list[MixedGroupView]
    plan: MixedPlan


class MissingGroup(BaseModel):
    """A group of a mixed plan with no stored result."""

    index: int = Field(description="Its position in `groups`, from 0.")
    device: str
    ranks: int
    request_key: str | None = Field(description="The key a result for it would be stored under, when known.")
    reason: str = Field(description="Why there is none, and how to get one.")


class MixedPlanMissing(BaseModel):
    """409: some groups have no stored result; `missing` names each (the plan needs all)."""

    detail: str
    code: Literal["no_result"]
    missing: list[MissingGroup]


class PlanPending(BaseModel):
    """`GET /v1/plan` with no stored result yet: the probe that will produce it."""

    status: ProbeStatus
    detail: str
    probe: ProbeView


class PlanFailed(BaseModel):
    """`GET /v1/plan` when the probe for it failed in a way asking again would not fix (its
    workload, its configuration, nothing fits...): what went wrong. A probe whose worker stopped is
    run again instead, and one its node lost is asked for again by the service itself."""

    detail: str
    code: Literal["probe_failed"] = "probe_failed"
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
    model_fingerprint: str = Field(description="The model's structure (built on the meta device): part of every key.")
    source_hash: str = Field(description="The workload's own source files, as read at start-up: part of every key.")


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


ErrorCode = Literal[
    "not_found",
    "invalid",
    "queue_full",
    "no_such_device",
    "device_unavailable",
    "store_unavailable",
    "starting",
    "draining",
    "not_finished",
    "model_mismatch",
    "conflict",
]


class ErrorView(BaseModel):
    """An error: `detail` says what was wrong and how to fix it. `code` names the kind for
    programs; answers of the HTTP layer itself (401, 405, 413) carry none."""

    detail: str
    code: ErrorCode | None = None


class FieldError(BaseModel):
    """One field that fails the schema: where (`loc`, e.g. ["query", "memory"]), why, and what was sent."""

    type: str
    loc: list[str | int]
    msg: str
    input: Any = None


class InvalidView(BaseModel):
    """422: `detail` lists the fields that fail the schema; or it is a message, with `code`
    "invalid", for a rule the schema cannot state (headroom that leaves nothing of the memory,
    memory beyond what the device has or this server simulates, an effective batch that is not a
    multiple of the world size, a plan of more than 10,000 accumulation steps)."""

    detail: list[FieldError] | str
    code: Literal["invalid"] | None = None


class QueueFullView(BaseModel):
    """429: the device already has AUTOTUNE_MAX_QUEUE probes waiting. Ask again after
    `retry_after` seconds (also the `Retry-After` header)."""

    detail: str
    code: Literal["queue_full"]
    retry_after: int = Field(ge=1)


class NotFoundView(BaseModel):
    """404: what the request names is not here. `code` says what: "not_found" (a workload, probe or
    result), "no_such_device" (this node does not have the device: asking again will not help; ask
    for one it has, `cpu` always, or another node). A path no route serves has no `code`."""

    detail: str
    code: Literal["not_found", "no_such_device"] | None = None


class UnavailableView(BaseModel):
    """503: the service is up but cannot answer this now; ask again after `retry_after` seconds
    (also the `Retry-After` header). `code` "store_unavailable" (the database does not answer or
    cannot be written), "device_unavailable" (a device the node has cannot be used now),
    "starting" (the server is opening its store: migrations, stored results) or "draining" (it is
    shutting down). A probe it runs goes on meanwhile: a client waits rather than probe beside it."""

    detail: str
    code: Literal["device_unavailable", "store_unavailable", "starting", "draining"]
    retry_after: int = Field(ge=1)
