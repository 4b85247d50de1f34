"""Tensors as their stored bits: what the optimizer's changed masks, the sync codec and the checksums compare."""

from __future__ import annotations

import hashlib

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as signed integers of the element's width."""
    return t.view(_BITS[t.element_size()])


def changed_bits(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where the stored bits differ. Bits, not values: -0.0 == 0.0 would leave a receiver's bytes (and checksum)
    stale."""
    return as_bits(new) != as_bits(old)


_CHUNK = 1 << 24
_K1, _K2, _K3 = -7046029254386353131, -4658895280553007687, 7256422663693437747  # odd 64-bit constants


def checksum(t: torch.Tensor) -> str:
    """128-bit digest of a tensor's bits, its shape and dtype, computed where the tensor lives (no copy to the
    host): each element's bits are mixed with its position, the mixes summed mod 2**64 in two lanes. Integer sums
    are order-free, so the CPU and the GPU agree exactly. It detects corruption and divergence, not adversaries."""
    flat = as_bits(t.detach().reshape(-1))
    lanes = [0, 0]
    for start in range(0, flat.numel(), _CHUNK):
        bits = flat[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + bits.numel(), dtype=torch.int64, device=bits.device)
        for lane, (a, b) in enumerate(((_K1, _K2), (_K2, _K3))):
            v = bits * a + pos * b
            v = (v ^ (v >> 29)) * _K3
            v = v ^ (v >> 32)
            lanes[lane] = (lanes[lane] + int(v.sum())) % 2**64
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(lanes[0].to_bytes(8, "little") + lanes[1].to_bytes(8, "little"))
    return h.hexdigest()
