"""The trainer's HTTP client for ``unison serve``: weight patches (``sync.publisher``) and completion requests
(``rollout.remote``) go through ``post_json``, which sends the shared secret (``sync.auth``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from .auth import auth_headers


class HTTPStatusError(RuntimeError):
    """A server answered with an error status; ``status`` and ``detail`` (its JSON reply) say which and why."""

    def __init__(self, url: str, status: int, detail: dict):
        super().__init__(f"{url}: HTTP {status}: {detail.get('error')}")
        self.url, self.status, self.detail = url, status, detail


def post_json(url: str, payload: dict | bytes, timeout: float, token: str = "") -> dict:
    """POST (JSON or raw bytes) with the shared secret ``token`` if any; returns the JSON reply. An HTTP error status
    raises ``HTTPStatusError`` with the server's message."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers=auth_headers(token))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            detail = json.loads(body)
        except ValueError:
            detail = {"error": body[:200].decode(errors="replace")}
        raise HTTPStatusError(url, e.code, detail) from e
