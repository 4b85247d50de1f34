"""How many kernels one packed row's training forward and backward launches: PyTorch operators that run a kernel
(views and allocations left out) and Triton launches, counted as they are dispatched. On the GPU each is a launch
the host pays for; on the CPU the same code path runs its Triton kernels in Triton's interpreter, so the counts are
the GPU's without a GPU.

    python bench/train_launches.py --json bench/results/cpu/train_launches.json      # CPU, the interpreter
    python bench/train_launches.py --device cuda --width 1024 --vocab 151936 --chunk 1024 --prompt 64 --completion 512
                                                          # GPU: counts, and the host's ms to launch a row

The model has the Qwen3-0.6B shape's structure (28 layers, q/k norms, GQA, SwiGLU) at a small width (``--width``);
the row is 8 samples of ``--prompt`` + ``--completion`` tokens, the lm_head in chunks of ``--chunk`` loss tokens, the
GRPO loss (dapo). On the CPU the attention counts as one kernel each way, as on the GPU (its CPU path is PyTorch
operators, one sample at a time). Counts grow with the layers, the rows and the chunks, not with the width.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time

if "--device" not in sys.argv or "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen3Config

sys.path.append(os.path.join(os.path.dirname(__file__), ".."))  # after PYTHONPATH: an A/B's base tree goes first
from engine import commit, lay_out  # noqa: E402

from unison.rollout.sample import Sample  # noqa: E402
from unison.train.logprobs import policy_loss  # noqa: E402
from unison.train.loss import LossConfig, token_loss  # noqa: E402
from unison.train.packing import pack_samples  # noqa: E402

aten = torch.ops.aten
NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.detach,
             aten.lift_fresh, aten.alias, aten._local_scalar_dense, aten.is_same_size, aten.set_, aten._unsafe_view,
             aten.promote_types}


class Launches(TorchDispatchMode):
    """Counts the operators dispatched under it that launch a kernel, and (``triton``) the Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.triton = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (not self.paused and isinstance(func, torch._ops.OpOverload) and not func.is_view
                and func.overloadpacket not in NO_KERNEL):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_triton(mode: Launches):
    """Counts every Triton launch into ``mode``; the interpreter's own tensor copies are not the kernel's launches."""
    classes = [triton.runtime.jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            mode.triton += 1
            paused, mode.paused = mode.paused, True
            try:
                return _original(self, *args, **kwargs)
            finally:
                mode.paused = paused
        cls.run = run


def one_attention_kernel(mode: Launches) -> None:
    """The packed row's attention counted as one kernel each way: on the GPU cuDNN's or flash's (cuDNN's run no
    PyTorch operator to count), on the CPU one sample at a time in PyTorch operators."""
    from unison.engine import attention

    inner = attention.varlen_causal

    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, *rest):
            mode.ops["attention"] += 1
            paused, mode.paused = mode.paused, True
            try:
                with torch.enable_grad():
                    qkv = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
                    out = inner(*qkv, *rest)
            finally:
                mode.paused = paused
            ctx.saved, ctx.rest = (qkv, out), len(rest)
            return out.detach()

        @staticmethod
        def backward(ctx, grad):
            mode.ops["attention_backward"] += 1
            (qkv, out), ctx.saved = ctx.saved, None
            paused, mode.paused = mode.paused, True
            try:
                grads = torch.autograd.grad(out, [t for t in qkv if t.requires_grad], grad, allow_unused=True)
            finally:
                mode.paused = paused
            it = iter(grads)
            return (*[next(it) if t.requires_grad else None for t in qkv], *([None] * ctx.rest))

    def varlen_causal(q, k, v, cu_seqlens, max_len, scale, window=None, sinks=None, softcap=None):
        return Counted.apply(q, k, v, cu_seqlens, max_len, scale, window, sinks, softcap)

    attention.varlen_causal = varlen_causal


def build(width: int, vocab: int, device: str) -> torch.nn.Module:
    """At width 1024 and vocabulary 151936, the Qwen3-0.6B shape itself (16 query and 8 KV heads of 128)."""
    heads = max(2, width // 64)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=28,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=128 if width >= 512 else 16,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="unison", dtype=dtype).eval()
    return lay_out(model)


def row_of(vocab: int, device: str, prompt: int, completion: int):
    g = torch.Generator().manual_seed(0)
    samples = [Sample(tuple(torch.randint(10, vocab, (prompt,), generator=g).tolist()),
                      tuple(torch.randint(10, vocab, (completion,), generator=g).tolist()),
                      tuple((-torch.rand(completion, generator=g)).tolist()), (0,) * completion, 1.0,
                      float(i % 3 - 1)) for i in range(8)]
    (row,) = pack_samples(samples, 1024, 0)
    return row.to(device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--completion", type=int, default=16)
    p.add_argument("--json")
    args = p.parse_args()
    model = build(args.width, args.vocab, args.device)
    row = row_of(model.config.vocab_size, args.device, args.prompt, args.completion)
    at = row.loss_positions
    engine, advantages = row.engine_logprobs.index_select(0, at), row.advantages.index_select(0, at)

    def step(mode: Launches | None = None):
        model.zero_grad(set_to_none=True)
        share = token_loss(engine, advantages, LossConfig(), at.numel())
        with mode or contextlib.nullcontext():
            loss, _, _ = policy_loss(model, row, share, chunk_size=args.chunk, with_entropy=True, kernels=True)
        forward = (sum(mode.ops.values()), mode.triton) if mode else None
        with mode or contextlib.nullcontext():
            loss.backward()
        return forward

    host = wall = None
    if args.device == "cuda":  # timed before the counting wraps anything
        step()  # compiles
        issued, done = [], []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            issued.append(time.perf_counter() - t0)  # the host's time to launch the row (it does not wait on the GPU)
            torch.cuda.synchronize()
            done.append(time.perf_counter() - t0)
        host, wall = (round(sorted(t)[len(t) // 2] * 1e3, 2) for t in (issued, done))
    mode = Launches()
    count_triton(mode)
    one_attention_kernel(mode)
    forward_ops, forward_triton = step(mode)
    total_ops = sum(mode.ops.values())
    chunks = -(-at.numel() // args.chunk)
    out = {"commit": commit(), "device": args.device, "width": args.width, "layers": model.config.num_hidden_layers,
           "row_tokens": row.num_tokens, "loss_tokens": at.numel(), "chunks": chunks,
           "forward": {"torch_ops": forward_ops, "triton": forward_triton},
           "backward": {"torch_ops": total_ops - forward_ops, "triton": mode.triton - forward_triton},
           "total_launches": total_ops + mode.triton, "host_ms_per_row": host, "wall_ms_per_row": wall,
           "top_ops": dict(mode.ops.most_common(20))}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
