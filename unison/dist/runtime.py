"""`torchrun --nproc-per-node N -m unison train ...`: N data-parallel replicas on torch.distributed.

Each replica runs its own engine and rollouts on its own prompts (its seed is the run's plus its rank) and
trains on the share of the step's samples the replicas agree on (``ReadyAgreement``: every few engine steps they
compare how many scored samples each holds); ``train_step`` normalises the loss by every replica's tokens
and sums the gradients once; the optimizer's ``Ownership`` keeps 1/N of its state per replica. Rank 0 writes the
metrics (averaged over replicas, maxima as maxima, token counts summed) and the checkpoints. Every collective
times out after ``dist.timeout_s``, so a replica that dies makes the others fail with an error instead of
waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..bits import checksum
from .topology import Ranks


@dataclass
class DistConfig:
    tp: int = 1
    """Tensor-parallel degree: > 1 shards the model across groups of that many processes; torchrun's N processes
    make N / tp data-parallel replicas."""
    timeout_s: float = 300.0
    """A collective that waits longer than this fails the run: a dead replica is reported, not waited on."""
    ready_every: int = 4
    """Data-parallel replicas compare their counts of scored samples every this many engine steps; they train
    once the counts add up to rollout.samples_per_step."""

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"dist.tp must be >= 1, got {self.tp}")
        if self.ready_every < 1:
            raise ValueError(f"dist.ready_every must be >= 1, got {self.ready_every}")
        if not self.timeout_s > 0:
            raise ValueError(f"dist.timeout_s must be > 0, got {self.timeout_s}")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter or gradient (a DTensor; the same memory), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


class ReadyAgreement:
    """When the data-parallel replicas train, and on how many samples each.

    Every replica rolls out on its own and, every ``every`` engine steps (a fixed cadence: the same call count on
    every replica, whatever each one's completions look like), all-gathers its count of scored samples. Once the
    counts add up to the step's ``total``, every replica computes the same shares (``split_ready``) and trains on
    its share; what it has beyond that waits for the next step. A replica whose completions run long contributes
    fewer samples instead of holding the others back.
    """

    def __init__(self, replica: Ranks, total: int, every: int):
        self.replica, self.total, self.every = replica, total, every
        self.buffer = torch.zeros(2 * replica.world, dtype=torch.int64, device=replica.device)

    def shares(self, ready: int, stuck: bool) -> list[int] | None:
        """A collective: every replica's share of the step's samples, or None while they are too few. ``stuck``
        (this replica cannot produce samples) fails every replica with one error."""
        mine = torch.tensor([ready, int(stuck)], dtype=torch.int64, device=self.replica.device)
        _all_gather_single(self.buffer, mine, group=self.replica.group)
        counts, stuck_flags = self.buffer.view(-1, 2).T.tolist()
        if any(stuck_flags):
            raise RuntimeError(f"data-parallel replicas {[r for r, s in enumerate(stuck_flags) if s]} can produce "
                               "no samples (that replica's log says why)")
        return split_ready(counts, self.total)


# torch >= 2.13 renames all_gather_into_tensor (which then warns); the GPU image's 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_ready(counts: list[int], total: int) -> list[int] | None:
    """Shares of ``total`` samples among replicas that hold ``counts`` ready ones: as even as the counts allow
    (a replica short of an even share gives its remainder to the others), None if they hold fewer than ``total``.

    >>> split_ready([10, 10], 16), split_ready([3, 20], 16), split_ready([5, 5, 9], 12), split_ready([7, 8], 16)
    ([8, 8], [3, 13], [4, 4, 4], None)
    """
    if sum(counts) < total:
        return None
    shares, left = [0] * len(counts), total
    while left:
        open_ = [r for r, c in enumerate(counts) if shares[r] < c]
        even, extra = divmod(left, len(open_))
        for i, r in enumerate(open_):
            give = min(counts[r] - shares[r], even + (i < extra))
            shares[r] += give
            left -= give
    return shares


def reduce_metrics(metrics: dict[str, float], replica: Ranks) -> dict[str, float]:
    """Every replica's metrics in one dict: maxima as maxima, token, row and sample counts summed, the rest
    averaged (a NaN, the mean of nothing on a replica that trained no sample, counts as missing)."""
    gathered: list[dict] = [None] * replica.world
    dist.all_gather_object(gathered, metrics, group=replica.group)
    out = {}
    for key in {k for m in gathered for k in m}:
        values = [m[key] for m in gathered if m.get(key) is not None]
        values = [v for v in values if v == v] or values  # NaN only where every replica has NaN
        if not values:
            out[key] = None
        elif "max" in key:
            out[key] = max(values)
        elif key.startswith("train/") and key.endswith(("tokens", "rows", "samples")):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def agree_with_rank0(value, ranks: Ranks, what: str) -> None:
    """Raise if any rank of ``ranks`` holds another ``value`` (any picklable) than its rank 0: ``what`` names the
    ranks and the value in the error."""
    gathered: list = [None] * ranks.world
    dist.all_gather_object(gathered, value, group=ranks.group)
    bad = [rank for rank, other in enumerate(gathered) if other != gathered[0]]
    if bad:
        raise RuntimeError(what.format(bad))


def check_replicas_agree(model: torch.nn.Module, replica: Ranks) -> None:
    """Raise if any replica's parameters differ from rank 0's (they must be identical after every step)."""
    agree_with_rank0({name: checksum(local(p)) for name, p in model.named_parameters()}, replica,
                     "data-parallel replicas {} hold parameters that differ from rank 0's")
