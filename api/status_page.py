"""The node's status page, `GET /`: what a person who opens the service in a browser sees.

This module owns the page's route, the reads behind it and its template
(`api/templates/status.html`, shipped as package data):

- devices: what `GET /v1/devices` answers, read afresh (the same handler): each GPU with its
  memory in use as a bar and the processes NVML lists on it, and the CPU budget device; why there
  is no GPU when NVML cannot say;
- probes: this node's queued and running jobs with their trials so far (as `GET /v1/probes/{id}`
  shows them, so a probe this process runs is shown live), then its last finished ones;
- stored results (the whole store: every node's), newest first: workload, device, limit, the
  largest micro-batch, the picture `GET /v1/probes/{id}/plot.png` draws of the probe that stored
  it, and its plans: the one stored with the result, and those this worker answered from it.

Plain HTML and CSS rendered by Jinja2 with autoescaping on: workload descriptions, device names,
error and run-failure messages are text a user wrote and are escaped; a Content-Security-Policy
without scripts backs that up. The page reloads itself every `REFRESH_SECONDS` (a `<meta
http-equiv="refresh">`); there is no JavaScript. It is for people, not in the OpenAPI document.

Access follows the `/v1` read endpoints, which show the same things: with AUTOTUNE_TOKEN set the
page needs `Authorization: Bearer <token>`, and so do the pictures on it, which are `/v1` URLs (a
browser sends the header through a proxy or an extension that adds it). Without a token it is open.

Its reads are the store's (`Store.node_job_ids`, `Store.newest_results`) and the plan cache's
(`PlanCache.newest`), run off the event loop like every store call of the `/v1` handlers. Bounded:
at most `MAX_RESULTS` results, `MAX_ACTIVE` active and `MAX_FINISHED` finished probes are read per
page, whatever the store holds.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from api import v1
from api.schemas import PlanView, ProbeView
from api.security import require_token
from api.service import Service, serving
from autotune import __version__
from autotune.plans.plan import Plan
from autotune.results import ParallelSpec, ProbeResult
from autotune.settings import Settings
from autotune.store import StoreError
from autotune.store.store import StoredResult
from autotune.units import format_bytes
from autotune.workloads.registry import RegisteredWorkload

log = logging.getLogger(__name__)

REFRESH_SECONDS = 5
MAX_RESULTS = 20  # newest first; each shows a picture, which the plot cache keeps 64 of
MAX_ACTIVE = 50
MAX_FINISHED = 8
MAX_PLANS = 5  # answered plans shown per result

TEMPLATES = Path(__file__).resolve().parent / "templates"
_environment = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,  # every {{ }} is escaped, whatever the file is called
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
# No script may run on the page, whatever text reaches it; styles are inline, pictures our own.
CSP = (
    "default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

router = APIRouter(include_in_schema=False)


# What the template shows ----------------------------------------------------------------------
@dataclass
class PlanRow:
    source: str  # "stored with the result" or "answered here"
    effective_batch: int
    world_size: int
    policy: str
    accumulation_steps: int
    micro_batches: str  # "4 × 16" or "2 × 13, 2 × 12"
    achieved: int
    verified_for: str
    warnings: list[str]


@dataclass
class ResultRow:
    request_key: str
    fingerprint: str
    workload: str
    description: str
    target: str
    device: str
    limit: str
    budget: str
    max_micro_batch: int | None
    capped: bool
    without_accumulation: int | None
    precision: str
    optimizer: str
    parallel: str  # what a rank was probed in ("" for one process without parallelism)
    plan_query: str  # the GET /v1/plan query that this result answers
    source: str
    stored_at: datetime
    trials: int
    run_failures: list[tuple[int, str]]
    probe_id: str | None  # the succeeded probe that stored it: its picture
    plans: list[PlanRow] = field(default_factory=list)


@dataclass
class _FromStore:
    active: list[ProbeView]
    finished: list[ProbeView]
    results: list[tuple[str, StoredResult, str | None, str | None]]  # key, result, probe id, its workload
    result_count: int


# The route --------------------------------------------------------------------------------------
@router.get("/", response_class=HTMLResponse)
async def status_page(request: Request) -> HTMLResponse:
    require_token(request)
    svc = serving(request.app)
    devices = await v1.devices(svc)
    problem = None
    try:
        found = await asyncio.to_thread(_read_store, svc)
    except StoreError as exc:
        log.warning("status page: %s", exc)
        problem = str(exc)
        found = _FromStore(active=[], finished=[], results=[], result_count=0)
    rows = [_result_row(svc, *entry) for entry in found.results]
    html = _environment.get_template("status.html").render(
        node=svc.settings.node,
        version=__version__,
        store=svc.store.name,
        now=datetime.now(UTC),
        refresh=REFRESH_SECONDS,
        devices=devices,
        gpus=[_gpu_row(g) for g in devices.gpus],
        running_on=_running_on(found.active),
        active=found.active,
        finished=found.finished,
        results=rows,
        result_count=found.result_count,
        problem=problem,
        bytes=format_bytes,
        when=_when,
    )
    return HTMLResponse(html, headers={"Cache-Control": "no-store", "Content-Security-Policy": CSP})


# Reads ------------------------------------------------------------------------------------------
def _read_store(svc: Service) -> _FromStore:
    """Everything the page shows from the store, in one thread (blocking). Raises StoreError."""
    node = svc.settings.node
    active_ids = svc.store.node_job_ids(node, active=True, limit=MAX_ACTIVE)
    finished_ids = svc.store.node_job_ids(node, active=False, limit=MAX_FINISHED)
    count, newest = svc.store.newest_results(MAX_RESULTS)
    stored = [(r.request_key, r.stored, r.probe_id, r.probe_workload) for r in newest]
    views = [svc.job_view(job_id) for job_id in [*active_ids, *finished_ids]]
    active = [v for v in views[: len(active_ids)] if v is not None]
    finished = [v for v in views[len(active_ids) :] if v is not None]
    return _FromStore(active=active, finished=finished, results=stored, result_count=count)


# Rows -------------------------------------------------------------------------------------------
def _result_row(
    svc: Service, key: str, stored: StoredResult, probe_id: str | None, job_workload: str | None
) -> ResultRow:
    result = stored.result
    entry = svc.registry.find(result.workload.target, result.workload.options)
    options = ", ".join(f"{k}={v}" for k, v in sorted(result.workload.options.items()))
    plans = [_plan_row("stored with the result", result.plan)] if result.plan is not None else []
    plans += [_plan_row("answered here", made) for made in _answered_plans(svc, key)]
    name = entry.name if entry is not None else job_workload or result.workload.target
    return ResultRow(
        request_key=key,
        fingerprint=result.fingerprint,
        workload=name,
        description=entry.description if entry is not None else "",
        target=f"{result.workload.target}({options})",
        device=result.device.name,
        limit=format_bytes(result.limit_bytes),
        budget=format_bytes(result.budget_bytes),
        max_micro_batch=result.max_micro_batch,
        capped=result.capped,
        without_accumulation=result.max_micro_batch_without_accumulation,
        precision=result.workload.precision,
        optimizer=result.workload.optimizer,
        parallel=_parallel_text(result.workload.parallel),
        plan_query=_plan_query(name, result, entry, svc.settings),
        source=stored.source,
        stored_at=stored.stored_at,
        trials=len(result.trials),
        run_failures=[(f.micro_batch, f.message) for f in result.run_failures],
        probe_id=probe_id,
        plans=plans,
    )


def _answered_plans(svc: Service, key: str) -> list[Plan]:
    """The plans this worker answered from the result it holds for `key`, newest first (the plan
    cache is keyed by the cached result's version; it is used from the event loop only, as here)."""
    cached = svc.results.get(key)
    if cached is None:
        return []
    found = []
    for memo, body in svc.plans.newest():
        if memo and memo[0] == cached.version:
            found.append(PlanView.model_validate_json(body).plan)
            if len(found) == MAX_PLANS:
                break
    return found


def _parallel_text(spec: ParallelSpec) -> str:
    if spec.strategy == "ddp":
        return "per rank of a DDP job"
    if spec.strategy == "fsdp":
        kept = "" if spec.reshard_after_forward else ", gathered parameters kept for backward"
        return f"per rank of a {spec.world_size}-rank FSDP2 job ({spec.sharding}{kept})"
    return ""


def _plan_query(workload: str, result: ProbeResult, entry: RegisteredWorkload | None, settings: Settings) -> str:
    """The plan query that this result answers: the workload, and every field the result was probed
    with that a query would otherwise take from the defaults (the service's budget device size and
    headroom, the workload's precision and optimizer, a plain job's setup). Without them a query
    finds another result, or starts a probe. A GPU result names no device: the default, cuda:0."""
    from autotune.units import headroom_bytes

    fields = [f"workload={workload}", "effective_batch=N"]
    budget = result.budget_bytes
    if result.device.kind == "cpu-budget":
        fields.append("device=cpu")
        if budget != settings.cpu_memory:
            fields.append(f"memory={budget}")
    elif result.budget_policy == "memory":
        fields.append(f"memory={budget}")
    if result.headroom_bytes != headroom_bytes(budget, settings.headroom):
        fields.append(f"headroom={result.headroom_bytes}B" if result.headroom_bytes else "headroom=0")
    if entry is None or result.workload.precision != entry.precision:
        fields.append(f"precision={result.workload.precision}")
    if entry is None or result.workload.optimizer.lower() != entry.optimizer.lower():
        fields.append(f"optimizer={result.workload.optimizer.lower()}")
    spec = result.workload.parallel
    if spec.strategy != "none":
        fields.append(f"parallel={spec.strategy}")
    if spec.strategy == "fsdp":
        fields.append(f"world_size={spec.world_size}")
        if not spec.reshard_after_forward:
            fields.append("reshard_after_forward=false")
    return "&".join(fields)


def _plan_row(source: str, made: Plan) -> PlanRow:
    return PlanRow(
        source=source,
        effective_batch=made.effective_batch,
        world_size=made.world_size,
        policy=str(getattr(made.policy, "value", made.policy)),
        accumulation_steps=made.accumulation_steps,
        micro_batches=runs(made.micro_batches),
        achieved=made.achieved_effective_batch,
        verified_for=made.verified_for,
        warnings=list(made.warnings),
    )


def runs(sizes: list[int]) -> str:
    """Micro-batch sizes as runs: [16, 16, 16, 16] -> '4 × 16'; [13, 13, 12] -> '2 × 13, 1 × 12'."""
    parts: list[list[int]] = []
    for size in sizes:
        if parts and parts[-1][1] == size:
            parts[-1][0] += 1
        else:
            parts.append([1, size])
    return ", ".join(f"{count} × {size}" for count, size in parts)


@dataclass
class GpuRow:
    id: str
    nvml_index: int
    name: str
    uuid: str | None
    mig: bool
    total: int
    used: int  # everything not free: processes, contexts, the driver's reservation
    free: int
    reserved: int | None
    percent: float
    level: str  # ok, high, full: the bar's colour
    processes: list[dict[str, Any]] | None
    queue_depth: int


def _gpu_row(gpu: Any) -> GpuRow:
    total = max(int(gpu.total_bytes), 1)
    used = max(total - int(gpu.free_bytes), 0)
    percent = round(100.0 * used / total, 1)
    return GpuRow(
        id=gpu.id,
        nvml_index=gpu.nvml_index,
        name=gpu.name or "unknown GPU",
        uuid=gpu.uuid,
        mig=gpu.mig,
        total=int(gpu.total_bytes),
        used=used,
        free=int(gpu.free_bytes),
        reserved=gpu.reserved_bytes,
        percent=percent,
        level="full" if percent >= 90 else "high" if percent >= 70 else "ok",
        processes=gpu.processes,
        queue_depth=gpu.queue_depth,
    )


def _running_on(active: list[ProbeView]) -> dict[str, list[ProbeView]]:
    by_device: dict[str, list[ProbeView]] = {}
    for view in active:
        by_device.setdefault(view.device, []).append(view)
    return by_device


def _when(moment: datetime | None) -> str:
    """'2026-11-23 10:00:01 UTC (12 s ago)'."""
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    seconds = max((datetime.now(UTC) - moment).total_seconds(), 0.0)
    if seconds < 90:
        ago = f"{seconds:.0f} s ago"
    elif seconds < 90 * 60:
        ago = f"{seconds / 60:.0f} min ago"
    elif seconds < 36 * 3600:
        ago = f"{seconds / 3600:.0f} h ago"
    else:
        ago = f"{seconds / 86400:.0f} days ago"
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC ({ago})"
