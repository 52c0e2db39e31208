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
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.devices import snapshot
from api.errors import NotFoundError, ProbeNotFinishedError
from api.schemas import (
    BudgetDeviceView,
    DevicesView,
    ErrorView,
    GpuView,
    PlanFailed,
    PlanPending,
    PlanQuery,
    PlanView,
    ProbeCreate,
    ProbeView,
    Published,
    RunFailureRecorded,
    RunFailureReport,
    StoredView,
    WorkloadView,
    query_parameters,
)
from api.security import check_token
from api.service import Resolved, Service, check_plan
from autotune.probekey import key_from_result
from autotune.registry import UnknownWorkloadError
from autotune.results import SCHEMA_VERSION, ProbeResult, RunFailure

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorView, "description": "Missing or wrong bearer token."},
    404: {"model": ErrorView, "description": "Unknown workload, probe or result."},
    422: {"model": ErrorView, "description": "Invalid input, with the validation details."},
    503: {"model": ErrorView, "description": "No such device on this node, or the store is unavailable."},
}

router = APIRouter(prefix="/v1", dependencies=[Depends(check_token)], responses=_ERRORS)


async def service(request: Request) -> Service:
    svc: Service = request.app.state.service
    return svc


ServiceDep = Annotated[Service, Depends(service)]


_QUERIES: OrderedDict[bytes, PlanQuery] = OrderedDict()  # raw query string -> parsed: fleets repeat queries


def _plan_query(request: Request) -> PlanQuery:
    """The plan query, validated by one pydantic model rather than FastAPI's per-parameter
    machinery, which costs more than the rest of a plan query together; memoized by raw query."""
    raw: bytes = request.scope.get("query_string", b"")
    query = _QUERIES.get(raw)
    if query is None:
        try:
            query = PlanQuery.model_validate(dict(request.query_params))
        except ValidationError as exc:
            errors = [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None
        _QUERIES[raw] = query
        while len(_QUERIES) > 4096:
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
    )


# Plans (first: the route matched most often) ----------------------------------------------------
@router.get(
    "/plan",
    response_model=PlanView,
    openapi_extra={"parameters": query_parameters(PlanQuery)},
    summary="Micro-batches and accumulation steps for an effective batch, from the stored result",
    responses={
        202: {"model": PlanPending, "description": "No result yet: the probe for it; Location: /v1/probes/{id}."},
        409: {"model": PlanFailed, "description": "The probe for this plan failed; the error says why."},
    },
)
async def get_plan(request: Request) -> Response:
    svc: Service = request.app.state.service
    query = _plan_query(request)
    resolved = _resolve_query(svc, query)
    effective_batch, world_size, policy, wait = query.effective_batch, query.world_size, query.policy, query.wait
    svc.metrics.plan_requests.inc()
    cached = svc.results.get(resolved.digest)
    if cached is not None:
        svc.metrics.plan_cache_hits.inc()
        return Response(
            svc.plan_body(resolved, cached, effective_batch, world_size, policy), media_type="application/json"
        )

    check_plan(effective_batch, world_size, policy)
    # A failure that would repeat is answered from memory; otherwise the probe for this query.
    job_id = svc.jobs.recent_failure(resolved.digest)
    if job_id is None:
        job, _created = svc.submit(resolved)
        job_id = job.id
        if wait > 0:
            await svc.jobs.wait(job_id, wait)
            cached = svc.results.get(resolved.digest)
            if cached is not None:
                body = svc.plan_body(resolved, cached, effective_batch, world_size, policy)
                return Response(body, media_type="application/json")
    view = svc.job_view(job_id)
    if view is None:  # not expected: the job was just created or just failed
        raise NotFoundError(f"the probe for workload {query.workload!r} vanished: ask again")
    location = {"Location": f"/v1/probes/{view.id}"}
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


def _json(model: PlanFailed | PlanPending, code: int, headers: dict[str, str]) -> Response:
    return Response(model.model_dump_json(), status_code=code, headers=headers, media_type="application/json")


# Devices and workloads ---------------------------------------------------------------------------
@router.get("/devices", response_model=DevicesView, summary="The node's GPUs (NVML) and the CPU budget device")
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


@router.get("/workloads", response_model=list[WorkloadView], summary="The registered workloads")
async def workloads(svc: ServiceDep) -> list[WorkloadView]:
    return [WorkloadView.model_validate(entry.model_dump()) for entry in svc.registry]


# Probes ------------------------------------------------------------------------------------------
@router.post(
    "/probes",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=ProbeView,
    summary="Probe a registered workload (or get the stored result)",
    responses={
        200: {"model": ProbeView, "description": "A result is stored for this request (and refresh is false)."},
        202: {"description": "Queued or running; Location: /v1/probes/{id}. Identical requests share the job."},
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
    )
    cached = svc.results.get(resolved.digest)
    if cached is not None and not body.refresh:
        response.status_code = status.HTTP_200_OK
        return svc.stored_view(resolved, cached.stored)
    job, _created = svc.submit(resolved)
    response.headers["Location"] = f"/v1/probes/{job.id}"
    view = svc.job_view(job.id)
    assert view is not None  # just submitted: it is active or already stored
    return view


@router.get("/probes/{probe_id}", response_model=ProbeView, summary="A probe job: status, trials so far, outcome")
async def get_probe(probe_id: str, svc: ServiceDep) -> ProbeView:
    view = svc.job_view(probe_id) if _JOB_ID.match(probe_id) else None
    if view is None:
        raise NotFoundError(f"no probe {probe_id[:64]!r}: probe ids come from POST /v1/probes")
    return view


@router.get(
    "/probes/{probe_id}/plot.png",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}, "description": "The memory-vs-batch picture"}},
    summary="A finished probe's trials, predicted curve, budget, headroom and answer, as PNG",
)
async def get_probe_plot(probe_id: str, svc: ServiceDep) -> Response:
    view = svc.job_view(probe_id) if _JOB_ID.match(probe_id) else None
    if view is None:
        raise NotFoundError(f"no probe {probe_id[:64]!r}: probe ids come from POST /v1/probes")
    if view.result is None:
        raise ProbeNotFinishedError(f"probe {probe_id} is {view.status}: its picture exists once it has succeeded")
    from autotune.plot import render_plot

    # Rendering takes tens of milliseconds of CPU: off the event loop.
    png = await run_in_threadpool(render_plot, view.result)
    return Response(content=png, media_type="image/png")


# Results -----------------------------------------------------------------------------------------
@router.post(
    "/run-failures",
    response_model=RunFailureRecorded,
    summary="A run ran out of memory at a planned micro-batch: lower the stored answer below it",
    responses={404: {"description": "No stored result answers this query."}},
)
async def report_run_failure(body: RunFailureReport, svc: ServiceDep) -> RunFailureRecorded:
    resolved = _resolve_query(svc, body)
    cached = svc.results.get(resolved.digest)
    if cached is None:
        raise NotFoundError(f"no stored result answers this query for workload {body.workload!r}: nothing to lower")
    before = cached.stored.result
    failure = RunFailure(micro_batch=body.micro_batch, accumulates=body.accumulates, message=body.message)
    lowered = before.lowered_by_run(failure)
    stored = svc.store.put_result(lowered, resolved.digest, source=cached.stored.source)
    svc.results.put(resolved.digest, stored)
    changed = (lowered.max_micro_batch, lowered.max_micro_batch_without_accumulation) != (
        before.max_micro_batch,
        before.max_micro_batch_without_accumulation,
    )
    detail = (
        f"recorded; plan queries now use at most {lowered.max_micro_batch} with accumulation"
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
async def publish(result: ProbeResult, response: Response, svc: ServiceDep) -> Published:
    _check_result(result)
    entry = svc.registry.find(result.workload.target, result.workload.options)
    if entry is None:
        raise UnknownWorkloadError(
            f"no registered workload has target {result.workload.target!r} with options "
            f"{result.workload.options}: register it in the AUTOTUNE_WORKLOADS file to publish results for it"
        )
    key = key_from_result(result)
    digest = key.digest() if key is not None else None
    stored = svc.store.put_result(result, digest, source="published")
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


def _check_result(result: ProbeResult) -> None:
    """What pydantic cannot say about a result: the search's guarantees and finite numbers."""
    problems = []
    if result.schema_version != SCHEMA_VERSION:
        problems.append(f"schema_version {result.schema_version} is not {SCHEMA_VERSION}")
    if not _FINGERPRINT.match(result.fingerprint):
        problems.append("fingerprint must be 64 lowercase hex digits (sha256)")
    if result.limit_bytes != result.budget_bytes - result.headroom_bytes:
        problems.append("limit_bytes must equal budget_bytes - headroom_bytes")
    if result.limit_bytes < 1:
        problems.append("limit_bytes must be positive")
    # The answer's evidence: trials of its loop shape, and fresh-process runs that lowered it.
    evidence = result.evidence()
    if not any(t.fits and t.batch == result.max_micro_batch for t in evidence):
        problems.append(f"no fitting trial at max_micro_batch {result.max_micro_batch}")
    above = result.max_micro_batch + result.granularity
    if not result.capped and not any(not t.fits and t.batch == above for t in evidence):
        problems.append(f"not capped, yet no failed trial at {above} (max_micro_batch + granularity)")
    if not _finite(result.model_dump()):
        problems.append("numbers must be finite (no NaN or Infinity)")
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


@router.get("/results/{fingerprint}", response_model=StoredView, summary="A stored result by fingerprint")
async def get_result(fingerprint: str, svc: ServiceDep) -> StoredView:
    stored = svc.store.get_result(fingerprint) if _FINGERPRINT.match(fingerprint) else None
    if stored is None:
        raise NotFoundError(f"no stored result with fingerprint {fingerprint[:64]!r}")
    return StoredView(source=stored.source, stored_at=stored.stored_at, result=stored.result)
