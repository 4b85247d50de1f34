"""The receiving side: applies patches in place and knows, provably, which version it holds."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .codec import Framed, PatchError, apply, decode

log = logging.getLogger(__name__)


class Receiver:
    """Holds ``params`` (name -> tensor, updated in place) at ``version``; -1 means nothing synced yet.

    ``receive(blob)`` applies a patch or an anchor. A patch that fails any check (unreadable, wrong base version,
    a missed version, bad index, dtype or shape, a checksum that does not match afterwards) is counted and sets
    ``needs_anchor``; until an anchor arrives, sparse patches are skipped (they cannot be applied safely).
    """

    def __init__(self, params: dict[str, torch.Tensor], version: int = -1):
        self.params = params
        self.version = version
        self.needs_anchor = version < 0
        self.counts: Counter = Counter()
        self.last_error: str | None = None

    def receive(self, blob: bytes | Framed) -> bool:
        """True if the patch (safetensors bytes, or as the torch.distributed transport frames it) was applied."""
        try:
            patch = decode(blob)
            if self.needs_anchor and not patch.anchor:
                self.counts["skipped_until_anchor"] += 1
                return False
            if patch.anchor and not self.needs_anchor and patch.version == self.version:
                self.counts["anchors_not_needed"] += 1  # another receiver asked for it
                return True
            self.version = apply(self.params, patch, self.version)
        except PatchError as e:
            self.needs_anchor = True
            self.last_error = str(e)
            self.counts["rejected"] += 1
            log.warning("weight patch rejected, asking for an anchor: %s", e)
            return False
        self.needs_anchor = False
        self.counts["anchors" if patch.anchor else "patches"] += 1
        self.counts["elements"] += patch.num_elements
        return True
