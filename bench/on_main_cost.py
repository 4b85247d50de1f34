"""What ``unison.dist.tensor_parallel.on_main`` costs a step where rank 0's result is empty (the episode loop's "no
reply is in"): as any result (its size, then its bytes) against ``empty=`` (the size alone), two gloo ranks calling
it back to back, so that neither waits for the other to arrive (as ranks kept in step
by a sharded forward's all-reduces; ``bench/tool_latency_tp.py``'s ranks are not, and its collective times are
mostly that wait).

    python bench/on_main_cost.py --json bench/results/cpu/on_main_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unison.dist.tensor_parallel import on_main
from unison.dist.topology import Ranks


def rank_main(rank: int, port: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    tp = Ranks(rank, 2, torch.device("cpu"), dist.group.WORLD)
    runs = []
    for _ in range(2):
        for path, kwargs in (("as any result", {}), ("empty=", {"empty": {}})):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                on_main(tp, dict, **kwargs)
            runs.append({"path": path, "us_per_call": round((time.perf_counter() - t) / calls * 1e6, 1)})
    if rank == 0:
        result = {"device": "cpu, two gloo ranks of one thread each", "calls": calls, "runs": runs}
        print(json.dumps(result, indent=2))
        if out:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port, a.calls, a.json), nprocs=2)


if __name__ == "__main__":
    main()
