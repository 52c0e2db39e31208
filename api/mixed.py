"""`POST /v1/plan/mixed`: one plan for a job whose ranks span GPU models, from each model's stored result.

Each group names a device as `GET /v1/plan` does (`cpu`, `cuda`, `cuda:N` of this node: the same
request key, so the same stored result answers it), or a GPU model by its name, for a model this
node does not have: its result was probed on another node and stored there or published
(`POST /v1/results`). A model's request key needs its total memory, which only its results know:
the stored results whose device has that name give it, and the key is then made exactly as for a
node's own GPU of that model (budget `total`, the group's memory and headroom or the server's,
the query's precision and optimizer), so only a result that would answer a plan query on such a
node answers the group.

The plan is made from stored results only: a group without one is a 409 naming it (and how to get
one), never a probe, since several probes on several nodes cannot be waited for in one request.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from api.cache import Cached
from api.devices import NoDeviceError
from api.schemas import (
    DEVICE_PATTERN,
    MissingGroup,
    MixedGroupQuery,
    MixedGroupView,
    MixedPlanMissing,
    MixedPlanQuery,
    MixedPlanView,
)
from api.service import MAX_ACCUMULATION_STEPS, Service
from autotune.errors import ConfigError, PlanError
from autotune.plans.mixed import Group, MixedPlan, mixed_plan
from autotune.units import format_bytes
from autotune.workloads.probekey import DeviceKey, key_for_request
from autotune.workloads.registry import RegisteredWorkload, UnknownWorkloadError

_LOCAL = re.compile(DEVICE_PATTERN)


@dataclass(frozen=True)
class _Found:
    name: str
    query: MixedGroupQuery
    model: str
    digest: str
    cached: Cached


def _prefixed(index: int, group: MixedGroupQuery, exc: Exception) -> Exception:
    """The same kind of error (404 or 422), saying which group it is about."""
    message = f"groups[{index}] ({group.device}): {exc}"
    return NoDeviceError(message) if isinstance(exc, NoDeviceError) else ConfigError(message)


def _names(groups: list[MixedGroupQuery]) -> list[str]:
    """Each group's name in the plan: its device, numbered when the same device is named twice."""
    repeated = {g.device for g in groups if sum(h.device == g.device for h in groups) > 1}
    return [f"{g.device} [{i}]" if g.device in repeated else g.device for i, g in enumerate(groups)]


def _models(svc: Service, wanted: str) -> list[DeviceKey]:
    """The GPU models with a stored result whose name is `wanted` (any case), else those whose name
    contains it; ConfigError when that names more than one model."""
    keys = {
        DeviceKey(kind="cuda", name=r.device.name, total_bytes=r.device.total_bytes)
        for r in (cached.stored.result for _, cached in svc.results.items())
        if r.device.kind == "cuda" and r.device.name
    }
    text = wanted.lower()
    exact = [k for k in keys if (k.name or "").lower() == text]
    found = exact or [k for k in keys if text in (k.name or "").lower()]
    names = sorted({k.name or "" for k in found})
    if len(names) > 1:
        raise ConfigError(f"device {wanted!r} matches several GPU models with stored results: {names}; name one")
    return sorted(found, key=lambda k: k.total_bytes)


def _model_lookup(
    svc: Service, entry: RegisteredWorkload, query: MixedPlanQuery, group: MixedGroupQuery
) -> tuple[str, str | None, Cached | None, str]:
    """(model, request key, result, why none) for a group naming a GPU model."""
    models = _models(svc, group.device)
    if not models:
        why = (
            f"no stored result was probed on a GPU model named {group.device!r}: probe {query.workload!r} on a node "
            "with it, or run `autotune probe ... --publish URL` on one"
        )
        return group.device, None, None, why
    room = svc.settings.headroom if group.headroom is None else group.headroom
    digest: str | None = None
    for model in models:
        key = key_for_request(
            entry,
            model,
            budget="total",
            memory=group.memory,
            headroom=room,
            precision=query.precision,
            optimizer=query.optimizer,
            parallel=query.parallel_spec(),
        )
        digest = digest or key.digest()
        cached = svc.results.get(key.digest())
        if cached is not None:
            return model.name or group.device, key.digest(), cached, ""
    limit = f", memory {format_bytes(group.memory)}" if group.memory is not None else ""
    why = (
        f"results are stored for {models[0].name}, but none for workload {query.workload!r} with this "
        f"precision, optimizer, headroom{limit}{_setup(query)}: probe it on a node with that GPU model, or publish one"
    )
    return models[0].name or group.device, digest, None, why


def _setup(query: MixedPlanQuery) -> str:
    spec = query.parallel_spec()
    if spec.strategy == "none":
        return ""
    return f", parallel {spec.strategy}" + (f" over {spec.world_size} ranks" if spec.strategy == "fsdp" else "")


async def _lookup(
    svc: Service, entry: RegisteredWorkload, query: MixedPlanQuery, index: int, group: MixedGroupQuery
) -> tuple[str, str | None, Cached | None, str]:
    """(model, request key, result, why none) for one group."""
    try:
        if not _LOCAL.match(group.device):
            return _model_lookup(svc, entry, query, group)
        resolved = svc.resolve(
            query.workload,
            device=group.device,
            memory=group.memory,
            headroom=group.headroom,
            precision=query.precision,
            optimizer=query.optimizer,
            parallel=query.parallel_spec(),
        )
    except UnknownWorkloadError:
        raise
    except (ConfigError, NoDeviceError) as exc:
        raise _prefixed(index, group, exc) from None
    device = resolved.key.device
    budget = f"cpu budget device ({format_bytes(device.total_bytes)})"
    model = device.name if device.kind == "cuda" and device.name else budget
    cached = await asyncio.to_thread(svc.lookup, resolved.digest)
    why = (
        ""
        if cached is not None
        else f"no result stored for {query.workload!r} on {resolved.device} ({model}) with this memory, headroom, "
        f"precision and optimizer: GET /v1/plan with them (or POST /v1/probes) probes it"
    )
    return model, resolved.digest, cached, why


def _groups(found: list[_Found]) -> list[Group]:
    groups = []
    for item in found:
        result = item.cached.stored.result
        single = result.max_micro_batch_without_accumulation
        if result.max_micro_batch is None and single is not None:
            # Nothing fits with accumulation there: a group that may only run one micro-step.
            groups.append(
                Group(name=item.name, ranks=item.query.ranks, max_micro_batch=single, accumulation_verified=False)
            )
            continue
        assert result.max_micro_batch is not None
        groups.append(
            Group(
                name=item.name,
                ranks=item.query.ranks,
                max_micro_batch=result.max_micro_batch,
                without_accumulation=single,
                accumulation_verified=result.loop.accumulates,
            )
        )
    return groups


def _warnings(made: MixedPlan, found: list[_Found]) -> MixedPlan:
    with_batch_norm = [f.name for f in found if f.cached.stored.result.batch_norm]
    if not with_batch_norm or made.accumulation_steps == 1:
        return made
    warning = (
        f"the model has BatchNorm: with {made.accumulation_steps} micro-steps its statistics come from each "
        "micro-batch, not from the effective batch; GroupNorm or LayerNorm avoid it"
    )
    return made.model_copy(update={"warnings": [*made.warnings, warning]})


async def answer(svc: Service, query: MixedPlanQuery) -> MixedPlanView | MixedPlanMissing:
    """The plan, or which groups have no stored result. Raises UnknownWorkloadError (404),
    NoDeviceError (404), ConfigError and PlanError (422)."""
    entry = svc.registry.get(query.workload)
    world = sum(g.ranks for g in query.groups)
    if query.effective_batch < world:
        raise PlanError(
            f"effective batch {query.effective_batch} is less than the world size {world} (the groups' ranks): "
            f"every rank needs at least one sample per optimizer step"
        )
    query.parallel_spec()  # FSDP over one rank: refused once, not per group
    names = _names(query.groups)
    found: list[_Found] = []
    missing: list[MissingGroup] = []
    for index, (name, group) in enumerate(zip(names, query.groups, strict=True)):
        model, digest, cached, why = await _lookup(svc, entry, query, index, group)
        if cached is None:
            missing.append(
                MissingGroup(index=index, device=group.device, ranks=group.ranks, request_key=digest, reason=why)
            )
        else:
            assert digest is not None
            found.append(_Found(name=name, query=group, model=model, digest=digest, cached=cached))
    if missing:
        which = ", ".join(f"groups[{m.index}] ({m.device})" for m in missing)
        return MixedPlanMissing(
            detail=f"no stored result for {which}: a mixed plan is made from the stored result of every group",
            code="no_result",
            missing=missing,
        )
    made = mixed_plan(query.effective_batch, _groups(found), query.mode, query.policy, max_steps=MAX_ACCUMULATION_STEPS)
    views = [
        MixedGroupView(
            name=f.name,
            device=f.query.device,
            model=f.model,
            ranks=f.query.ranks,
            request_key=f.digest,
            fingerprint=f.cached.stored.result.fingerprint,
            max_micro_batch=f.cached.stored.result.max_micro_batch,
            max_micro_batch_without_accumulation=f.cached.stored.result.max_micro_batch_without_accumulation,
            capped=f.cached.stored.result.capped,
        )
        for f in found
    ]
    return MixedPlanView(workload=entry.name, groups=views, plan=_warnings(made, found))
