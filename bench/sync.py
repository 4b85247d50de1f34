"""Sparse vs full weight sync between a trainer and a generation server on two devices, after real GRPO steps;
and the AdamW-inversion detector's misses over 200 steps.

    python bench/sync.py --json bench/results/h200x2/sync.json          # two GPUs: trainer cuda:0, server cuda:1
    python bench/sync.py --device cpu --shapes tiny --steps 3           # the same protocol over gloo, quick
    python bench/sync.py --inversion-only --json inversion.json        # the detector alone, on one device

Per workload (shape, lr): the trainer generates 8 prompts x G=8 samples of 128 tokens with its colocated engine,
trains one step (fp32-master AdamW), then syncs over a torch.distributed group (NCCL on GPUs) as ``unison train
--sync.transport=dist`` does, device to device (``--framing bytes``: as safetensors bytes through host memory,
what the directory and HTTP transports carry): the sparse patch (changed elements only) every step, and the full
anchor after the first two steps (it has the same size every step; the first of each kind is warm-up). A sync is
timed from the start of building its message to the server's acknowledgement that it applied and verified it (an
all-reduce after the apply). Random bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine import SHAPES, build
from memory import GROUP, scored_samples

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.rollout.sample import Sample
from unison.sync import Framed, Receiver, anchor_patch, apply, decode, encode, frame, sparse_patch
from unison.sync.codec import payload_nbytes
from unison.sync.masks import adamw_inversion_mask
from unison.sync.transports import DistChannel
from unison.train.loss import LossConfig
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 64, 128


def grpo_samples(engine: Engine, prompts: list[list[int]], step: int) -> list[Sample]:
    done = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, n=GROUP, seed=step,
                                                   stop_token_ids=()))
    g = torch.Generator().manual_seed(step)
    return scored_samples(done, torch.rand(len(done), generator=g).tolist())


def wire(patch_of_host, framing: str) -> bytes | Framed:
    """``framed``: the tensors where they are (what ``unison train`` sends over dist); ``bytes``: a safetensors
    file through host memory (what it sends to a directory or over HTTP)."""
    return frame(patch_of_host(False)) if framing == "framed" else encode(patch_of_host(True))


def sparse_blob(params, masks, step: int, framing: str) -> bytes | Framed:
    return wire(lambda to_host: sparse_patch(params, masks, step - 1, step, to_host), framing)


def full_blob(params, step: int, framing: str) -> bytes | Framed:
    return wire(lambda to_host: anchor_patch(params, step, to_host), framing)


def timed_send(channel: DistChannel, make_blob) -> tuple[float, int]:
    t0 = time.perf_counter()
    blob = make_blob()
    channel.broadcast(blob)
    channel.anyone_needs_anchor(False)  # returns once the server applied and verified it
    return time.perf_counter() - t0, payload_nbytes(blob)


def trainer(args, device: torch.device, channel: DistChannel, save) -> list[dict]:
    results = []
    for shape in args.shapes.split(","):
        for lr in args.lrs:
            model = build(shape, device.type, torch.bfloat16, "unison")
            params = dict(model.named_parameters())
            opt = build_optimizer(model.named_parameters(), OptimConfig(lr=lr), total_steps=args.steps)
            engine = Engine(model, EngineConfig(num_blocks=PROMPTS * GROUP * 14, block_size=16, seed=0,
                                                max_num_seqs=PROMPTS * GROUP, max_batch_tokens=8192))
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(10, model.config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
                       for _ in range(PROMPTS)]
            channel.broadcast(json.dumps({"shape": shape, "steps": args.steps}).encode())
            timed_send(channel, partial(full_blob, params, 0, args.framing))  # the initial full sync
            rows = []
            for step in range(1, args.steps + 1):
                samples = grpo_samples(engine, prompts, step)
                train_step(model, opt, samples, LossConfig(), 1.0, 8192, 0, 1024)
                engine.weights_updated(step)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                changed = sum(int(m.sum()) for m in opt.changed_masks.values())
                numel = sum(p.numel() for p in params.values())
                sparse = partial(sparse_blob, params, opt.changed_masks, step, args.framing)
                sparse_s, sparse_bytes = timed_send(channel, sparse)
                row = {"changed_frac": changed / numel, "sparse_s": sparse_s, "sparse_bytes": sparse_bytes}
                if step <= 2:  # a full copy is the same size every step: timed once after the warm-up
                    full = partial(full_blob, params, step, args.framing)
                    row["full_s"], row["full_bytes"] = timed_send(channel, full)
                rows.append(row)
                print(f"  {shape} lr {lr:g} step {step}: changed {changed / numel:.2%}, sparse "
                      f"{sparse_bytes / 2**20:.1f} MiB {sparse_s * 1e3:.0f} ms" + (
                          f", full {row['full_bytes'] / 2**20:.1f} MiB {row['full_s'] * 1e3:.0f} ms"
                          if "full_s" in row else ""), flush=True)
            timed = rows[1:] or rows  # the first step includes kernel compilation and graph capture
            mean = {k: statistics.mean(r[k] for r in timed if k in r) for k in timed[0]}
            results.append({"name": f"{shape}/lr{lr:g}", "params": numel, "steps": args.steps,
                            "changed_frac_mean": mean["changed_frac"],
                            "sparse": {"bytes": mean["sparse_bytes"], "s": mean["sparse_s"]},
                            "full": {"bytes": mean["full_bytes"], "s": mean["full_s"]},
                            "bytes_ratio": mean["full_bytes"] / mean["sparse_bytes"],
                            "time_ratio": mean["full_s"] / mean["sparse_s"], "per_step": rows})
            save(results)
            del engine, opt, model, params
            if device.type == "cuda":
                torch.cuda.empty_cache()
    channel.broadcast(b"")  # done
    return results


def server(device: torch.device, channel: DistChannel) -> None:
    while True:
        header = channel.broadcast(None)
        if not header:
            return
        spec = json.loads(header)
        model = build(spec["shape"], device.type, torch.bfloat16, "unison")
        receiver = Receiver(dict(model.named_parameters()))
        receiver.receive(channel.broadcast(None))  # the initial anchor
        channel.anyone_needs_anchor(receiver.needs_anchor)
        for step in range(1, spec["steps"] + 1):
            receiver.receive(channel.broadcast(None))  # sparse: checked, applied, checksums verified
            channel.anyone_needs_anchor(receiver.needs_anchor)
            if step > 2:
                continue
            full = decode(channel.broadcast(None))
            apply(receiver.params, full, receiver.version)  # the full copy, applied and verified the same way
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            channel.anyone_needs_anchor(receiver.needs_anchor)
        if receiver.needs_anchor or receiver.counts["rejected"]:
            raise RuntimeError(f"server diverged: {receiver.last_error}")
        del model, receiver
        if device.type == "cuda":
            torch.cuda.empty_cache()


def inversion_misses(shape: str, device: torch.device, steps: int = 200) -> dict:
    """torch.optim.AdamW stepping the shape's bf16 parameters directly, random gradients, a decaying lr: the
    detector's masks against snapshot diffs."""
    model = build(shape, device.type, torch.bfloat16, "unison")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    misses = extras = changed = 0
    g = torch.Generator(device).manual_seed(0)
    for step in range(1, steps + 1):
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(p.dtype)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        for p, b in zip(params, before, strict=True):
            truth = b.view(torch.int16) != p.detach().view(torch.int16)
            s = opt.state[p]
            found = adamw_inversion_mask(p.detach(), s["exp_avg"], s["exp_avg_sq"], step=step, lr=lr, beta1=0.9,
                                         beta2=0.999, eps=1e-8, weight_decay=0.01)
            misses += int((truth & ~found).sum())
            extras += int((found & ~truth).sum())
            changed += int(truth.sum())
    return {"shape": shape, "steps": steps, "inversion_misses": misses, "inversion_extras": extras,
            "changed": changed}


def worker(rank: int, args, port: int) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    channel = DistChannel(device=device)
    if rank == 0:
        out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "framing": args.framing,
               "workloads": []}

        def save(workloads):
            out["workloads"] = workloads
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=2)

        trainer(args, device, channel, save)
        if args.inversion_steps:
            out["inversion"] = inversion_misses(args.shapes.split(",")[0], device, args.inversion_steps)
            save(out["workloads"])
        print(f"{'workload':22s} {'changed':>8s} {'sparse MiB':>10s} {'full MiB':>9s} {'bytes x':>8s} "
              f"{'sparse ms':>9s} {'full ms':>8s} {'time x':>7s}")
        for w in out["workloads"]:
            print(f"{w['name']:22s} {w['changed_frac_mean']:8.2%} {w['sparse']['bytes'] / 2**20:10.1f} "
                  f"{w['full']['bytes'] / 2**20:9.1f} {w['bytes_ratio']:8.1f} {w['sparse']['s'] * 1e3:9.0f} "
                  f"{w['full']['s'] * 1e3:8.0f} {w['time_ratio']:7.1f}")
        print(out.get("inversion"))
    else:
        server(device, channel)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per workload (>= 2: the first is warm-up)")
    p.add_argument("--inversion-steps", type=int, default=200, help="0: skip the detector")
    p.add_argument("--inversion-only", action="store_true", help="only the detector, in this process")
    p.add_argument("--framing", default="framed", choices=["framed", "bytes"],
                   help="framed: device to device; bytes: safetensors through host memory")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.inversion_only:
        device = torch.device("cuda" if args.device == "cuda" else "cpu")
        result = inversion_misses(args.shapes.split(",")[0], device, args.inversion_steps)
        print(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"inversion": result}, f, indent=2)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
