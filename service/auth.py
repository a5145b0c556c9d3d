"""Optional API keys: `ATTEND_API_KEYS=key1,key2` makes /attend, /models and /metrics need
`Authorization: Bearer <key>`. Keys are compared in constant time and never logged."""

from __future__ import annotations

import hmac

from fastapi import Request

from service.errors import ServiceError


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


def check_api_key(header: bytes | None, keys: tuple[bytes, ...]) -> None:
    """Raises Unauthorized unless `header` (the Authorization header's value) is `Bearer <one of keys>`."""
    scheme, _, token = (header or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        raise Unauthorized("this endpoint needs an API key: Authorization: Bearer <key>", field="Authorization",
                           headers={"WWW-Authenticate": "Bearer"})
    given = token.strip()
    # Compare with every key, no early exit: the time does not tell which key (or how much) matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    if not matched:
        raise Unauthorized("the API key is not valid", field="Authorization",
                           headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


async def require_api_key(request: Request) -> None:
    """The same check as a FastAPI dependency (async: a plain `def` one would cost a thread hop)."""
    keys: tuple[bytes, ...] = request.app.state.api_keys
    if keys:
        check_api_key(request.headers.get("authorization", "").encode("latin-1"), keys)


class ControlOff(ServiceError):
    status, code = 404, "not_found"


async def require_admin(request: Request) -> None:
    """Model control: an admin key where ATTEND_ADMIN_KEYS is set; else off (404), unless
    ATTEND_MODEL_CONTROL=true opens it (then the API keys, if any, apply as to every route)."""
    state = request.app.state
    header = request.headers.get("authorization", "").encode("latin-1")
    if state.admin_keys:
        check_api_key(header, state.admin_keys)
    elif not state.settings.model_control:
        raise ControlOff("model control is off: set ATTEND_ADMIN_KEYS (or ATTEND_MODEL_CONTROL=true on a trusted "
                         "network)")
    elif state.api_keys:
        check_api_key(header, state.api_keys)
