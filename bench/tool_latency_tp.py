"""Multi-turn episodes under tensor parallelism, on two CPU ranks (gloo): rank 0 runs the environment, every rank
continues its episodes with rank 0's replies. Wall time with the replies waited for each engine step and in the
background, against one process alone, for an environment that takes ``--latency`` seconds to answer.

    python bench/tool_latency_tp.py --latency 0,0.1,0.5 --json bench/results/cpu/tool_latency_tp.json

Each rank holds the whole tiny model (``bench/engine.py``'s ``tiny`` shape, random weights, the same seed): what is
measured is the loop's coordination of the ranks (which replies join, at which step), not a sharded forward, which
`unison train --dist.tp` adds on top. Turns end on stop words (``bench/loop_overlap.py``'s workload: a word-level
tokenizer, one word in ``--stop-words`` ends a turn), so replies are due on different steps. Reported per run: wall
seconds over ``--batches`` batches after a warm-up batch, engine steps, the loop's wait for replies with nothing to
decode (``rollout/tool_wait_s``), and rank 0's collectives of the loop (``on_main`` calls), the broadcasts in them
and their seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from engine import build  # noqa: E402  (bench/engine.py)
from loop_overlap import episode_loop, workload_args  # noqa: E402

from unison.dist import tensor_parallel  # noqa: E402
from unison.dist.topology import Ranks  # noqa: E402
from unison.episodes import loop as episodes_loop  # noqa: E402


def slow_answers(reply: str, latency: float):
    class SlowAnswers:
        def reset(self, **_) -> None:
            pass

        def respond(self, text: str) -> str:
            time.sleep(latency)
            return reply  # the loop ends the episode at episode.max_turns

    return SlowAnswers


class Counted:
    """``on_main`` as the episode loop calls it, counted and timed, and the broadcasts inside it counted."""

    def __init__(self):
        self.calls, self.seconds, self.broadcasts = 0, 0.0, 0

    def __call__(self, tp, fn, **kwargs):
        t0 = time.perf_counter()
        originals = dist.broadcast, c10d.broadcast  # (broadcast_object_list calls c10d's own name)

        def counted(*args, **kw):
            self.broadcasts += 1
            return originals[0](*args, **kw)
        dist.broadcast = c10d.broadcast = counted
        try:
            return tensor_parallel.on_main(tp, fn, **kwargs)
        finally:
            dist.broadcast, c10d.broadcast = originals
            self.calls += tp is not None
            self.seconds += time.perf_counter() - t0


def run(a, latency: float, background: bool, tp: Ranks | None) -> dict:
    torch.manual_seed(0)
    loop = episode_loop(a, build("tiny", "cpu", torch.float32, "unison"), {}, {"tools_in_background": background},
                        lambda reply: slow_answers(reply, latency), tp=tp)
    engine = loop.engine
    loop.next_batch(trainer_version=0)  # warm-up
    counted = episodes_loop.on_main = Counted()
    steps0, t0, waited = engine.stats()["steps"], time.perf_counter(), 0.0
    for _ in range(a.batches):
        waited += loop.next_batch(trainer_version=0)[1]["rollout/tool_wait_s"]
    wall = time.perf_counter() - t0
    episodes_loop.on_main = tensor_parallel.on_main
    return {"mode": ("tp=2 " if tp is not None else "alone ") + ("background" if background else "waiting"),
            "latency_s": latency, "wall_s": round(wall, 3), "engine_steps": engine.stats()["steps"] - steps0,
            "tool_wait_s": round(waited, 3), "collectives": counted.calls, "broadcasts": counted.broadcasts,
            "collective_s": round(counted.seconds, 3)}


def rank_main(a) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    tp = Ranks(rank, 2, torch.device("cpu"), dist.group.WORLD)
    results = []
    for latency in [float(x) for x in a.latency.split(",")]:
        if rank == 0:  # the same workload in one process, while rank 1 waits at the barrier
            results.append(run(a, latency, True, None))
            print(json.dumps(results[-1]), flush=True)
        dist.barrier()
        for background in (False, True):
            results.append(run(a, latency, background, tp))
            if rank == 0:
                print(json.dumps(results[-1]), flush=True)
    if rank == 0 and a.json:
        workload = {k: getattr(a, k) for k in ("episodes", "group", "turns", "new", "stop_words", "reply", "batches")}
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"device": "cpu, two gloo ranks of one thread each", "shape": "tiny", "workload": workload,
                       "results": results}, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latency", default="0,0.1,0.5", help="seconds the environment takes to answer, comma-separated")
    workload_args(ap)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if "RANK" in os.environ:
        return rank_main(a)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, *sys.argv],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}) for r in range(2)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
