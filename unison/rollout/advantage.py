"""Group-relative advantages."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float] | None:
    """(r - mean) / (std + eps) over one group; None when the group carries no signal (std 0, or < 2 samples).

    std is the population standard deviation of the group's rewards.
    """
    if len(rewards) < 2 or max(rewards) == min(rewards):
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]
