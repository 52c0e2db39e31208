"""The bearer token that guards the `/v1` endpoints.

With AUTOTUNE_TOKEN set, every `/v1` endpoint requires `Authorization: Bearer <token>`; the
comparison is constant-time and made on bytes (a header with characters outside ASCII must be a
401, not an error). `/healthz`, `/readyz` and `/metrics` stay open for probes and scrapers.
(Request bodies are bounded by FastAPI's own `max_body_size`, set from AUTOTUNE_MAX_BODY.)
"""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request, status

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def check_token(request: Request) -> None:
    """FastAPI dependency of the /v1 router."""
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
