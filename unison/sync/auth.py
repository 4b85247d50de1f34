"""The shared secret between a trainer and its generation servers.

A server started with a token (``unison serve --token=...`` or ``UNISON_SYNC_TOKEN`` in its environment) answers
no request but ``GET /health`` without ``Authorization: Bearer <token>``; the trainer (``sync.token``, or the same
environment variable) sends it on every request. The token is compared in constant time. Plain HTTP carries it in
the clear: it keeps out whoever reaches the port, not whoever can read the traffic (README, "Across hosts").
"""

from __future__ import annotations

import hmac
import os

TOKEN_ENV = "UNISON_SYNC_TOKEN"


def resolve_token(configured: str = "") -> str:
    """The configured token, else ``$UNISON_SYNC_TOKEN``, else "" (no token)."""
    return configured or os.environ.get(TOKEN_ENV, "")


def auth_headers(token: str) -> dict[str, str]:
    """The request headers that carry ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_authorization(header: str | None, token: str) -> int | None:
    """None when a request with this ``Authorization`` header may proceed; else the HTTP status to refuse it with:
    401 (no bearer token sent), 403 (the wrong one)."""
    if not token:
        return None
    scheme, _, sent = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not sent:
        return 401
    return None if hmac.compare_digest(sent.strip().encode(), token.encode()) else 403
