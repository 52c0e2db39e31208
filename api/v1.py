"""The `/v1` endpoints: devices, workloads, probes, plans and results. All require the token
when AUTOTUNE_TOKEN is set.

Every handler is `async` on purpose: a sync handler runs in a thread pool, which costs more than
the work these do (dictionary lookups; the store is touched only to create and read jobs and to
accept results, never by a plan query that finds its result).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.devices import snapshot
from api.errors import ModelMismatchError, NotFoundError, ProbeNotFinishedError
from api.jobs import RETRYABLE
from api.mixed import answer as answer_mixed
from api.schemas import (
    FINGERPRINT_PATTERN,
    JOB_ID_PATTERN,
    BudgetDeviceView,
    DevicesView,
    ErrorView,
    GpuView,
    InvalidView,
    MixedPlanMissing,
    MixedPlanQuery,
    MixedPlanView,
    NotFoundView,
    PlanFailed,
    PlanPending,
    PlanQuery,
    PlanView,
    ProbeCreate,
    ProbeView,
    Published,
    PublishedResult,
    QueueFullView,
    RunFailureRecorded,
    RunFailureReport,
    StoredView,
    UnavailableView,
    WorkloadView,
    query_parameters,
)
from api.security import check_token, require_token
from api.service import Resolved, Service, check_plan, serving
from autotune.results import SCHEMA_VERSION, ProbeResult, RunFailure
from autotune.store import StoredResult, now
from autotune.workloads.probekey import key_from_result, result_model_problems
from autotune.workloads.registry import UnknownWorkloadError

_JOB_ID = re.compile(JOB_ID_PATTERN)
_FINGERPRINT = re.compile(FINGERPRINT_PATTERN)


# What each route answers besides its success, for the OpenAPI document -------------------------
def _header(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "required": True, "schema": schema}


_LOCATION = {"Location": _header("Where the probe (or result) can be read.", {"type": "string"})}
_RETRY_AFTER = {"Retry-After": _header("Seconds to wait before asking again.", {"type": "integer", "minimum": 1})}
_ERROR_STATUSES: dict[int, dict[str, Any]] = {
    401: {
        "model": ErrorView,
        "description": "Missing or wrong bearer token (AUTOTUNE_TOKEN on the server).",
        "headers": {"WWW-Authenticate": _header("The scheme to use.", {"type": "string", "const": "Bearer"})},
    },
    404: {"model": NotFoundView, "description": "Unknown workload, probe or result."},
    409: {"model": ErrorView, "description": "Not possible in the current state; the detail says why."},
    413: {"model": ErrorView, "description": "The request body is larger than AUTOTUNE_MAX_BODY."},
    422: {"model": InvalidView, "description": "Invalid input: the fields that fail the schema, or the rule broken."},
    429: {
        "model": QueueFullView,
        "description": "The device's probe queue is full (AUTOTUNE_MAX_QUEUE): ask again after Retry-After seconds.",
        "headers": _RETRY_AFTER,
    },
    503: {
        "model": UnavailableView,
        "description": "The service is up but cannot answer now (the store or a device is unavailable, it is "
        "starting or shutting down): ask again after Retry-After seconds.",
        "headers": _RETRY_AFTER,
    },
}


_NO_WORKLOAD_OR_DEVICE = (
    "The workload is not registered (`code` not_found), or this node does not have the device (`code` "
    "no_such_device: a refusal, asking again will not help)."
)


def _errors(*codes: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """The documented error answers `codes`; `descriptions` (`e404=...`) say what one means here."""
    found: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        found[code] = dict(_ERROR_STATUSES[code])
        if f"e{code}" in descriptions:
            found[code]["description"] = descriptions[f"e{code}"]
    return found


def _probe_links(expression: str) -> dict[str, Any]:
    """OpenAPI links from an answer that names a probe to the routes that read it."""
    return {
        name: {"operationId": operation, "parameters": {"probe_id": expression}}
        for name, operation in (("GetProbe", "get_probe"), ("GetProbePlot", "get_probe_plot"))
    }


# Every /v1 route may answer 503 while the server starts or shuts down, whatever it does.
router = APIRouter(prefix="/v1", dependencies=[Depends(check_token)], responses=_errors(401, 503))


async def service(request: Request) -> Service:
    return serving(request.app)


ServiceDep = Annotated[Service, Depends(service)]
ProbeId = Annotated[
    str, Path(description="A probe id from POST /v1/probes.", json_schema_extra={"pattern": JOB_ID_PATTERN})
]


# Plan queries are validated once per distinct query string: fleets repeat the same few queries.
# The memo is keyed by the raw query string, so it is bounded twice: a query string longer than
# MEMO_MAX_QUERY bytes is never kept (nothing a real plan query sends is that long: padding, long
# unknown parameters or whitespace would otherwise each take an entry), and it holds at most
# MEMO_ENTRIES entries, least recently used first out: 2 MiB at the most. What it maps to is
# the normalised `PlanQuery` (sizes parsed, defaults filled, frozen): `memory=128MiB` and
# `memory=134217728` give equal queries, so everything keyed on them downstream (the resolved
# request key, the plan cache) is shared.
MEMO_MAX_QUERY = 512
MEMO_ENTRIES = 1024
_QUERIES: OrderedDict[bytes, PlanQuery] = OrderedDict()


def _plan_query(request: Request) -> PlanQuery:
    """The plan query, validated by one pydantic model rather than FastAPI's per-parameter
    machinery, which costs more than the rest of a plan query together; memoized (see above)."""
    raw: bytes = request.scope.get("query_string", b"")
    memoised = len(raw) <= MEMO_MAX_QUERY
    if memoised:
        query = _QUERIES.get(raw)
        if query is not None:
            _QUERIES.move_to_end(raw)
            return query
    try:
        query = PlanQuery.model_validate(dict(request.query_params))
    except ValidationError as exc:
        errors = [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    if memoised:
        _QUERIES[raw] = query
        if len(_QUERIES) > MEMO_ENTRIES:
            _QUERIES.popitem(last=False)
    return query


def _resolve_query(svc: Service, query: PlanQuery | RunFailureReport) -> Resolved:
    """The request key and probe request of a plan query (or of a report about its plan)."""
    return svc.resolve(
        query.workload,
        device=query.device,
        memory=query.memory,
        headroom=query.headroom,
        precision=query.precision,
        optimizer=query.optimizer,
        parallel=query.parallel_spec(),
        checkpointing=getattr(query, "checkpointing", None),
        plan_for=(query.effective_batch, query.world_size, query.policy) if isinstance(query, PlanQuery) else None,
    )


# Plans (first: the route matched most often) ----------------------------------------------------
@router.get(
    "/plan",
    response_model=PlanView,
    openapi_extra={
        "parameters": query_parameters(
            PlanQuery,
            "The query's fields, each its own `name=value` parameter (`?workload=gpt&effective_batch=256`). "
            "Rules across them: parallel=fsdp needs world_size 2 or more.",
        )
    },
    summary="Micro-batches and accumulation steps for an effective batch, from the stored result",
    operation_id="get_plan",
    responses={
        202: {
            "model": PlanPending,
            "description": "No result yet: the probe for it (Location: /v1/probes/{id}).",
            "headers": {**_LOCATION, **_RETRY_AFTER},
            "links": _probe_links("$response.body#/probe/id"),
        },
        409: {
            "model": PlanFailed,
            "description": "The probe for this plan failed in a way asking again would not fix; the error says why. "
            "(A probe whose worker stopped is run again, and one its node lost is asked for again: neither is a 409.)",
            "headers": _LOCATION,
        },
        **_errors(404, 422, 429, 503, e404=_NO_WORKLOAD_OR_DEVICE),
    },
)
async def get_plan(request: Request) -> Response:
    svc = serving(request.app)
    query = _plan_query(request)
    resolved = _resolve_query(svc, query)
    effective_batch, world_size, policy, wait = query.effective_batch, query.world_size, query.policy, query.wait
    svc.metrics.plan_requests.inc()
    cached = svc.results.get(resolved.digest)
    submitted = None
    if cached is None:
        check_plan(effective_batch, world_size, policy)
        # The store answers: a result stored elsewhere, a failure that would repeat, or the probe.
        submitted = await asyncio.to_thread(svc.submit, resolved, use_stored=True, remember=True)
        if submitted.stored is not None:
            cached = svc.results.get(resolved.digest)
    if cached is not None:
        svc.metrics.plan_cache_hits.inc()
        return Response(
            svc.plan_body(resolved, cached, effective_batch, world_size, policy), media_type="application/json"
        )
    until = time.monotonic() + wait
    for successor in range(3):
        assert submitted is not None and submitted.job is not None
        job_id = submitted.job.id
        remaining = until - time.monotonic()
        if submitted.job.status in ("queued", "running") and remaining > 0:
            await svc.jobs.wait(job_id, remaining)
            cached = await asyncio.to_thread(svc.lookup, resolved.digest)
            if cached is not None:
                body = svc.plan_body(resolved, cached, effective_batch, world_size, policy)
                return Response(body, media_type="application/json")
            serving(request.app)  # woken because the server is shutting down: 503 draining, not 202
        found = await asyncio.to_thread(svc.job_view, job_id)
        if found is None:  # not expected: the job was just created or just failed
            raise NotFoundError(f"the probe for workload {query.workload!r} vanished: ask again")
        view = found
        if view.status != "failed" or view.error is None or view.error.type not in RETRYABLE or successor == 2:
            break
        # Its node lost it before it could run (not the probe's fault): ask for it again, as the
        # client would; a new job here, or the one another request made meanwhile.
        submitted = await asyncio.to_thread(svc.submit, resolved, use_stored=True, remember=True)
        if submitted.stored is not None:
            cached = svc.results.get(resolved.digest)
            assert cached is not None
            return Response(
                svc.plan_body(resolved, cached, effective_batch, world_size, policy), media_type="application/json"
            )
    location = {"Location": f"/v1/probes/{view.id}"}
    if view.status == "succeeded" and view.result is not None:
        # Finished on another worker of this node, which the store does not say yet: its spool does.
        stored = StoredResult(result=view.result, source="probe", stored_at=view.finished_at or now())
        body = svc.plan_body(resolved, svc.results.put(resolved.digest, stored), effective_batch, world_size, policy)
        return Response(body, media_type="application/json")
    if view.status == "failed":
        message = view.error.message if view.error else "the probe failed"
        failure = PlanFailed(detail=f"the probe for this plan failed: {message}", probe=view)
        return _json(failure, status.HTTP_409_CONFLICT, location)
    pending = PlanPending(
        status=view.status,
        detail=f"no result stored yet: probe {view.id} is {view.status}; ask again, or pass wait=SECONDS",
        probe=view,
    )
    return _json(pending, status.HTTP_202_ACCEPTED, {**location, "Retry-After": "1"})


async def plan_route(request: Request) -> Response:
    """`GET /v1/plan` as a plain Starlette route in front of the documented one (`create_app`):
    the same token check and handler without FastAPI's per-route dependency solving and request
    wrappers, which cost more than the query itself. The documented route stays for OpenAPI."""
    require_token(request)
    return await get_plan(request)


def _json(model: PlanFailed | PlanPending, code: int, headers: dict[str, str]) -> Response:
    return Response(model.model_dump_json(), status_code=code, headers=headers, media_type="application/json")


@router.post(
    "/plan/mixed",
    response_model=MixedPlanView,
    summary="One plan for a job whose ranks span GPU models, from each model's stored result",
    operation_id="post_mixed_plan",
    responses={
        409: {
            "model": MixedPlanMissing,
            "description": "Some groups have no stored result: `missing` names each, with how to get one.",
        },
        **_errors(
            404,
            413,
            422,
            e404="The workload is not registered (`code` not_found), or a group names a device this node does not "
            "have (`code` no_such_device).",
        ),
    },
)
async def mixed_plan(query: MixedPlanQuery, svc: ServiceDep) -> Response:
    """Every rank runs the same number of accumulation steps; each group's ranks run micro-batches up
    to its model's answer (mode per-model, with each micro-step's loss weight) or all ranks the
    smallest answer's (mode uniform). Answered from stored results only: a group without one is a
    409 naming it."""
    made = await answer_mixed(svc, query)
    code = status.HTTP_409_CONFLICT if isinstance(made, MixedPlanMissing) else status.HTTP_200_OK
    return Response(made.model_dump_json(), status_code=code, media_type="application/json")


# Devices and workloads ---------------------------------------------------------------------------
@router.get(
    "/devices",
    response_model=DevicesView,
    operation_id="get_devices",
    summary="The node's GPUs (NVML) and the CPU budget device",
)
async def devices(svc: ServiceDep) -> DevicesView:
    # A fresh read: memory in use and processes change; the numbering does not.
    inv = snapshot(await asyncio.to_thread(svc.read_inventory), os.environ.get("CUDA_VISIBLE_DEVICES"))
    gpus = [
        GpuView(
            id=d.id,
            nvml_index=d.nvml_index,
            uuid=d.uuid,
            name=d.name,
            total_bytes=int(d.info.total_bytes),
            used_bytes=int(d.info.used_bytes),
            free_bytes=int(d.info.free_bytes),
            reserved_bytes=getattr(d.info, "reserved_bytes", None),
            processes=_processes(getattr(d.info, "processes", None)),
            mig=d.mig,
            queue_depth=svc.jobs.depth(d.id),
        )
        for d in inv.devices
    ]
    return DevicesView(
        nvml_available=inv.available,
        reason=inv.reason,
        driver_version=inv.driver_version,
        gpus=gpus,
        budget_device=BudgetDeviceView(
            total_bytes=svc.settings.cpu_memory,
            max_bytes=svc.settings.max_cpu_memory,
            queue_depth=svc.jobs.depth("cpu"),
        ),
        warnings=list(inv.warnings),
    )


def _processes(found: Any) -> list[dict[str, Any]] | None:
    if found is None:
        return None
    return [p.model_dump() if hasattr(p, "model_dump") else dict(p) for p in found]


@router.get(
    "/workloads", response_model=list[WorkloadView], operation_id="get_workloads", summary="The registered workloads"
)
async def workloads(svc: ServiceDep) -> list[WorkloadView]:
    return [WorkloadView.model_validate(entry.model_dump()) for entry in svc.registry]


# Probes ------------------------------------------------------------------------------------------
@router.post(
    "/probes",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=ProbeView,
    summary="Probe a registered workload (or get the stored result)",
    operation_id="create_probe",
    responses={
        200: {"model": ProbeView, "description": "A result is stored for this request (and refresh is false)."},
        202: {
            "description": "Queued or running (Location: /v1/probes/{id}). Identical requests share the job.",
            "headers": _LOCATION,
            "links": _probe_links("$response.body#/id"),
        },
        **_errors(404, 413, 422, 429, 503, e404=_NO_WORKLOAD_OR_DEVICE),
    },
)
async def create_probe(body: ProbeCreate, response: Response, svc: ServiceDep) -> ProbeView:
    resolved = svc.resolve(
        body.workload,
        device=body.device,
        memory=body.memory,  # type: ignore[arg-type]  # the validator made it an int
        budget=body.budget,
        headroom=body.headroom,  # type: ignore[arg-type]
        precision=body.precision,
        optimizer=body.optimizer,
        steps=body.steps,
        max_batch=body.max_batch,
        granularity=body.granularity,
        parallel=body.parallel_spec(),
    )
    cached = None if body.refresh else svc.results.get(resolved.digest)
    if cached is not None:
        response.status_code = status.HTTP_200_OK
        return svc.stored_view(resolved, cached.stored)
    # A result stored by another worker or node since comes back from the store instead of a job.
    submitted = await asyncio.to_thread(svc.submit, resolved, use_stored=not body.refresh)
    if submitted.stored is not None:
        response.status_code = status.HTTP_200_OK
        return svc.stored_view(resolved, submitted.stored)
    assert submitted.job is not None
    response.headers["Location"] = f"/v1/probes/{submitted.job.id}"
    # A new job is answered as created (queued), even if a worker has claimed it since.
    if submitted.created:
        view = await asyncio.to_thread(svc.record_view, submitted.job)
    else:
        found = await asyncio.to_thread(svc.job_view, submitted.job.id)
        assert found is not None  # just submitted: it exists
        view = found
    assert view is not None  # just submitted: it is active or already stored
    return view


@router.get(
    "/probes/{probe_id}",
    response_model=ProbeView,
    operation_id="get_probe",
    summary="A probe job: status, trials so far, outcome",
    responses=_errors(404, 503, e404="No such probe."),
)
async def get_probe(probe_id: ProbeId, svc: ServiceDep) -> ProbeView:
    view = await asyncio.to_thread(svc.job_view, probe_id) if _JOB_ID.match(probe_id) else None
    if view is None:
        raise NotFoundError(f"no probe {probe_id[:64]!r}: probe ids come from POST /v1/probes")
    return view


@router.get(
    "/probes/{probe_id}/plot.png",
    response_class=Response,
    operation_id="get_probe_plot",
    responses={
        200: {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}, "description": "A PNG"},
        **_errors(404, 409, 503, e404="No such probe.", e409="The probe has not succeeded (yet): no picture."),
    },
    summary="A finished probe's trials, predicted curve, budget, headroom and answer, as PNG",
)
async def get_probe_plot(probe_id: ProbeId, svc: ServiceDep) -> Response:
    view = await asyncio.to_thread(svc.job_view, probe_id) if _JOB_ID.match(probe_id) else None
    if view is None:
        raise NotFoundError(f"no probe {probe_id[:64]!r}: probe ids come from POST /v1/probes")
    if view.result is None:
        raise ProbeNotFinishedError(f"probe {probe_id} is {view.status}: its picture exists once it has succeeded")
    from autotune.plot import render_plot

    # Drawing takes a quarter of a second of CPU: once per result, in a thread, then from memory.
    png = await svc.plots.get(view.result, render_plot)
    return Response(content=png, media_type="image/png")


# Results -----------------------------------------------------------------------------------------
@router.post(
    "/run-failures",
    response_model=RunFailureRecorded,
    summary="A run ran out of memory at a planned micro-batch: lower the stored answer below it",
    operation_id="report_run_failure",
    responses=_errors(404, 413, 422, 503, e404=f"{_NO_WORKLOAD_OR_DEVICE} Or no stored result answers the query."),
)
async def report_run_failure(body: RunFailureReport, svc: ServiceDep) -> RunFailureRecorded:
    resolved = _resolve_query(svc, body)
    failure = RunFailure(micro_batch=body.micro_batch, accumulates=body.accumulates, message=body.message)
    found: list[ProbeResult] = []

    def lower(current: ProbeResult) -> ProbeResult:
        found.append(current)
        return current.lowered_by_run(failure)

    # Read, lowered and written in one transaction: the stored result, not this worker's copy,
    # so that reports sent to different workers or nodes at once all count.
    stored = await asyncio.to_thread(svc.store.lower_result, resolved.digest, lower)
    if stored is None:
        raise NotFoundError(f"no stored result answers this query for workload {body.workload!r}: nothing to lower")
    svc.results.put(resolved.digest, stored)
    before, lowered = found[0], stored.result
    changed = (lowered.max_micro_batch, lowered.max_micro_batch_without_accumulation) != (
        before.max_micro_batch,
        before.max_micro_batch_without_accumulation,
    )
    detail = (
        f"recorded; plan queries now use at most {lowered.max_micro_batch} with accumulation"
        if changed and lowered.max_micro_batch is not None
        else f"recorded; plan queries now use at most {lowered.max_micro_batch_without_accumulation} (one micro-step)"
        if changed
        else "recorded; the stored answer was already below that size (or cannot go lower)"
    )
    return RunFailureRecorded(
        request_key=resolved.digest,
        max_micro_batch=lowered.max_micro_batch,
        max_micro_batch_without_accumulation=lowered.max_micro_batch_without_accumulation,
        detail=detail,
    )


@router.post(
    "/results",
    status_code=status.HTTP_201_CREATED,
    response_model=Published,
    summary="Store a probe result made elsewhere (autotune probe --publish URL)",
    responses={201: {"description": "Stored; Location: /v1/results/{fingerprint}."}},
)
async def publish(upload: PublishedResult, response: Response, svc: ServiceDep) -> Published:
    """Store a result for the registered entry with its target and options, under the key that
    entry's plan queries compute (`key_from_result`: the result's fields with the entry's model
    fingerprint and source hash).

    In this order, so that each refusal is the first that applies: a result for no registered
    workload is 404; one that contradicts itself where a reader can see it (its version, its
    fingerprint's form, a limit that is not budget minus headroom) is 422; one demonstrably probed
    from another model than the one registered is 409 naming the field (`result_model_problems`:
    its fingerprint must be the one the registered workload gives in the result's own environment,
    and its `workload.input_spec` and `batch_norm` must be the registered workload's; a model
    edited since the result was probed is such a model); one whose trials do not show its answer
    is 422. An edit that changes none of those (only the code of a forward) cannot be told from a
    result."""
    result = ProbeResult.model_validate(upload.model_dump())
    # Which registered workload it is for comes first: a result for none is refused (404) whatever
    # it holds, as a plan query for an unknown workload is.
    entry = svc.registry.find(result.workload.target, result.workload.options)
    if entry is None:
        raise UnknownWorkloadError(
            f"no registered workload has target {result.workload.target!r} with options "
            f"{result.workload.options}: register it in the AUTOTUNE_WORKLOADS file to publish results for it"
        )
    _refuse(_contradictions(result))
    # Builds the registered model on the meta device: off the event loop.
    mismatches = await run_in_threadpool(result_model_problems, result, entry)
    if mismatches:
        named = "; ".join(f"{'.'.join(where)}: {why}" for where, why in mismatches)
        raise ModelMismatchError(f"the result was not probed from the registered workload {entry.name!r}: {named}")
    _refuse(_unsupported(result))
    key = key_from_result(result, entry)
    digest = key.digest() if key is not None else None
    stored = await asyncio.to_thread(svc.store.put_result, result, digest, source="published")
    if digest is not None:
        svc.results.put(digest, stored)
    svc.metrics.results_published.inc()
    response.headers["Location"] = f"/v1/results/{result.fingerprint}"
    detail = (
        f"stored; plan queries for workload {entry.name!r} on this device model and limit now use it"
        if digest is not None
        else "stored, but a result probed against free memory answers no plan query: publish one probed "
        "with budget total or a memory size"
    )
    return Published(fingerprint=result.fingerprint, workload=entry.name, request_key=digest, detail=detail)


def _contradictions(result: ProbeResult) -> list[str]:
    """What a result says against itself where a reader sees it at once (the schema states these)."""
    problems = []
    if result.schema_version != SCHEMA_VERSION:
        problems.append(f"schema_version {result.schema_version} is not {SCHEMA_VERSION}")
    if not _FINGERPRINT.match(result.fingerprint):
        problems.append("fingerprint must be 64 lowercase hex digits (sha256)")
    if result.limit_bytes != result.budget_bytes - result.headroom_bytes:
        problems.append("limit_bytes must equal budget_bytes - headroom_bytes (leave it out: the server works it out)")
    return problems


def _unsupported(result: ProbeResult) -> list[str]:
    """What pydantic cannot say about a result: the search's guarantees and finite numbers."""
    problems = []
    if result.limit_bytes < 1:
        problems.append("limit_bytes must be positive")
    # The answer's evidence: trials of its loop shape, and fresh-process runs that lowered it.
    evidence = result.evidence()
    name, answer = "max_micro_batch", result.max_micro_batch
    if answer is None:  # nothing fits with accumulation: the one-micro-step answer carries the result
        name, answer = "max_micro_batch_without_accumulation", result.max_micro_batch_without_accumulation
        evidence = [t for t in result.trials if t.micro_steps == 1]
        if answer is None or not result.accumulation_failure:
            problems.append(
                "max_micro_batch is null: give max_micro_batch_without_accumulation and accumulation_failure"
            )
    if answer is not None and not any(t.fits and t.batch == answer for t in evidence):
        problems.append(f"no fitting trial at {name} {answer}")
    above = None if answer is None else answer + result.granularity
    if above is not None and not result.capped and not any(not t.fits and t.batch == above for t in evidence):
        problems.append(f"not capped, yet no failed trial at {above} ({name} + granularity)")
    if not _finite(result.model_dump()):
        problems.append("numbers must be finite (no NaN or Infinity)")
    return problems


def _refuse(problems: list[str]) -> None:
    if problems:
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body",), "msg": p, "input": None} for p in problems]
        )


def _finite(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


@router.get(
    "/results/{fingerprint}",
    response_model=StoredView,
    operation_id="get_result",
    summary="A stored result by fingerprint",
    responses=_errors(404, 503, e404="No stored result has this fingerprint."),
)
async def get_result(
    fingerprint: Annotated[
        str, Path(description="A result's fingerprint (sha256).", json_schema_extra={"pattern": FINGERPRINT_PATTERN})
    ],
    svc: ServiceDep,
) -> StoredView:
    stored = await asyncio.to_thread(svc.store.get_result, fingerprint) if _FINGERPRINT.match(fingerprint) else None
    if stored is None:
        raise NotFoundError(f"no stored result with fingerprint {fingerprint[:64]!r}")
    return StoredView(source=stored.source, stored_at=stored.stored_at, result=stored.result)


def _document_publish() -> None:
    """POST /v1/results answers these besides 201 (documented here so that its handler, edited
    elsewhere, need not change): the route is found by path and method."""
    for route in router.routes:
        if getattr(route, "path", None) == "/v1/results" and "POST" in getattr(route, "methods", ()):
            route.responses.update(  # type: ignore[attr-defined]
                {
                    201: {
                        "description": "Stored (Location: /v1/results/{fingerprint}).",
                        "headers": _LOCATION,
                        "links": {
                            "GetResult": {
                                "operationId": "get_result",
                                "parameters": {"fingerprint": "$response.body#/fingerprint"},
                            }
                        },
                    },
                    **_errors(
                        404,
                        409,
                        413,
                        422,
                        503,
                        e404="No registered workload has the result's target and options.",
                        e409="The result was not probed from the model registered under its target (`code` "
                        "model_mismatch): its fingerprint, `workload.input_spec` or `batch_norm` is not what the "
                        "registered workload gives now, as after an edit of the model; the detail names the field.",
                        e422="Invalid result: the fields that fail the schema, a limit_bytes sent that is not "
                        "budget_bytes - headroom_bytes, or the rules of a sound result that no schema can state "
                        "(a positive limit, a fitting trial at the answer and a failing one above it).",
                    ),
                }
            )


_document_publish()
