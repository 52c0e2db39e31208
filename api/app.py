"""The FastAPI application: `create_app()` wires settings, lifespan, routes and error handlers.

The lifespan opens the `Service` (registry, devices, store, caches, probe workers) before the
first request and closes it after the last, marking the probe this process runs as interrupted.
Any number of processes may share one AUTOTUNE_DB (`autotune serve --workers N`, several nodes on
one PostgreSQL): jobs, leases and results live in the database.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.routing import Route

from api import errors, ops, status_page, v1
from api.jobs import Runner
from api.security import token_bytes
from api.service import Service
from autotune import __version__
from autotune.settings import Settings, get_settings

DESCRIPTION = """\
Answers "for workload W at effective batch E on this GPU, which micro-batch and how many
accumulation steps?" from stored probe results; runs a probe (isolated, one at a time per device)
when none is stored. With AUTOTUNE_TOKEN set, /v1 endpoints need `Authorization: Bearer <token>`.
"""


def create_app(
    settings: Settings | None = None,
    *,
    inventory: Callable[[], Any] | None = None,
    runner: Runner | None = None,
) -> FastAPI:
    """The app. `inventory` replaces the NVML inventory reader and `runner` the isolated probe
    (tests: there is no GPU on CI)."""
    settings = settings or get_settings()
    level = os.environ.get("AUTOTUNE_LOG_LEVEL")
    if level and not logging.getLogger().handlers:  # a worker of `serve --workers N`
        logging.basicConfig(level=level.upper(), format="%(levelname)s:     %(name)s: %(message)s")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = Service(settings, inventory=inventory, runner=runner)
        app.state.service = service
        # torch, the registry and the stored results are a few hundred thousand objects that live
        # as long as the server: leave them out of every garbage collection from now on, so that
        # a collection triggered by request garbage does not walk them in the middle of a query.
        gc.freeze()
        try:
            yield
        finally:
            service.close()
            app.state.service = None

    app = FastAPI(
        title="autotune",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        max_body_size=settings.max_body,
    )
    app.state.token = token_bytes(settings.token)
    app.state.service = None
    errors.install(app)
    # The plan query, most of the traffic, first and on its fast path (`v1.plan_route`).
    app.router.routes.insert(0, Route("/v1/plan", v1.plan_route, methods=["GET"], include_in_schema=False))
    app.include_router(v1.router)
    app.include_router(ops.router)
    app.include_router(status_page.router)  # GET /: the node's status page, for people
    return app
