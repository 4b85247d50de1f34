"""Group-relative advantages."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float] | None:
    """(r - mean) / (std + eps) over one group; None when the group carries no signal (std 0, or < 2 samples).

    std is the population standard deviation of the group's rewards. Exact for any finite rewards; a NaN or inf
    is a ValueError (it would make every advantage of the group NaN).
    """
    not_finite = [r for r in rewards if not math.isfinite(r)]
    if not_finite:
        raise ValueError(f"rewards must be finite, got {not_finite[:3]} in a group of {len(rewards)}")
    if len(rewards) < 2 or max(rewards) == min(rewards):
        return None
    # Computed on the rewards scaled into [-1, 1] by a power of two: their sums and squares cannot overflow (rewards
    # near 1e300 raised OverflowError squaring), and a power of two scales without rounding, so rewards of ordinary
    # size get bit for bit the advantages of the unscaled formula.
    exp = math.frexp(max(abs(r) for r in rewards))[1]
    xs = [math.ldexp(r, -exp) for r in rewards]
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    if exp >= 0:  # eps scales down with the rewards
        return [(x - mean) / (std + math.ldexp(eps, -exp)) for x in xs]
    # Tiny rewards: eps scaled up with them could pass the float range; back at their own scale nothing overflows.
    return [math.ldexp(x - mean, exp) / (math.ldexp(std, exp) + eps) for x in xs]
