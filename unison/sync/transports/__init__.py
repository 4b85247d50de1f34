"""How weight patches travel from the trainer to its generation servers; ``sync.transport`` picks one:

- ``http`` (``transports.http``): a POST to each server's ``/v1/weights``; no settings of its own (the
  servers are sync.servers).
- ``fsspec`` (``transports.directory``): a directory the trainer writes and the servers poll (``sync.fsspec``).
- ``dist`` (``transports.dist``): a ``torch.distributed`` group of the trainer and the servers (``sync.dist``).

The trainer's side is a ``Sender`` (``unison.sync.publisher.build_sender``), a server's a ``Source`` (``build_source``,
``unison serve --sync.transport=...``) beside the HTTP ``Inbox`` every server has (``transports.base``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ...config import check_literals
from ..receiver import Receiver
from .base import Inbox, Sender, Source
from .directory import DirectorySender, DirectorySource, FsspecConfig
from .dist import DistChannel, DistSender, DistServeSyncConfig, DistSource, DistSyncConfig
from .http import HTTPSender

__all__ = ["DirectorySender", "DirectorySource", "DistChannel", "DistSyncConfig", "DistSender", "DistServeSyncConfig",
           "DistSource", "FsspecConfig", "HTTPSender", "Inbox", "Sender", "Source", "SourceConfig", "build_source"]


@dataclass
class SourceConfig:
    """A server's side of the sync (``unison serve --sync.*``): where patches come from besides ``POST
    /v1/weights``, which every server takes."""

    transport: Literal["http", "fsspec", "dist"] = "http"
    """The trainer's sync.transport: ``http`` (POSTs only), ``fsspec`` (also poll sync.fsspec.url) or ``dist`` (also
    join the trainer's process group, sync.dist)."""
    fsspec: FsspecConfig = field(default_factory=FsspecConfig)
    dist: DistServeSyncConfig = field(default_factory=DistServeSyncConfig)

    def __post_init__(self):
        check_literals(self, "sync.")
        if self.transport == "fsspec" and not self.fsspec.url:
            raise ValueError("sync.transport=fsspec needs sync.fsspec.url (the directory the trainer writes to)")
        if self.transport == "dist" and not self.dist.init_method:
            raise ValueError("sync.transport=dist needs sync.dist.init_method (the trainer's tcp://host:port)")


def build_source(cfg: SourceConfig, receiver: Receiver, device: torch.device) -> Source | None:
    """The source ``cfg.transport`` names, applying into ``receiver``; None for http, whose patches arrive as POSTs
    (the server's own ``Inbox``)."""
    if cfg.transport == "fsspec":
        return DirectorySource(cfg.fsspec.url, receiver)
    if cfg.transport == "dist":
        return DistSource(cfg.dist, receiver, device)
    return None
