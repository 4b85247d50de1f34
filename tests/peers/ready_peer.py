"""One replica of a two-process rollout that agrees on when to train (run by tests/test_data_parallel.py; not a
test module).

    python tests/peers/ready_peer.py OUT MODE [MODE ...]   MODE: both_score | one_scores | none_score
                                                           (RANK, WORLD_SIZE, ... from the environment)

Rank 0 keeps 16 samples of up to 4 tokens in flight, rank 1 one group of up to 12: rank 0 scores samples
several times faster. Both agree every 2 engine steps on 4 batches of 16 samples between them; each saves the
size of its share of every batch and how often it took part in an agreement to OUT/MODE/rank<r>.json. A constant
reward (rank 1's with ``one_scores``, both ranks' with ``none_score``) gives groups without signal, which are never
trained on; where no replica has any, the RuntimeError that stops the rollout is saved instead. The modes run one
after the other in the same process group: one launch for them all.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest and the test modules
from test_rollout import count_w7, make_loop  # noqa: E402

from unison.dist.runtime import ReadyAgreement  # noqa: E402
from unison.dist.topology import Ranks  # noqa: E402


class Counting(ReadyAgreement):
    calls = 0

    def shares(self, ready, stuck):
        self.calls += 1
        return super().shares(ready, stuck)


def roll_out(mode: str, rank: int) -> dict:
    cfg = dict(max_concurrent_rollouts=16, max_new_tokens=4) if rank == 0 else \
        dict(max_concurrent_rollouts=4, max_new_tokens=12)
    silent = mode == "none_score" or (mode == "one_scores" and rank == 1)
    reward = (lambda prompts, completions, **_: [1.0] * len(completions)) if silent else count_w7
    agreement = Counting(Ranks(rank, 2, torch.device("cpu"), dist.group.WORLD), total=16, every=2)
    loop = make_loop([(reward, 1.0)], samples_per_step=16, max_staleness=10, agreement=agreement, **cfg)
    shares = []
    for version in range(4):
        try:
            batch, _ = loop.next_batch(trainer_version=version)
        except RuntimeError as e:  # what stops a run whose replicas can produce no samples
            if mode != "none_score":
                raise
            return {"error": f"RuntimeError: {e}", "calls": loop.agreement.calls}
        shares.append(len(batch))
    return {"shares": shares, "calls": loop.agreement.calls}


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, *modes = sys.argv[1:]
    for mode in modes:
        result = roll_out(mode, rank)
        os.makedirs(os.path.join(out, mode), exist_ok=True)
        with open(os.path.join(out, mode, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
