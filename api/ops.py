"""The operational endpoints, open without a token: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response, status

from api.metrics import CONTENT_TYPE
from api.schemas import Health, Readiness
from api.service import Service, Starting

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health, summary="The process answers")
async def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="The store can be written and the devices are known",
    responses={503: {"model": Readiness, "description": "Not ready: `problems` says why."}},
)
async def readyz(request: Request) -> Response:
    svc: Service | None = getattr(request.app.state, "service", None)
    draining = getattr(request.app.state, "draining", None)
    if svc is None or (draining is not None and draining.is_set()):
        starting = getattr(request.app.state, "starting", None)
        if draining is not None and draining.is_set():
            why = "shutting down"
        else:
            why = f"starting: {starting.describe() if isinstance(starting, Starting) else 'starting up'}"
        view = Readiness(status="not ready", store=False, devices=[], results=0, problems=[why])
        return Response(view.model_dump_json(), status.HTTP_503_SERVICE_UNAVAILABLE, media_type="application/json")
    # A write, not only a read: a full disk answers reads and refuses every job and result.
    failure = await asyncio.to_thread(svc.check_writable)
    store_ok = failure is None
    devices = svc.devices.ids()
    problems = [] if store_ok else [f"the database {svc.store.name} cannot be written: {failure}"]
    view = Readiness(
        status="ready" if not problems else "not ready",
        store=store_ok,
        devices=devices,
        results=len(svc.results),
        problems=problems,
        gpus=None if svc.devices.snapshot.devices else svc.devices.snapshot.reason,
    )
    code = status.HTTP_200_OK if not problems else status.HTTP_503_SERVICE_UNAVAILABLE
    return Response(view.model_dump_json(), code, media_type="application/json")


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    svc: Service | None = getattr(request.app.state, "service", None)
    if svc is None:  # before start-up finished or after shutdown began
        return Response(
            "# starting up or shutting down\n", status.HTTP_503_SERVICE_UNAVAILABLE, media_type=CONTENT_TYPE
        )
    depths = await asyncio.to_thread(svc.jobs.depths)
    return Response(svc.metrics.render(depths), media_type=CONTENT_TYPE)
