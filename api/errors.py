"""From our exceptions to HTTP answers, so that no input produces a 500.

    UnknownWorkloadError, NotFoundError           404
    ConfigError (PlanError, WorkloadError...)     422 (bad input the validation could not see)
    RequestValidationError                        422 with the validation details
    DeviceError (NoDeviceError), StoreError       503
    any other AutotuneError                       409

FastAPI's own 422 handler passes each error's `input` through `jsonable_encoder`, which fails on
bytes that are not UTF-8 and on NaN, turning a bad request into a 500; ours makes every input
printable first. FastAPI answers 400 for a body it cannot decode (not UTF-8); that is invalid
input too, so it becomes a 422 in the same format.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from autotune.errors import AutotuneError, ConfigError, DeviceError
from autotune.registry import UnknownWorkloadError
from autotune.store import StoreError

log = logging.getLogger(__name__)
_MAX_TEXT = 200


class NotFoundError(AutotuneError):
    """An unknown probe id or result fingerprint (HTTP 404)."""


class ProbeNotFinishedError(AutotuneError):
    """What was asked for exists once the probe has succeeded (HTTP 409 until then)."""


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


def _status(exc: AutotuneError) -> int:
    if isinstance(exc, UnknownWorkloadError | NotFoundError):
        return status.HTTP_404_NOT_FOUND
    if isinstance(exc, ConfigError):
        return status.HTTP_422_UNPROCESSABLE_CONTENT
    if isinstance(exc, DeviceError | StoreError):
        return status.HTTP_503_SERVICE_UNAVAILABLE
    return status.HTTP_409_CONFLICT


async def _autotune_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AutotuneError)
    code = _status(exc)
    if code >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    return JSONResponse({"detail": str(exc)}, status_code=code)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(AutotuneError, _autotune_error)
