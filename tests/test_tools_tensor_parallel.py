"""Multi-turn episodes under tensor parallelism: rank 0 alone resets the environments and runs the tools and
``respond``; every rank continues its episodes with rank 0's replies, so the ranks' requests stay the same (a reply
that differed between ranks, or a tool that timed out on one, would part them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_tensor_parallel import PEERS, free_port


def test_rank_zero_runs_the_environment_and_every_rank_gets_its_replies(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(PEERS, "tools_tp_peer.py"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # Every episode ran its tool turn and the respond turn: 3 model turns each, 8 samples.
    assert len(zero["samples"]) == 8 and zero["turns_mean"] == one["turns_mean"] == 3
    assert zero["calls"]["reset"] >= 8 and zero["calls"]["tool"] >= 8 and zero["calls"]["respond"] >= 16
    assert one["calls"] == {"reset": 0, "tool": 0, "respond": 0}
    assert one["samples"] == zero["samples"]  # prompts, every turn's tokens, rewards: the same on both ranks
    for text in one["texts"]:
        assert "on rank 0" in text and "on rank 1" not in text
    assert sorted({s[2] for s in zero["samples"]}) == [1.0, 2.0, 3.0, 4.0]  # the rewards read rank 0's environments
    assert zero["errors"] == ["ZeroDivisionError: division by zero"]
    assert one["errors"] == ["RuntimeError: tensor-parallel rank 0 failed where this rank waited for its result: "
                             "ZeroDivisionError: division by zero"]
