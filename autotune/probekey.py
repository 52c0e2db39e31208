"""The request key: which stored result answers a request, known before any probe runs.

A result's fingerprint is computed inside the probe, from the model built on the meta device and
the device torch opens. The service cannot compute it up front without importing and building
workloads and asking CUDA about the card in its own process, which must never initialize CUDA. So
probe jobs and plan lookups are keyed by a `ProbeKey` made from what determines the answer, in a
form that the request and the result both give:

- the workload as target and options (not its registered name: two names for the same thing
  share results), with precision, optimizer, steps, cap and granularity resolved;
- the device model: its kind, name and total memory as torch reports it. For a GPU the service
  reads NVML, whose total includes memory the driver reserves: torch's `total_memory` equals
  NVML's v2 total minus `reserved` (85,017,493,504 = 85,520,809,984 - 503,316,480 on an H100);
- the memory limit in bytes (budget minus headroom), which the answer depends on, whatever mix of
  budget policy, memory and headroom produced it. A `free` budget has no limit known before the
  probe, so its key holds the policy and the headroom instead; a result probed that way answers
  only the job that ran it.

`key_from_result` derives the key of a result made elsewhere (`POST /v1/results`), so that a probe
run inside a training pod answers every later query for the same workload on the same GPU model.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from autotune.errors import ConfigError
from autotune.probe import headroom_bytes
from autotune.registry import RegisteredWorkload
from autotune.results import SCHEMA_VERSION, ProbeResult
from autotune.units import format_bytes
from autotune.workload import OptionValue


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

    def digest(self) -> str:
        """sha256 of the canonical JSON: the key stored with jobs and results."""
        document = self.model_dump(mode="json")
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
) -> ProbeKey:
    """The key of a probe of `entry` on `device`, with the same arithmetic as the probe's
    `open_device`. For the budget device, `device.total_bytes` is its size (the request's memory
    or AUTOTUNE_CPU_MEMORY) and `memory` is ignored. Raises ConfigError for an impossible budget."""
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
        precision=precision or entry.precision,
        optimizer=(optimizer or entry.optimizer).lower(),
        steps=entry.steps if steps is None else steps,
        max_batch=entry.max_batch if max_batch is None else max_batch,
        granularity=entry.granularity if granularity is None else granularity,
        prefetch=entry.prefetch,
        device=device,
        limit_bytes=limit,
        free_budget=free,
    )


def _headroom(size: int, headroom: float | int) -> int:
    room = headroom_bytes(size, headroom)
    if room >= size:
        raise ConfigError(
            f"headroom {format_bytes(room)} leaves nothing of the budget {format_bytes(size)}: lower headroom"
        )
    return room


def key_from_result(result: ProbeResult) -> ProbeKey | None:
    """The key a result answers, from its own fields; None for a free-memory budget, whose limit
    depended on what other processes held at the time."""
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
        precision=result.workload.precision,
        optimizer=result.workload.optimizer.lower(),
        steps=result.workload.steps,
        max_batch=result.max_batch_cap,
        granularity=result.granularity,
        prefetch=result.loop.prefetch,
        schema_version=result.schema_version,
        device=device,
        limit_bytes=result.limit_bytes,
    )
