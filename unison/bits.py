"""Tensors as their stored bits: what the optimizer's changed masks, the sync codec and the checksums compare."""

from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as signed integers of the element's width."""
    return t.view(_BITS[t.element_size()])


def changed_bits(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where the stored bits differ. Bits, not values: -0.0 == 0.0 would leave a receiver's bytes (and checksum)
    stale."""
    return as_bits(new) != as_bits(old)
