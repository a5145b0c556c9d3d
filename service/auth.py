"""Optional API keys: `ATTEND_API_KEYS=key1,key2` makes /attend, /models and /metrics need
`Authorization: Bearer <key>`. Keys are compared in constant time and never logged."""

from __future__ import annotations

import hmac

from fastapi import Request

from service.errors import ServiceError


class Unauthorized(ServiceError):
    status, code = 401, "unauthorized"


async def require_api_key(request: Request) -> None:
    # async: a plain `def` dependency would cost every request a hop to the thread pool.
    keys: tuple[bytes, ...] = request.app.state.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("this endpoint needs an API key: Authorization: Bearer <key>", field="Authorization",
                           headers={"WWW-Authenticate": "Bearer"})
    given = token.strip().encode()
    # Compare with every key, no early exit: the time does not tell which key (or how much) matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    if not matched:
        raise Unauthorized("the API key is not valid", field="Authorization",
                           headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
