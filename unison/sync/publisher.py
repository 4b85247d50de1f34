"""The trainer's side of disaggregated generation: after every optimizer step, send what changed.

``sync.mode``: ``colocated`` (the engine decodes from the trainer's own tensors: nothing to send), ``sparse``
(the changed bf16 elements, from the optimizer's exact masks), ``full`` (the whole state dict every step).
``sync.transport``: ``http`` (POST to every server's ``/v1/weights``; a server that answers 409 needs an anchor
and gets one at once, and so does one that answers 400, refusing the trainer's own patch: it is behind),
``fsspec`` (a directory servers poll, ``unison serve --sync_url``) or ``dist`` (a ``torch.distributed`` group of
the trainer, rank 0, and the servers, ``unison serve --sync_dist``: a broadcast, then an all-reduce of need-anchor
flags; NCCL on GPUs, gloo otherwise). A full anchor goes out before the first rollout (marked as a restart:
servers take it at any version, even below theirs, since the trainer may have restarted) and every
``anchor_every`` syncs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from ..config import InputError, check_literals
from .auth import TOKEN_ENV, resolve_token
from .codec import Framed, Patch, anchor_patch, encode, frame, payload_nbytes, sparse_patch
from .http import HTTPStatusError, post_json
from .transport import DirectoryPublisher, DistChannel


@dataclass
class SyncConfig:
    mode: Literal["colocated", "sparse", "full"] = "colocated"
    transport: Literal["http", "fsspec", "dist"] = "http"
    servers: list[str] = field(default_factory=list)
    """`unison serve` URLs that generate the rollouts (and, with transport http, receive the patches)."""
    url: str = ""
    """With transport fsspec: the directory (any fsspec URL) the servers' --sync_url points at. With dist: the
    process group's init method (``tcp://host:port``), the servers' --sync_dist."""
    anchor_every: int = 50
    """Also send a full anchor every this many syncs (0: only when a server asks)."""
    timeout_s: float = 600.0
    token: str = ""
    """The servers' shared secret (``unison serve --token``), sent as ``Authorization: Bearer`` on every request to
    them; empty: ``$UNISON_SYNC_TOKEN`` if set, else none."""

    def __post_init__(self):
        check_literals(self, "sync.")
        if self.mode != "colocated" and not self.servers:
            raise ValueError(f"sync.mode={self.mode} generates on `unison serve` servers: set sync.servers")
        if self.mode != "colocated" and self.transport in ("fsspec", "dist") and not self.url:
            raise ValueError(f"sync.transport={self.transport} needs sync.url (the directory the servers poll, or "
                             "the process group's tcp:// address)")
        if self.anchor_every < 0:
            raise ValueError(f"sync.anchor_every must be >= 0, got {self.anchor_every}")


class WeightPublisher:
    def __init__(self, cfg: SyncConfig, params: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.params = params
        self.total = sum(p.numel() for p in params.values())
        self.syncs = 0
        self.directory = DirectoryPublisher(cfg.url) if cfg.transport == "fsspec" else None
        self.channel = None
        if cfg.transport == "dist":
            cuda = next(iter(params.values())).is_cuda
            # The trainer is rank 0 of a group with every server; this blocks until they have all joined.
            dist.init_process_group("nccl" if cuda else "gloo", init_method=cfg.url, rank=0,
                                    world_size=1 + len(cfg.servers), timeout=timedelta(seconds=cfg.timeout_s))
            self.channel = DistChannel(device=next(iter(params.values())).device if cuda else "cpu")

    def close(self) -> None:
        """End the servers' receive loops (dist) and leave the process group."""
        if self.channel is not None:
            self.channel.close()
            dist.destroy_process_group()
            self.channel = None

    def anchor(self, version: int) -> dict[str, float]:
        """Send the whole state as the run's restart anchor (the initial sync, also of a resumed run), which servers
        take at any version. A server that cannot be reached is an ``InputError`` naming its URL."""
        t0 = time.perf_counter()
        blob = self._wire(anchor_patch(self.params, version, to_host=self.channel is None, restart=True))
        anchors = self._send(blob, version, anchor=True, anchor_blob=lambda: blob, restart=True)
        return {"sync/bytes": float(payload_nbytes(blob)), "sync/s": time.perf_counter() - t0,
                "sync/anchors": float(anchors)}

    def after_step(self, version: int, changed_masks: dict[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.syncs += 1
        full = self.cfg.mode == "full" or (self.cfg.anchor_every and self.syncs % self.cfg.anchor_every == 0)
        to_host = self.channel is None  # the dist transport sends the tensors from where they are
        patch = anchor_patch(self.params, version, to_host) if full else \
            sparse_patch(self.params, changed_masks, version - 1, version, to_host)
        blob = self._wire(patch)
        anchors = self._send(blob, version, anchor=patch.anchor, anchor_blob=lambda: blob if patch.anchor else
                             self._wire(anchor_patch(self.params, version, to_host)))
        return {"sync/bytes": float(payload_nbytes(blob)), "sync/s": time.perf_counter() - t0,
                "sync/elements_frac": patch.num_elements / self.total, "sync/anchors": float(anchors)}

    def _wire(self, patch: Patch) -> bytes | Framed:
        """What the transport carries: the patch framed on the device (dist), else safetensors bytes."""
        return frame(patch) if self.channel is not None else encode(patch)

    def _send(self, blob: bytes | Framed, version: int, anchor: bool, anchor_blob, restart: bool = False) -> int:
        """Deliver ``blob``; answer every anchor request. Returns the anchors sent on request."""
        if self.channel is not None:
            return int(self.channel.send(blob, anchor=anchor_blob))
        if self.directory is not None:
            self.directory.publish(blob, version, anchor, restart=restart)
            if self.directory.anchor_requested() and not anchor:  # an anchor just published answers them already
                self.directory.publish(anchor_blob(), version, anchor=True)
                return 1
            return 0
        token = resolve_token(self.cfg.token)
        return sum(self._post(f"{server.rstrip('/')}/v1/weights", blob, anchor, anchor_blob, token, restart)
                   for server in self.cfg.servers)

    def _post(self, url: str, blob: bytes, anchor: bool, anchor_blob, token: str, initial: bool) -> int:
        """POST ``blob`` to one server, and an anchor if it answers 409 (it needs one) or 400 (it refused the
        trainer's own patch, so it is behind). Returns the anchors sent."""
        try:
            self._post_once(url, blob, token, initial)
            return 0
        except HTTPStatusError as e:
            if e.status not in (400, 409):
                raise
            if anchor:  # the same anchor again would be refused the same way
                raise RuntimeError(f"{url} refused the trainer's anchor (HTTP {e.status}): {e.detail.get('error')}; "
                                   "does the server hold the same model (sync.servers)?") from e
        try:
            self._post_once(url, anchor_blob(), token, initial=False)
        except HTTPStatusError as e:
            raise RuntimeError(f"{url} refused the anchor it needed (HTTP {e.status}): {e.detail.get('error')}") from e
        return 1

    def _post_once(self, url: str, blob: bytes, token: str, initial: bool) -> None:
        try:
            post_json(url, blob, self.cfg.timeout_s, token)
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
