"""One rank of a two-rank tensor-parallel group running the multi-turn loop (run by
tests/test_tools_tensor_parallel.py; not a test module).

    python tests/peers/tools_tp_peer.py OUT              (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
    python tests/peers/tools_tp_peer.py MODEL_DIR OUT    environment)

Both ranks hold the same scripted engine (tests/multiturn_helpers.py) and run the loop with ``tp`` set, as every rank
of `unison train --dist.tp` does, with the tools run in the background and waited for. The environment's reset, its
tool and its respond each answer with this process's rank and count their calls, and rank 0's tool takes a
different time for each sample, so a rank that ran them itself would show it in its samples. Each rank saves, per
mode, its samples' tokens, the calls it made and the engine steps it took, and what ``on_main`` raised where rank 0's
function failed, to OUT/rank<r>.pt.
With MODEL_DIR, the ranks instead run `unison train --dist.tp=2` on that model with the environment (a random model
makes no tool calls, and its turns mostly end at the length limit: the resets are what differ by rank); the run
checks that both ranks trained the same samples.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest and the helpers
from multiturn_helpers import ScriptedEngine, byte_tokenizer  # noqa: E402

from unison.dist.tensor_parallel import BroadcastScorer, on_main  # noqa: E402
from unison.dist.topology import Ranks  # noqa: E402
from unison.episodes import EpisodeConfig, MultiTurnRolloutLoop  # noqa: E402
from unison.rollout.loop import RolloutConfig  # noqa: E402
from unison.rollout.rewards import RewardScorer  # noqa: E402

RANK = int(os.environ["RANK"])
CALLS = {"reset": 0, "tool": 0, "respond": 0}
END = "<|im_end|>"


class RankEcho:
    """Answers with the rank it runs on; the reward grows with the number it was asked to check."""

    def reset(self, **row) -> str:
        CALLS["reset"] += 1
        self.checked = 0
        return f"reset on rank {RANK}"

    def check(self, number: int) -> str:
        """Check a number.

        Args:
            number: The number.
        """
        CALLS["tool"] += 1
        time.sleep(0.01 * number)  # replies come back on different engine steps
        self.checked = number
        return f"checked {number} on rank {RANK}"

    def respond(self, text: str) -> str | None:
        CALLS["respond"] += 1
        return None if "again" in text else f"respond on rank {RANK}: again?"


def script(req, context: str) -> str:
    """First turn calls the tool with a number that depends on the sample, then answers; after respond, ends."""
    if "respond on rank" in context:
        return f"ok, again{END}"
    if "checked" in context:
        return f"done{END}"
    n = int(req.request_id.rsplit("-", 1)[1]) + 1
    return f'<tool_call>{{"name": "check", "arguments": {{"number": {n}}}}}</tool_call>{END}'


def checked(prompts, completions, environments, **_):
    return [float(env.checked) for env in environments]


def train_run(model_dir: str, out: str) -> None:
    from test_train_e2e import run_cfg

    from unison.tasks.task import Task
    from unison.train.loop import train

    rows = [{"prompt": f"Question {i}."} for i in range(4)]
    task = Task("rank_echo", rows, [(lambda completions, **_: [float(len(c)) for c in completions], 1.0)],
                environment_factory=RankEcho)
    metrics = train(run_cfg(model_dir, os.path.join(out, "run"), "--dist.tp=2", "--max_steps=1",
                            "--episode.max_turns=3", "--step.max_tokens_per_row=2048",
                            "--engine.num_blocks=2048"), task)
    torch.save({"calls": CALLS, "turns_mean": metrics["episode/turns_mean"]}, os.path.join(out, f"rank{RANK}.pt"))


def main():
    if len(sys.argv) > 2:
        return train_run(*sys.argv[1:3])  # MODEL_DIR OUT
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp = Ranks(RANK, 2, torch.device("cpu"), dist.group.WORLD)
    tok = byte_tokenizer()
    rows = [{"prompt": f"Question {i}."} for i in range(3)]
    result = {}
    for background in (False, True):
        CALLS.update(reset=0, tool=0, respond=0)
        loop = MultiTurnRolloutLoop(ScriptedEngine(tok, script), tok, rows, [(checked, 1.0)],
                                    RolloutConfig(group_size=4, samples_per_step=8, max_concurrent_rollouts=8,
                                                  max_new_tokens=96),
                                    stop_token_ids=[257], max_sample_tokens=2048,
                                    scorer=BroadcastScorer(RewardScorer([(checked, 1.0)]), tp),
                                    episode_cfg=EpisodeConfig(max_turns=4, tools_in_background=background),
                                    environment_factory=RankEcho, tp=tp)
        batch, metrics = loop.next_batch(trainer_version=0)
        result["background" if background else "waiting"] = {
            "samples": [[list(s.prompt_ids), list(s.completion_ids), s.reward] for s in batch],
            "texts": [tok.decode(list(s.completion_ids)) for s in batch], "calls": dict(CALLS),
            "turns_mean": metrics["episode/turns_mean"], "engine_steps": metrics["rollout/engine_steps"]}
    errors = []
    for empty in (None, {}):  # (None: a plain result's path)
        try:
            on_main(tp, lambda: 1 / 0, **({} if empty is None else {"empty": empty}))
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    # An expected empty result goes as its size alone: (value on this rank, broadcasts it took)
    broadcasts, broadcast = [0], dist.broadcast

    def counted(*args, **kwargs):
        broadcasts[0] += 1
        return broadcast(*args, **kwargs)
    dist.broadcast = counted
    sent = []
    for value in ({}, {"r0": "reply"}, {}):
        before = broadcasts[0]
        sent.append((on_main(tp, lambda value=value: value if RANK == 0 else "not rank 0's", empty={}),
                     broadcasts[0] - before))
    dist.broadcast = broadcast
    torch.save({**result, "errors": errors, "sent": sent}, os.path.join(sys.argv[1], f"rank{RANK}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
