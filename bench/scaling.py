"""Colocated GRPO steps on one device and as data-parallel replicas: s/step and samples/s.

    python bench/scaling.py --json bench/results/h200x2/scaling.json                   # 1 GPU, then dp=2
    python bench/scaling.py --device cpu --shape tiny --steps 2 --new 16                # the protocol, quick

With dp=N each replica generates and trains 1/N of the global batch (``--prompts`` x G=8 samples of ``--new``
tokens), gradients are summed once per step and the optimizer state is sharded (``unison.dist``). One device runs
twice: the whole global batch (strong scaling: the same step, done by N devices) and one replica's share (weak
scaling: N devices do N times the work of one). Random bf16 weights; rewards random.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine import SHAPES, build
from memory import GROUP, PROMPT_TOKENS, scored_samples

from unison.dist.data_parallel import ShardedAdamW
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.train.loss import LossConfig
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.step import train_step


def run(rank: int, world: int, args, prompts_here: int) -> dict:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    model = build(args.shape, device.type, torch.bfloat16, "unison")
    group = dist.group.WORLD if world > 1 else None
    cfg = OptimConfig(lr=1e-6)
    opt = ShardedAdamW(model.named_parameters(), cfg, args.steps, group) if group else \
        MasterAdamW(model.named_parameters(), cfg, args.steps)
    engine = Engine(model, EngineConfig(num_blocks=prompts_here * GROUP * (-(-(PROMPT_TOKENS + args.new) // 16) + 1),
                                        block_size=16, max_num_seqs=prompts_here * GROUP, max_batch_tokens=8192,
                                        seed=rank))
    g = torch.Generator().manual_seed(1000 + rank)
    prompts = [torch.randint(10, model.config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
               for _ in range(prompts_here)]
    times = []
    for step in range(args.steps):
        if group:
            dist.barrier()
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(max_new_tokens=args.new, n=GROUP, seed=step,
                                                       stop_token_ids=()))
        samples = scored_samples(done, torch.rand(len(done), generator=g).tolist())
        train_step(model, opt, samples, LossConfig(), 1.0, 8192, 0, 1024, dp_group=group)
        engine.on_weights_updated()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    s = min(times[1:] or times)  # the first step compiles kernels and captures graphs
    n = prompts_here * GROUP
    return {"world": world, "samples": n, "s_per_step": s, "samples_per_s": n / s, "steps": args.steps,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def worker(rank: int, world: int, port: int, args, out: dict) -> None:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    result = run(rank, world, args, args.prompts // world)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"replicas": gathered, "s_per_step": max(r["s_per_step"] for r in gathered)}, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global); G=8 samples each")
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    whole = run(0, 1, args, args.prompts)
    share = run(0, 1, args, args.prompts // args.dp)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the replicas need the first device
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"/tmp/unison_scaling_{port}.json"
    mp.spawn(worker, args=(args.dp, port, args, path), nprocs=args.dp, join=True)
    with open(path) as f:
        dp = json.load(f)
    dp["samples_per_s"] = args.prompts * GROUP / dp["s_per_step"]
    out = {"shape": args.shape, "global_samples": args.prompts * GROUP, "new_tokens": args.new,
           "one_whole_batch": whole, "one_replica_share": share, f"dp{args.dp}": dp,
           "dp_speedup_strong": dp["samples_per_s"] / whole["samples_per_s"],
           "dp_speedup_weak": dp["samples_per_s"] / share["samples_per_s"]}
    for name, one in (("whole batch", whole), ("one share", share)):
        print(f"{args.shape} 1 device, {name}: {one['samples']} samples, {one['s_per_step']:.2f} s/step, "
              f"{one['samples_per_s']:.1f} samples/s")
    print(f"{args.shape} dp={args.dp}: {args.prompts * GROUP} samples, {dp['s_per_step']:.2f} s/step, "
          f"{dp['samples_per_s']:.1f} samples/s; speedup {out['dp_speedup_strong']:.2f}x (strong), "
          f"{out['dp_speedup_weak']:.2f}x (weak)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
