"""Group-relative advantages."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], eps: float = 1e-6, scale: str = "group") -> list[float] | None:
    """(r - mean) / (std + eps) over one group; None when the group carries no signal (std 0, or < 2 samples).

    std is the population standard deviation of the group's rewards. Exact for any finite rewards; a NaN or inf
    is a ValueError (it would make every advantage of the group NaN). ``scale`` is TRL's ``scale_rewards``:
    'group' as above; 'batch' and 'none' return r - mean (for 'batch', ``batch_scaled`` then divides a whole
    batch by its rewards' std).
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale!r}")
    if scale != "group":
        centred = group_advantages(rewards, 0.0, "group")  # the checks, and None for a group without signal
        if centred is None:
            return None
        mean = math.fsum(rewards) / len(rewards)
        return [r - mean for r in rewards]
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


def batch_scaled(advantages: list[float], rewards_sum: float, rewards_sq_sum: float, count: int,
                 eps: float = 1e-6) -> list[float]:
    """Group-centred ``advantages`` divided by (std + eps) of the batch's rewards (TRL's ``scale_rewards='batch'``,
    PPO-Lite), the population std from the batch's reward sum, sum of squares and count (every data-parallel
    replica's: the sums are what replicas add up)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    mean = rewards_sum / count
    std = math.sqrt(max(rewards_sq_sum / count - mean * mean, 0.0))
    return [a / (std + eps) for a in advantages]
