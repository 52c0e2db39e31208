"""The FastAPI application: `create_app()` wires settings, lifespan, routes and error handlers.

The lifespan opens the `Service` (registry, devices, store, caches, probe workers) before the
first request and closes it after the last, putting the probe this process runs back in the
queue, under its id, for the node's other workers or this server's successor.
Any number of processes may share one AUTOTUNE_DB (`autotune serve --workers N`, several nodes on
one PostgreSQL): jobs, leases and results live in the database.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI
from starlette.routing import Route

from api import errors, ops, status_page, v1
from api.jobs import Runner
from api.security import token_bytes
from api.service import Service, Starting
from autotune import __version__
from autotune.settings import Settings, get_settings

log = logging.getLogger(__name__)

RETRY_START_SECONDS = 2.0  # between attempts to open the store while it cannot be opened

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
    start_in_background: bool = False,
) -> FastAPI:
    """The app. `inventory` replaces the NVML inventory reader and `runner` the isolated probe
    (tests: there is no GPU on CI).

    With `start_in_background` (`autotune serve`), the server answers from its first moment:
    the service (workloads, store, migrations, stored results) opens in a thread, `/healthz`
    answers at once, `/readyz` says what it is doing, and every other route answers 503 with
    `"code": "starting"` and Retry-After until it is open; a store it cannot open yet (PostgreSQL
    not up) is tried again every RETRY_START_SECONDS. Without it, the service is open before the
    first request, as tests that drive the app in-process expect."""
    settings = settings or get_settings()
    level = os.environ.get("AUTOTUNE_LOG_LEVEL")
    if level and not logging.getLogger().handlers:  # a worker of `serve --workers N`
        logging.basicConfig(level=level.upper(), format="%(levelname)s:     %(name)s: %(message)s")

    def open_service(progress: Callable[[str], None] = lambda _doing: None) -> Service:
        return Service(settings, inventory=inventory, runner=runner, progress=progress)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.draining.clear()
        restore = _drain_on_signals(app) if start_in_background else lambda: None
        if not start_in_background:
            app.state.service = open_service()
            _freeze()
        else:
            opener = threading.Thread(target=_open_in_background, args=(app, open_service), daemon=True)
            opener.start()
        try:
            yield
        finally:
            restore()
            app.state.draining.set()
            with app.state.opening:  # a service that opens after this closes itself
                service, app.state.service = app.state.service, None
            if service is not None:
                service.close()

    app = FastAPI(
        title="autotune",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        max_body_size=settings.max_body,
    )
    app.state.token = token_bytes(settings.token)
    app.state.service = None
    app.state.starting = Starting()
    app.state.opening = threading.Lock()
    app.state.draining = threading.Event()
    errors.install(app)
    # The plan query, most of the traffic, first and on its fast path (`v1.plan_route`).
    app.router.routes.insert(0, Route("/v1/plan", v1.plan_route, methods=["GET"], include_in_schema=False))
    app.include_router(v1.router)
    app.include_router(ops.router)
    app.include_router(status_page.router)  # GET /: the node's status page, for people
    return app


def create_served_app() -> FastAPI:
    """The app `autotune serve` runs (each worker of `--workers N` makes its own): it answers at once."""
    return create_app(start_in_background=True)


def _freeze() -> None:
    # torch, the registry and the stored results are a few hundred thousand objects that live
    # as long as the server: leave them out of every garbage collection from now on, so that
    # a collection triggered by request garbage does not walk them in the middle of a query.
    gc.freeze()


def _open_in_background(app: FastAPI, open_service: Callable[[Callable[[str], None]], Service]) -> None:
    starting: Starting = app.state.starting
    while not app.state.draining.is_set():
        try:
            service = open_service(starting)
        except Exception as exc:  # noqa: BLE001 - any failure is reported by /readyz and tried again
            starting.failure = " ".join(str(exc).split()) or type(exc).__name__
            log.warning(
                "could not open the service (%s): trying again in %.0f s", starting.failure, RETRY_START_SECONDS
            )
            app.state.draining.wait(RETRY_START_SECONDS)
            continue
        with app.state.opening:
            if not app.state.draining.is_set():
                app.state.service = service
                _freeze()
                return
        service.close()  # shut down while it opened
        return


def _drain_on_signals(app: FastAPI) -> Callable[[], None]:
    """From the signal that stops the server (uvicorn's own handler goes on as before), requests
    answer 503 "draining" and long polls return at once with it: a client that waits hears that
    the server is going, not a connection cut when uvicorn's grace period ends."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {}

    def drain(number: int, frame: Any) -> None:
        app.state.draining.set()
        service = app.state.service
        if service is not None:
            service.jobs.drain()
        handler = previous.get(number)
        if callable(handler):
            handler(number, frame)
        elif handler == signal.SIG_DFL:  # nobody else handles it: what it would have done
            signal.signal(number, signal.SIG_DFL)
            signal.raise_signal(number)

    for number in (signal.SIGINT, signal.SIGTERM):
        with suppress(ValueError, OSError):
            previous[number] = signal.signal(number, drain)

    def restore() -> None:
        for number, handler in previous.items():
            with suppress(ValueError, OSError, TypeError):
                signal.signal(number, handler)

    return restore
