"""The bearer token that guards the `/v1` endpoints, and how the OpenAPI document states it.

With AUTOTUNE_TOKEN set, every `/v1` endpoint requires `Authorization: Bearer <token>`; the
comparison is constant-time and made on bytes (a header with characters outside ASCII must be a
401, not an error). `/healthz`, `/readyz` and `/metrics` stay open for probes and scrapers.
(Request bodies are bounded by FastAPI's own `max_body_size`, set from AUTOTUNE_MAX_BODY.)

The document declares the scheme (`components.securitySchemes.bearerAuth`, HTTP bearer) and
requires it on every `/v1` operation (`security: [{"bearerAuth": []}]`). A server started without
AUTOTUNE_TOKEN accepts requests with or without a token, and its document says so: the
requirement becomes `[{"bearerAuth": []}, {}]`, OpenAPI's way of making a scheme optional. The
document is made by the server from its own configuration, so it is exact for that server.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

SCHEME = "bearerAuth"
_CHALLENGE = {"WWW-Authenticate": "Bearer"}

# Declares the scheme in the OpenAPI document; the check itself reads the raw header below (a
# missing, malformed or non-bearer header must be our 401, with our message).
_bearer = HTTPBearer(
    scheme_name=SCHEME,
    auto_error=False,
    description="AUTOTUNE_TOKEN, when the server has one: `Authorization: Bearer <token>`.",
)


async def check_token(
    request: Request, _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """FastAPI dependency of the /v1 router."""
    require_token(request)


def require_token(request: Request) -> None:
    """The token check itself, for a route outside FastAPI's dependency machinery (the plan
    query's fast path). Raises HTTPException(401)."""
    expected: bytes | None = request.app.state.token
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token: send 'Authorization: Bearer <token>' (AUTOTUNE_TOKEN on the server)",
            headers=_CHALLENGE,
        )
    # Starlette decodes headers as latin-1, so this encoding gives back the bytes that were sent.
    if not hmac.compare_digest(given.strip().encode("latin-1"), expected):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "wrong bearer token", headers=_CHALLENGE)


def token_bytes(token: str | None) -> bytes | None:
    return None if not token else token.encode("utf-8")


def document(schema: dict[str, Any], *, token_required: bool) -> None:
    """State the token in an OpenAPI document as this server applies it: required with
    AUTOTUNE_TOKEN set, optional (`{}` as an alternative) without, and the 401 answer only where
    the token is required. Changes `schema` in place."""
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if not isinstance(operation, dict) or {SCHEME: []} not in operation.get("security", []):
                continue
            operation["security"] = [{SCHEME: []}] if token_required else [{SCHEME: []}, {}]
            if not token_required:
                operation.get("responses", {}).pop("401", None)
