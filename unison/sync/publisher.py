"""The trainer's side of disaggregated generation: after every optimizer step, send what changed.

``sync.mode``: ``colocated`` (the engine decodes from the trainer's own tensors: nothing to send), ``sparse``
(the changed bf16 elements, from the optimizer's exact masks), ``full`` (the whole state dict every step).
``sync.transport`` picks how they travel (``unison.sync.transports``: ``http``, ``fsspec``, ``dist``). A full anchor
goes out before the first rollout (marked as a restart: servers take it at any version, even below theirs, since
the trainer may have restarted), every ``anchor_every`` syncs, and at once to every server that needs one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from ..config import check_literals
from .auth import resolve_token
from .codec import Patch, anchor_patch, sparse_patch
from .transports import DirectorySender, DistSender, DistSyncConfig, FsspecConfig, HTTPSender, Sender


@dataclass
class SyncConfig:
    renamed_keys: ClassVar[dict[str, str]] = {
        "url": "sync.fsspec.url (sync.transport=fsspec) or sync.dist.init_method (sync.transport=dist)"}
    mode: Literal["colocated", "sparse", "full"] = "colocated"
    """Where rollouts are generated: ``colocated`` (the trainer's own engine, on the same weights) or on `unison
    serve` servers (sync.servers), which after each step receive the changed bf16 elements (``sparse``) or the
    whole state dict (``full``)."""
    transport: Literal["http", "fsspec", "dist"] = "http"
    """How patches reach the servers: ``http`` (a POST to each of sync.servers), ``fsspec`` (a directory they poll,
    sync.fsspec) or ``dist`` (a process group with them, sync.dist)."""
    servers: list[str] = field(default_factory=list)
    """`unison serve` URLs that generate the rollouts (and, with transport http, receive the patches)."""
    fsspec: FsspecConfig = field(default_factory=FsspecConfig)
    dist: DistSyncConfig = field(default_factory=DistSyncConfig)
    anchor_every: int = 50
    """Also send a full anchor every this many syncs (0: only when a server asks)."""
    timeout_s: float = 600.0
    """Seconds to wait for a server's answer (a completion request, a patch) or a process group's collective."""
    token: str = ""
    """The servers' shared secret (``unison serve --token``), sent as ``Authorization: Bearer`` on every request to
    them; empty: ``$UNISON_SYNC_TOKEN`` if set, else none."""

    def __post_init__(self):
        check_literals(self, "sync.")
        if self.mode != "colocated" and not self.servers:
            raise ValueError(f"sync.mode={self.mode} generates on `unison serve` servers: set sync.servers")
        if self.mode != "colocated" and self.transport == "fsspec" and not self.fsspec.url:
            raise ValueError("sync.transport=fsspec needs sync.fsspec.url (the directory the servers poll)")
        if self.mode != "colocated" and self.transport == "dist" and not self.dist.init_method:
            raise ValueError("sync.transport=dist needs sync.dist.init_method (the process group's tcp://host:port)")
        if self.anchor_every < 0:
            raise ValueError(f"sync.anchor_every must be >= 0, got {self.anchor_every}")


def build_sender(cfg: SyncConfig, device: torch.device) -> Sender:
    """The trainer's side of ``cfg.transport``; ``device``: the parameters' (dist sends from there)."""
    if cfg.transport == "fsspec":
        return DirectorySender(cfg.fsspec.url)
    if cfg.transport == "dist":
        return DistSender(cfg.dist, len(cfg.servers), device, cfg.timeout_s)
    return HTTPSender(cfg.servers, cfg.timeout_s, resolve_token(cfg.token))


class WeightPublisher:
    """Sends the trainer's ``params`` through the transport ``cfg.transport`` names; answers every anchor request at
    the sync that learns of it."""

    def __init__(self, cfg: SyncConfig, params: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.params = params
        self.total = sum(p.numel() for p in params.values())
        self.syncs = 0
        self.sender = build_sender(cfg, next(iter(params.values())).device)

    def close(self) -> None:
        """End the servers' receive loops (dist) and leave the process group."""
        self.sender.close()

    def anchor(self, version: int) -> dict[str, float]:
        """Send the whole state as the run's restart anchor (the initial sync, also of a resumed run), which servers
        take at any version. A server that cannot be reached is an ``InputError`` naming its URL."""
        t0 = time.perf_counter()
        nbytes, anchors = self._deliver(anchor_patch(self.params, version, self.sender.to_host, restart=True))
        return {"sync/bytes": float(nbytes), "sync/s": time.perf_counter() - t0, "sync/anchors": float(anchors)}

    def after_step(self, version: int, changed_masks: dict[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.syncs += 1
        full = self.cfg.mode == "full" or (self.cfg.anchor_every and self.syncs % self.cfg.anchor_every == 0)
        to_host = self.sender.to_host
        patch = anchor_patch(self.params, version, to_host) if full else \
            sparse_patch(self.params, changed_masks, version - 1, version, to_host)
        nbytes, anchors = self._deliver(patch)
        return {"sync/bytes": float(nbytes), "sync/s": time.perf_counter() - t0,
                "sync/elements_frac": patch.num_elements / self.total, "sync/anchors": float(anchors)}

    def _deliver(self, patch: Patch) -> tuple[int, int]:
        """Send ``patch``, then an anchor to the receivers that need one. Returns the patch's bytes on the wire and the
        anchors sent on request."""
        nbytes = self.sender.send(patch)
        receivers = self.sender.needs_anchor()
        if not receivers:
            return nbytes, 0
        anchor = patch if patch.anchor else anchor_patch(self.params, patch.version, self.sender.to_host)
        return nbytes, self.sender.send_anchor(anchor, receivers)
