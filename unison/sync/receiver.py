"""The receiving side: applies patches in place and knows, provably, which version it holds."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .codec import Framed, Patch, apply, decode
from .validate import DivergedError, MissedVersionError, PatchError

log = logging.getLogger(__name__)


class Receiver:
    """Holds ``params`` (name -> tensor, updated in place) at ``version``; -1 means nothing synced yet.

    ``receive(blob)`` applies a patch or an anchor, all or nothing. State a server acts on:

    - ``weights_valid``: the weights equal the trainer's at ``version``. False until the first anchor (unless
      constructed with ``version >= 0``) and after a checksum mismatch.
    - ``needs_anchor``: only an anchor can help (initially when ``version < 0``; after a missed version, a sparse
      patch whose base is ahead of ``version``; after a checksum mismatch). Sparse patches are skipped meanwhile.
    - A patch refused before any write (unreadable, malformed, stale, going backwards, non-finite values) is
      counted in ``counts["rejected"]`` with the reason in ``last_error``, and changes nothing else: one garbage POST
      must not stop a server from serving.

        >>> r = Receiver(params, version=0)
        >>> r.receive(b"garbage"), r.needs_anchor, r.weights_valid
        (False, False, True)
    """

    def __init__(self, params: dict[str, torch.Tensor], version: int = -1):
        self.params = params
        self.version = version
        self.needs_anchor = version < 0
        self.weights_valid = version >= 0
        self.counts: Counter = Counter()
        self.last_error: str | None = None

    def receive(self, blob: bytes | Framed) -> bool:
        """True if the patch (safetensors bytes, or as the torch.distributed transport frames it) was applied."""
        try:
            patch = decode(blob)
            if self.needs_anchor and not patch.anchor:
                self.counts["skipped_until_anchor"] += 1
                self.last_error = f"waiting for an anchor: patch {patch.base_version} -> {patch.version} skipped"
                return False
            if self._anchor_not_needed(patch):
                self.counts["anchors_not_needed"] += 1  # another receiver asked for it
                return True
            self.version = apply(self.params, patch, self.version)
        except PatchError as e:
            self._refuse(e)
            return False
        self.needs_anchor, self.weights_valid = False, True
        self.counts["anchors" if patch.anchor else "patches"] += 1
        self.counts["elements"] += patch.num_elements
        return True

    def _anchor_not_needed(self, patch: Patch) -> bool:
        # A restart anchor is always applied: the restarted trainer's weights at this version may differ.
        return patch.anchor and not patch.restart and not self.needs_anchor and patch.version == self.version

    def _refuse(self, e: PatchError) -> None:
        self.last_error = str(e)
        self.counts["rejected"] += 1
        if isinstance(e, (MissedVersionError, DivergedError)):
            self.needs_anchor = True
            self.weights_valid &= not isinstance(e, DivergedError)
            log.warning("weight patch rejected, asking for an anchor: %s", e)
        else:
            log.warning("weight patch refused (the weights are unchanged): %s", e)
