"""API keys: the one check of an `Authorization: Bearer <key>` header, for every route and transport."""

from __future__ import annotations

import hmac

from service.core.errors import Unauthorized


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
