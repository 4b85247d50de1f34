"""``sync.transport=http``: the trainer POSTs each patch to every server's ``/v1/weights``.

Its receivers are ``sync.servers`` (the same servers the rollouts go to), with ``sync.token`` and
``sync.timeout_s``: no settings of its own. A server that answers 409 needs an anchor, and so does one that answers
400, refusing the trainer's own patch (it is behind); a server takes these POSTs whatever else its
``sync.transport`` is (``unison serve``: its ``Inbox``).
"""

from __future__ import annotations

from ...config import InputError
from ..auth import TOKEN_ENV
from ..codec import Patch, encode
from ..http import HTTPStatusError, post_json


class HTTPSender:
    to_host = True

    def __init__(self, servers: list[str], timeout_s: float, token: str = ""):
        self.urls = [f"{server.rstrip('/')}/v1/weights" for server in servers]
        self.timeout_s, self.token = timeout_s, token
        self.refused: list[str] = []

    def send(self, patch: Patch) -> int:
        """POST ``patch`` to every server; those that refuse it need an anchor (``needs_anchor``). A refused anchor is
        an error: the same anchor again would be refused the same way. A server that cannot be reached at the restart
        anchor (the run's first sync) is an ``InputError`` naming its URL."""
        blob = encode(patch)
        self.refused = [url for url in self.urls if self._refuses(url, blob, patch)]
        return len(blob)

    def needs_anchor(self) -> list[str]:
        refused, self.refused = self.refused, []
        return refused

    def send_anchor(self, anchor: Patch, receivers: list[str]) -> int:
        blob = encode(anchor)
        for url in receivers:
            try:
                self._post(url, blob, initial=False)
            except HTTPStatusError as e:
                raise RuntimeError(f"{url} refused the anchor it needed (HTTP {e.status}): "
                                   f"{e.detail.get('error')}") from e
        return len(receivers)

    def close(self) -> None:
        """Nothing to end: each POST stands alone."""

    def _refuses(self, url: str, blob: bytes, patch: Patch) -> bool:
        """Whether the server answered 409 (it needs an anchor) or 400 (it refused the trainer's own patch)."""
        try:
            self._post(url, blob, initial=patch.restart)
            return False
        except HTTPStatusError as e:
            if e.status not in (400, 409):
                raise
            if patch.anchor:
                raise RuntimeError(f"{url} refused the trainer's anchor (HTTP {e.status}): {e.detail.get('error')}; "
                                   "does the server hold the same model (sync.servers)?") from e
            return True

    def _post(self, url: str, blob: bytes, initial: bool) -> None:
        try:
            post_json(url, blob, self.timeout_s, self.token)
        except HTTPStatusError as e:
            if e.status == 401:
                raise RuntimeError(f"{url} asks for a token (HTTP 401): set sync.token or ${TOKEN_ENV} to the "
                                   "server's --token") from e
            if e.status == 403:
                raise RuntimeError(f"{url} refused the token (HTTP 403): sync.token or ${TOKEN_ENV} is not the "
                                   "server's --token") from e
            raise
        except OSError as e:  # URLError: refused, unknown host, timed out
            if not initial:
                raise
            raise InputError(f"cannot reach the generation server {url}: {getattr(e, 'reason', e)}; is `unison "
                             "serve` running there (sync.servers)?") from e
