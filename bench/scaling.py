"""Colocated GRPO steps on one device and as data-parallel replicas: s/step and samples/s.

    python bench/scaling.py --json bench/results/h200x2/scaling.json                   # 1 GPU, dp=2, tp=2
    python bench/scaling.py --device cpu --shape tiny --steps 2 --new 16                # the protocol, quick

With dp=N each replica generates and trains 1/N of the global batch (``--prompts`` x G=8 samples of ``--new``
tokens), gradients are summed once per step and the optimizer state is sharded (``unison.dist``). One device runs
twice: the whole global batch (strong scaling: the same step, done by N devices) and one replica's share (weak
scaling: N devices do N times the work of one). With tp=N the N devices hold one model, sharded, and run the whole
global batch together. Random bf16 weights; rewards random.
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
from grpo_step import make_checkpoint
from memory import GROUP, PROMPT_TOKENS, scored_samples

from unison.dist.topology import Ranks, Topology, init_topology
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.models import load_policy
from unison.train.loss import LossConfig
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step


def run(rank: int, world: int, args, prompts_here: int, topology: Topology | None = None) -> dict:
    """GRPO steps on ``prompts_here`` prompts: alone (world 1), as one data-parallel replica, or as one rank of a
    tensor-parallel group (``topology.tp``: every rank runs the same samples on its shard of the model)."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    cfg = OptimConfig(lr=args.lr)
    tp = topology.tp if topology is not None else None
    group = dist.group.WORLD if world > 1 and tp is None else None
    if tp is not None:
        model, _ = load_policy(args.checkpoint, dtype=torch.bfloat16, device=device, topology=topology)
    else:
        model = build(args.shape, device.type, torch.bfloat16, "unison")
        topology = Topology(device, rank, world, dp=Ranks(rank, world, device, group)) if group else None
    opt = build_optimizer(model, cfg, args.steps, topology)
    seed = rank if group else 0  # replicas roll out their own prompts; tensor-parallel ranks the same ones
    engine = Engine(model, EngineConfig(num_blocks=prompts_here * GROUP * (-(-(PROMPT_TOKENS + args.new) // 16) + 1),
                                        block_size=16, max_num_seqs=prompts_here * GROUP, max_batch_tokens=8192,
                                        seed=seed, cuda_graphs=not args.eager), topology=topology)
    g = torch.Generator().manual_seed(1000 + seed)
    prompts = [torch.randint(10, model.config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
               for _ in range(prompts_here)]
    times, mismatch = [], []
    for step in range(args.steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(max_new_tokens=args.new, n=GROUP, seed=step,
                                                       stop_token_ids=()))
        samples = scored_samples(done, torch.rand(len(done), generator=g).tolist())
        metrics = train_step(model, opt, samples, LossConfig(), 1.0, 8192, 0, 1024, topology=topology)
        mismatch.append(metrics["mismatch/logprob_diff_mean"])  # engine vs trainer, before this step's update
        engine.weights_updated(step + 1)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    s = min(times[1:] or times)  # the first step compiles kernels and captures graphs
    n = prompts_here * GROUP
    return {"world": world, "tp": tp.world if tp else 1, "samples": n, "s_per_step": s, "samples_per_s": n / s,
            "steps": args.steps, "logprob_diff_mean": sum(mismatch) / len(mismatch),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def worker(rank: int, world: int, port: int, args, out: str, tensor_parallel: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    if tensor_parallel:
        result = run(rank, world, args, args.prompts, init_topology(world, 600.0, args.device))
    else:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
        result = run(rank, world, args, args.prompts // world)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"replicas": gathered, "s_per_step": max(r["s_per_step"] for r in gathered),
                       "logprob_diff_mean": sum(r["logprob_diff_mean"] for r in gathered) / world}, f)
    dist.destroy_process_group()


def spawn(world: int, args, tensor_parallel: bool) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = f"/tmp/unison_scaling_{port}.json"
    mp.spawn(worker, args=(world, port, args, path, tensor_parallel), nprocs=world, join=True)
    with open(path) as f:
        result = json.load(f)
    result["samples_per_s"] = args.prompts * GROUP / result["s_per_step"]
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global); G=8 samples each")
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2, help="0: skip the tensor-parallel run")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.checkpoint = f"/tmp/unison_scaling_{args.shape}"  # tensor parallelism shards a checkpoint as it loads
    if args.tp:
        make_checkpoint(args.shape, args.checkpoint, torch.bfloat16, args.device)
    whole = run(0, 1, args, args.prompts)
    share = run(0, 1, args, args.prompts // args.dp)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the replicas need the first device
    dp = spawn(args.dp, args, tensor_parallel=False)
    out = {"shape": args.shape, "global_samples": args.prompts * GROUP, "new_tokens": args.new,
           "one_whole_batch": whole, "one_replica_share": share, f"dp{args.dp}": dp,
           "dp_speedup_strong": dp["samples_per_s"] / whole["samples_per_s"],
           "dp_speedup_weak": dp["samples_per_s"] / share["samples_per_s"]}
    if args.tp:
        tp = out[f"tp{args.tp}"] = spawn(args.tp, args, tensor_parallel=True)
        out["tp_speedup"] = tp["samples_per_s"] / whole["samples_per_s"]
    for name, one in (("whole batch", whole), ("one share", share)):
        print(f"{args.shape} 1 device, {name}: {one['samples']} samples, {one['s_per_step']:.2f} s/step, "
              f"{one['samples_per_s']:.1f} samples/s")
    print(f"{args.shape} dp={args.dp}: {args.prompts * GROUP} samples, {dp['s_per_step']:.2f} s/step, "
          f"{dp['samples_per_s']:.1f} samples/s; speedup {out['dp_speedup_strong']:.2f}x (strong), "
          f"{out['dp_speedup_weak']:.2f}x (weak)")
    if args.tp:
        print(f"{args.shape} tp={args.tp}: {args.prompts * GROUP} samples, {tp['s_per_step']:.2f} s/step, "
              f"{tp['samples_per_s']:.1f} samples/s ({out['tp_speedup']:.2f}x); engine vs trainer logprob diff "
              f"{tp['logprob_diff_mean']:.2e} (one device: {whole['logprob_diff_mean']:.2e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
