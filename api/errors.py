"""From our exceptions to HTTP answers, so that no input produces a 500.

    UnknownWorkloadError, NotFoundError           404  code "not_found"
    NoDeviceError                                 404  code "no_such_device": a refusal, not an outage
    ConfigError (PlanError, WorkloadError...)     422  code "invalid" (a rule the schema cannot state)
    RequestValidationError                        422  with the validation details (a list)
    ModelMismatchError                            409  code "model_mismatch": a result of another model
    QueueFullError                                429  code "queue_full", Retry-After header
    other DeviceError                             503  code "device_unavailable"
    StoreError                                    503  code "store_unavailable": an outage, retry
    ServiceStartingError                          503  code "starting": migrations, stored results
    ServiceDrainingError                          503  code "draining": shutting down

Every 503 carries `Retry-After`: the service is up and says when to ask again, which is how a
client tells it from a service that is down (a refused connection, a timeout), the only case where
a client may probe on its own instead (`autotune.client`).
    any other AutotuneError                       409  code "conflict"

Every answer of ours is `{"detail": ..., "code": ...}` (`api.schemas.ErrorView`), so a program
can act on `code` without reading the message. A device this node does not have is a 404: like an
unknown workload, the request names something that is not here, and asking again will not change
that. (It was a 503, which says "temporarily unavailable, retry": clients, proxies and retry
policies did, and a client with a local fallback probed whatever device its own process saw.)
A 503 is an outage only: the store or a device that exists cannot be used now.

FastAPI's own 422 handler passes each error's `input` through `jsonable_encoder`, which fails on
bytes that are not UTF-8 and on NaN, turning a bad request into a 500; ours makes every input
printable first. FastAPI answers 400 for a body it cannot decode (not UTF-8); that is invalid
input too, so it becomes a 422 in the same format.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from api import security
from api.devices import NoDeviceError
from autotune.errors import AutotuneError, ConfigError, DeviceError, QueueFullError
from autotune.store import StoreError
from autotune.workloads.registry import UnknownWorkloadError

log = logging.getLogger(__name__)
_MAX_TEXT = 200
RETRY_UNAVAILABLE = 2  # seconds: a store or device outage, a server shutting down
RETRY_STARTING = 1  # seconds: start-up takes a few


class NotFoundError(AutotuneError):
    """An unknown probe id or result fingerprint (HTTP 404)."""


class ProbeNotFinishedError(AutotuneError):
    """What was asked for exists once the probe has succeeded (HTTP 409 until then)."""


class ServiceStartingError(AutotuneError):
    """The server answers, but has not yet opened its store (migrations, stored results) (HTTP 503)."""


class ServiceDrainingError(AutotuneError):
    """The server is shutting down: its successor, or another worker, answers (HTTP 503)."""


class ModelMismatchError(AutotuneError):
    """A published result was not probed from the model registered under its target (HTTP 409):
    its claim conflicts with what the server builds now (a model edited since it was probed)."""


def _printable(value: Any, depth: int = 0) -> Any:
    """A JSON-safe, bounded rendering of a request's input, for error messages."""
    if value is None or isinstance(value, bool | int):
        return value if not isinstance(value, int) or abs(value) < 2**63 else str(value)[:_MAX_TEXT]
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, bytes):
        return value[:_MAX_TEXT].decode("utf-8", "replace")
    if isinstance(value, str):
        return value[:_MAX_TEXT]
    if depth >= 3:
        return "..."
    if isinstance(value, dict):
        return {str(k)[:_MAX_TEXT]: _printable(v, depth + 1) for k, v in list(value.items())[:20]}
    if isinstance(value, list | tuple):
        return [_printable(v, depth + 1) for v in list(value)[:20]]
    return repr(value)[:_MAX_TEXT]


def _validation_details(exc: RequestValidationError) -> list[dict[str, Any]]:
    details = []
    for error in list(exc.errors())[:50]:
        details.append(
            {
                "type": str(error.get("type", "value_error")),
                "loc": [_printable(part) for part in error.get("loc", ())],
                "msg": str(error.get("msg", "invalid")),
                "input": _printable(error.get("input")),
            }
        )
    return details


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": _validation_details(exc)}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == status.HTTP_400_BAD_REQUEST:
        detail = [{"type": "body_invalid", "loc": ["body"], "msg": str(exc.detail), "input": None}]
        return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
    return await http_exception_handler(request, exc)


def _status(exc: AutotuneError) -> tuple[int, str]:
    """The HTTP status and the machine-readable code of one of our errors."""
    if isinstance(exc, UnknownWorkloadError | NotFoundError):
        return status.HTTP_404_NOT_FOUND, "not_found"
    if isinstance(exc, NoDeviceError):
        return status.HTTP_404_NOT_FOUND, "no_such_device"
    if isinstance(exc, ConfigError):
        return status.HTTP_422_UNPROCESSABLE_CONTENT, "invalid"
    if isinstance(exc, QueueFullError):
        return status.HTTP_429_TOO_MANY_REQUESTS, "queue_full"
    if isinstance(exc, DeviceError):
        return status.HTTP_503_SERVICE_UNAVAILABLE, "device_unavailable"
    if isinstance(exc, StoreError):
        return status.HTTP_503_SERVICE_UNAVAILABLE, "store_unavailable"
    if isinstance(exc, ServiceStartingError):
        return status.HTTP_503_SERVICE_UNAVAILABLE, "starting"
    if isinstance(exc, ServiceDrainingError):
        return status.HTTP_503_SERVICE_UNAVAILABLE, "draining"
    if isinstance(exc, ProbeNotFinishedError):
        return status.HTTP_409_CONFLICT, "not_finished"
    if isinstance(exc, ModelMismatchError):
        return status.HTTP_409_CONFLICT, "model_mismatch"
    return status.HTTP_409_CONFLICT, "conflict"


async def _autotune_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AutotuneError)
    code, name = _status(exc)
    if code >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    headers = None
    body: dict[str, Any] = {"detail": str(exc), "code": name}
    if isinstance(exc, QueueFullError):
        seconds = max(1, int(exc.retry_after))
        headers = {"Retry-After": str(seconds)}
        body["retry_after"] = seconds
    elif code == status.HTTP_503_SERVICE_UNAVAILABLE:
        seconds = RETRY_STARTING if isinstance(exc, ServiceStartingError) else RETRY_UNAVAILABLE
        headers = {"Retry-After": str(seconds)}
        body["retry_after"] = seconds
    return JSONResponse(body, status_code=code, headers=headers)


def install(app: FastAPI) -> None:
    """The error handlers, and the OpenAPI document's account of them (`_document`)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(AutotuneError, _autotune_error)
    _document(app)


_FASTAPI_422 = {"$ref": "#/components/schemas/HTTPValidationError"}


def _document(app: FastAPI) -> None:
    """The app's OpenAPI document, made exact where FastAPI's own cannot be:

    - the 401 and the security requirement follow this server's AUTOTUNE_TOKEN
      (`api.security.document`): required with a token, optional without;
    - FastAPI adds a 422 to every route with a parameter; the routes that can answer 422 declare
      theirs (`api.schemas.InvalidView`), so the automatic one is dropped: a path parameter that
      does not match its pattern is an unknown probe or result, a 404."""
    generate: Callable[[], dict[str, Any]] = app.openapi
    made: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        generated = generate()  # FastAPI's, cached by FastAPI; ours is made once from a copy of it
        required = getattr(app.state, "token", None) is not None
        if made.get("from") is not generated or made.get("required") != required:
            schema = copy.deepcopy(generated)
            security.document(schema, token_required=required)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if (
                        responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema")
                        == _FASTAPI_422
                    ):
                        del responses["422"]
            if _FASTAPI_422["$ref"] not in json.dumps(schema["paths"]):
                for name in ("HTTPValidationError", "ValidationError"):
                    schema.get("components", {}).get("schemas", {}).pop(name, None)
            made.update({"from": generated, "required": required, "schema": schema})
        result: dict[str, Any] = made["schema"]
        return result

    app.openapi = openapi  # type: ignore[method-assign]
