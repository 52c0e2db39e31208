"""The request key: which stored result answers a request, known before any probe runs.

A result's fingerprint is computed inside the probe, from the model built on the meta device and
the device torch opens. The service cannot compute it up front without importing and building
workloads and asking CUDA about the card in its own process, which must never initialize CUDA. So
probe jobs and plan lookups are keyed by a `ProbeKey` made from what determines the answer, in a
form that the request and the result both give:

- the workload as target and options (not its registered name: two names for the same thing
  share results), with precision, optimizer, steps, cap and granularity resolved;
- what the workload builds, recorded when the registry loaded (`autotune.workloads.registry`): the model's
  structure (`model_fingerprint`: the module tree on the meta device, class names, parameter and
  buffer names, shapes, dtypes) and its source (`source_hash`: the user's files that define the
  workload and its model). The name, target and options stay the same when a model file is
  edited; these do not, so an edited model (a hidden layer 256 -> 4096) gets a new key after the
  restart and a probe, instead of the old model's answer. Old results stay stored (and readable by
  fingerprint); no query reaches them any more. Any edit of those files, a comment included,
  changes the key: a needless probe costs seconds, a stale answer an out-of-memory crash;
- the parallel setup a rank runs in (DDP; FSDP with its world size, `reshard_after_forward` and
  sharding, the workload's own function or ours), when there is one;
- the device model: its kind, name and total memory as torch reports it. For a GPU the service
  reads NVML, whose total includes memory the driver reserves: torch's `total_memory` equals
  NVML's v2 total minus `reserved` (85,017,493,504 = 85,520,809,984 - 503,316,480 on an H100);
- the memory limit in bytes (budget minus headroom), which the answer depends on, whatever mix of
  budget policy, memory and headroom produced it. A `free` budget has no limit known before the
  probe, so its key holds the policy and the headroom instead; a result probed that way answers
  only the job that ran it.

`key_from_result` derives the key of a result made elsewhere (`POST /v1/results`), so that a probe
run inside a training pod answers every later query for the same workload on the same GPU model.
A result carries no model or source hash of its own: it takes the registered entry's, after
`result_model_problems` has checked, through the result's fingerprint, that it was probed from the
model the entry builds.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from autotune import __version__
from autotune.errors import ConfigError, WorkloadError
from autotune.request import checkpointing_candidates
from autotune.results import SCHEMA_VERSION, ParallelSpec, ProbeResult
from autotune.units import format_bytes, headroom_bytes
from autotune.workloads import fingerprint
from autotune.workloads.registry import RegisteredWorkload
from autotune.workloads.targets import resolve
from autotune.workloads.workload import OptionValue


class DeviceKey(BaseModel):
    """A device model: what makes two devices give the same answer."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["cuda", "cpu-budget"]
    name: str | None = Field(default=None, description="The GPU's name; None for the budget device.")
    total_bytes: int = Field(ge=1, description="Total memory as torch reports it (the budget device's size).")


class FreeBudget(BaseModel):
    """A budget of whatever memory is free when the probe starts: only the request is known."""

    model_config = ConfigDict(frozen=True)

    headroom: float | int
    memory: int | None = None


class ProbeKey(BaseModel):
    """Everything a stored result must match to answer a request."""

    model_config = ConfigDict(frozen=True)

    target: str
    options: dict[str, OptionValue]
    # What the target builds, as the registry loaded it: the same name, target and options with an
    # edited model must not find the old model's answer.
    model_fingerprint: str = Field(description="The registered entry's model_fingerprint (module tree on meta).")
    source_hash: str = Field(description="The registered entry's source_hash (the user's source files).")
    precision: str
    optimizer: str
    steps: int
    max_batch: int | None
    granularity: int
    prefetch: int = 0
    # Results of schema 1 were verified for one micro-step only: they must not answer a request
    # whose plan may accumulate, so the schema is part of the key.
    schema_version: int = SCHEMA_VERSION
    device: DeviceKey
    limit_bytes: int | None = Field(description="budget - headroom; None for a free-memory budget.")
    free_budget: FreeBudget | None = None
    # A rank of a DDP or FSDP job holds something else than one process of the model (and an FSDP
    # rank depends on the world size and the sharding): another answer, another key.
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    # Activation checkpointing: a setting (full, every=K), or a choice among settings for a plan
    # (`checkpointing_key`: its answer depends on the effective batch); None: the workload as registered.
    checkpointing: str | None = None

    def digest(self) -> str:
        """sha256 of the canonical JSON: the key stored with jobs and results. A key without a
        parallel setup or checkpointing digests as before there was one, so stored results keep answering."""
        document = self.model_dump(mode="json")
        if self.parallel.strategy == "none":
            del document["parallel"]
        if self.checkpointing is None:
            del document["checkpointing"]
        encoded = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(encoded).hexdigest()


def key_for_request(
    entry: RegisteredWorkload,
    device: DeviceKey,
    *,
    budget: Literal["total", "free"],
    memory: int | None,
    headroom: float | int,
    precision: str | None = None,
    optimizer: str | None = None,
    steps: int | None = None,
    max_batch: int | None = None,
    granularity: int | None = None,
    parallel: ParallelSpec | None = None,
    checkpointing: str | None = None,
) -> ProbeKey:
    """The key of a probe of `entry` on `device`, with the same arithmetic as the probe's
    `open_device`. For the budget device, `device.total_bytes` is its size (the request's memory
    or AUTOTUNE_CPU_MEMORY) and `memory` is ignored. The entry's model fingerprint and source hash
    go in as they were when the registry loaded. Raises ConfigError for an impossible budget."""
    limit: int | None
    free: FreeBudget | None = None
    if device.kind == "cpu-budget":
        size = device.total_bytes
        limit = size - _headroom(size, headroom)
    elif budget == "free":
        limit, free = None, FreeBudget(headroom=headroom, memory=memory)
    else:
        if memory is not None and memory > device.total_bytes:
            raise ConfigError(
                f"memory {format_bytes(memory)} is more than the device has ({format_bytes(device.total_bytes)})"
            )
        size = device.total_bytes if memory is None else memory
        limit = size - _headroom(size, headroom)
    return ProbeKey(
        target=entry.target,
        options=dict(entry.options),
        model_fingerprint=entry.model_fingerprint,
        source_hash=entry.source_hash,
        precision=precision or entry.precision,
        optimizer=(optimizer or entry.optimizer).lower(),
        steps=entry.steps if steps is None else steps,
        max_batch=entry.max_batch if max_batch is None else max_batch,
        granularity=entry.granularity if granularity is None else granularity,
        prefetch=entry.prefetch,
        device=device,
        limit_bytes=limit,
        free_budget=free,
        parallel=_with_sharding(parallel or ParallelSpec(), entry),
        checkpointing=checkpointing,
    )


def checkpointing_key(
    checkpointing: str | None, effective_batch: int | None = None, world_size: int = 1, policy: str = ""
) -> str | None:
    """The key's checkpointing: None for none (a plain key), a setting as it is, and a choice among
    settings with the plan it was chosen for (the fastest setting depends on the effective batch)."""
    if checkpointing is None:
        return None
    settings = checkpointing_candidates(checkpointing)
    if len(settings) == 1:
        return None if settings[0] == "none" else settings[0]
    return f"choose:{','.join(settings)};effective_batch={effective_batch};world_size={world_size};policy={policy}"


def _with_sharding(spec: ParallelSpec, entry: RegisteredWorkload) -> ParallelSpec:
    """An FSDP setup shards as the entry's workload does (its own function, or ours): as the probe's result says."""
    if spec.strategy != "fsdp" or spec.sharding == entry.sharding:
        return spec
    return spec.model_copy(update={"sharding": entry.sharding})


def _headroom(size: int, headroom: float | int) -> int:
    room = headroom_bytes(size, headroom)
    if room >= size:
        raise ConfigError(
            f"headroom {format_bytes(room)} leaves nothing of the budget {format_bytes(size)}: lower headroom"
        )
    return room


def key_from_result(result: ProbeResult, entry: RegisteredWorkload) -> ProbeKey | None:
    """The key a result published for `entry` answers: the result's own fields, with the entry's
    model fingerprint and source hash, which a result does not carry. Check first that the result
    was probed from the entry's model (`result_model_problems`); this only checks that it names
    the entry's target and options (ValueError otherwise). None for a free-memory budget, whose
    limit depended on what other processes held at the time."""
    if result.workload.target != entry.target or dict(result.workload.options) != dict(entry.options):
        raise ValueError(
            f"the result is for {result.workload.target} {result.workload.options}, "
            f"not for the registered {entry.name!r} ({entry.target} {entry.options})"
        )
    if result.budget_policy == "free":
        return None
    device = DeviceKey(
        kind=result.device.kind,
        name=result.device.name if result.device.kind == "cuda" else None,
        total_bytes=result.device.total_bytes,
    )
    return ProbeKey(
        target=result.workload.target,
        options=dict(result.workload.options),
        model_fingerprint=entry.model_fingerprint,
        source_hash=entry.source_hash,
        precision=result.workload.precision,
        optimizer=result.workload.optimizer.lower(),
        steps=result.workload.steps,
        max_batch=result.max_batch_cap,
        granularity=result.granularity,
        prefetch=result.loop.prefetch,
        schema_version=result.schema_version,
        device=device,
        limit_bytes=result.limit_bytes,
        parallel=result.workload.parallel,
        checkpointing=checkpointing_key(result.workload.checkpointing),  # "none" keys as no setting
    )


Mismatch = tuple[tuple[str, ...], str]  # (where in the result, why)


def result_model_problems(result: ProbeResult, entry: RegisteredWorkload) -> list[Mismatch]:
    """Why `result` demonstrably was not probed from the model `entry` builds; empty when it was.

    The rule for `POST /v1/results`: the registered workload is built again on the meta device and
    the fingerprint its probe would have given is computed in the result's own environment (device,
    limit, steps, cap, granularity, prefetch, torch and CUDA versions, allocator settings) with the
    result's precision and optimizer. A result from a different model (a layer's width, a block, a
    dtype), batch shape, input spec or optimizer options has another fingerprint and is refused,
    naming `fingerprint`; `workload.input_spec` and `batch_norm`, which a result states outright,
    are named first when they differ. What this cannot see: an edit of the code that leaves all of
    those unchanged (a different forward, activation checkpointing). The key holds the source hash
    for that, but a result carries no source hash (one computed in a training pod, with another
    install layout, could not be compared), so such a result is accepted under the current key.

    Builds the model on the meta device: call it off the event loop."""
    try:
        workload = resolve(entry.target, entry.options)
        # As the probe did (`load_workload`): its result names the optimizer it ran, which differs
        # from the workload's own only when the request named one (sgd, adam or adamw).
        if result.workload.optimizer != workload.optimizer_name:
            workload = workload.with_overrides(optimizer=result.workload.optimizer)
    except WorkloadError as exc:
        return [(("workload", "optimizer"), f"the registered workload {entry.name!r} cannot use it: {exc}")]
    workload = workload.with_overrides(precision=result.workload.precision)
    try:
        model, batch = fingerprint.build_on_meta(workload)
    except WorkloadError as exc:
        return [(("workload",), f"the registered workload {entry.name!r} no longer builds: {exc}")]
    problems: list[Mismatch] = []
    registered_spec = dict(workload.input_spec)
    if dict(result.workload.input_spec) != registered_spec:
        problems.append(
            (
                ("workload", "input_spec"),
                f"the result's batch was {result.workload.input_spec}; the registered workload {entry.name!r} "
                f"makes {registered_spec}",
            )
        )
    batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if result.batch_norm != batch_norm:
        has = "has" if batch_norm else "has no"
        problems.append(
            (
                ("batch_norm",),
                f"the registered workload {entry.name!r}'s model {has} BatchNorm; the result says otherwise",
            )
        )
    expected = fingerprint.fingerprint_of(
        workload, fingerprint.structure_of(model, batch), fingerprint.result_environment(result)
    )
    if result.fingerprint != expected:
        skew = [
            f"{what} {theirs} (this server: {ours})"
            for what, theirs, ours in (
                ("autotune", result.versions.autotune, __version__),
                ("torch", result.versions.torch, torch.__version__),
            )
            if theirs != ours
        ]
        also = f"; or its fingerprint was taken differently, by {' and '.join(skew)}" if skew else ""
        problems.append(
            (
                ("fingerprint",),
                f"the registered workload {entry.name!r} gives fingerprint {expected[:16]}… in this result's own "
                f"environment, not {result.fingerprint[:16]}…: the result was probed from a different model, batch "
                f"or optimizer settings (was the model edited since?){also}. Probe the registered workload and "
                "publish that result",
            )
        )
    return problems
