"""Engine throughput: unison and transformers' continuous batching on the same workloads, in one run.

    python bench/engine.py --device cpu                      # tiny model, quick
    python bench/engine.py --device cuda --suite issue --json bench/results/h200/engine.json

A workload is N concurrent requests of random prompts (random bf16 weights of a named shape, no download),
sampled at T=1 with logprobs to a fixed length (no stop tokens). Reported per workload: generated tokens/s,
ms per decode step, host ms per step (scheduling, inputs, bookkeeping: everything but waiting for the device),
peak GPU memory, and a roofline: the time to read, each decode step, every weight once and the whole live KV
once at the measured copy bandwidth (prefill counted at the measured bf16 matmul rate). Not a test: numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from unison.engine import Engine, EngineConfig, SamplingParams, fused_layer, fused_linear, triton_linear
from unison.engine.lm_head import lm_head_fp32

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, vocab_size=8192),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936),
}

# (shape, concurrency, prompt tokens, new tokens, run transformers' engine too)
SUITES = {
    "issue": [("qwen3-0.6b", 256, 128, 256, True), ("qwen3-4b", 64, 128, 256, True),
              ("qwen3-4b", 256, 128, 256, False), ("qwen3-8b", 64, 128, 256, False),
              ("qwen3-8b", 256, 128, 256, False), ("qwen3-0.6b", 64, 128, 4096, False)],
    "quick": [("qwen3-0.6b", 256, 128, 256, False)],
}


def build(shape: str, device: str, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    untied = ("qwen3-8b", "qwen3-14b", "qwen3-32b")  # as the released checkpoints
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, tie_word_embeddings=shape not in untied)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    return lay_out(model).eval()


def lay_out(model: torch.nn.Module) -> torch.nn.Module:
    """The model with load_policy's layout (q/k/v and gate/up joined: ``pack_projections``), where the unison that
    runs has it (an A/B's older base tree has none)."""
    pack = getattr(fused_linear, "pack_projections", None)
    if pack is not None:
        pack(model)
    return model


def prompts_for(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_unison(model, prompts, new: int, args, attention: str = "auto") -> tuple[dict, list]:
    tokens_per_req = len(prompts[0]) + new
    blocks = len(prompts) * -(-tokens_per_req // args.block_size) + 8
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=args.block_size, seed=0, attention=attention,
                                        max_batch_tokens=args.max_batch_tokens, max_num_seqs=len(prompts),
                                        async_scheduling=not args.no_async))
    # Warm-up at the same concurrency on other prompts of the same lengths: compiles the kernels and captures the
    # decode graphs the run will use, and leaves none of the run's prompts in the prefix cache. (With the run's own
    # prompts the run prefilled an eighth of them, a step no warm-up had compiled: 0.04-0.39 s, run to run, of a
    # 1.1-1.5 s run at 256 requests, bench/results/h200/speed/tma/timeline_*.json.)
    # --warmup full: the whole workload on those prompts, so the run meets no kernel variant or graph the warm-up
    # did not (bench/results/h200/speed/host/7_timeline: a sampler compile and two captures in a 256-request run;
    # bench/results/h200/speed/prefill/2_warmup: the two captures, ~55 ms each, measured against the full warm-up).
    vocab = model.config.vocab_size
    warm = new if args.warmup == "full" else 4
    engine.generate(prompts_for(vocab, len(prompts), len(prompts[0]), seed=1),
                    SamplingParams(max_new_tokens=warm, temperature=1.0, stop_token_ids=()))
    sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = engine.stats()
    t0 = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=()))
    sync(args.device)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    steps = after["steps"] - before["steps"]
    graph_steps = after["graph_steps"] - before["graph_steps"]
    generated = sum(len(c.token_ids) for c in done)
    result = {"tokens_per_s": generated / elapsed, "elapsed_s": elapsed, "generated_tokens": generated,
              "steps": steps, "decode_graph_steps": graph_steps, "ms_per_step": 1e3 * elapsed / steps,
              "host_ms_per_step": 1e3 * (after["host_s"] - before["host_s"]) / steps,
              "peak_gib": peak_gib(args.device), "attention": type(engine.backend).__name__,
              "graphs_captured": after["graphs_captured"],  # the warm-up's too
              "graphs_captured_in_run": after["graphs_captured"] - before["graphs_captured"]}
    result["ms_per_decode_step"] = decode_step_ms(engine, prompts, args) if args.device == "cuda" else None
    return result, done


def decode_step_ms(engine: Engine, prompts, args) -> float:
    """Median wall time of one full decode step (schedule, graph replay, sampling, bookkeeping) of all requests
    at a mid-run context: the requests decode 64 tokens, the last 32 steps are timed one by one."""
    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=64, stop_token_ids=()))
    times = []
    while engine.num_unfinished:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times[-32:])[len(times[-32:]) // 2]


def run_transformers_cb(shape: str, prompts, new: int, args) -> dict:
    model = build(shape, args.device, torch.bfloat16, "sdpa")
    gen = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=-1, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(use_cuda_graph=args.device == "cuda", return_logprobs=True,
                                               max_requests_per_batch=len(prompts))
    warm = prompts_for(model.config.vocab_size, len(prompts), len(prompts[0]), seed=1) \
        if args.warmup == "full" else prompts[:4]
    model.generate_batch(warm, generation_config=GenerationConfig(
        max_new_tokens=new if args.warmup == "full" else 4, do_sample=True, eos_token_id=-1, pad_token_id=0),
        continuous_batching_config=cb)
    sync(args.device)
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    sync(args.device)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.generated_tokens) for o in out.values())
    del model
    return {"tokens_per_s": generated / elapsed, "elapsed_s": elapsed, "generated_tokens": generated,
            "version": transformers.__version__, "attn_implementation": "sdpa", "cuda_graphs": args.device == "cuda"}


@torch.no_grad()
def logprob_agreement(model, done, count: int = 8) -> dict:
    """|engine logprob - teacher-forced logprob| over ``count`` completions; the teacher-forced side is one plain
    forward (transformers' SDPA path) with the same fp32-output projection the trainer uses."""
    diffs = []
    weight = model.get_output_embeddings().weight
    for c in done[:count]:
        ids = torch.tensor([c.prompt_ids + c.token_ids], device=weight.device)
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(c.prompt_ids) - 1:-1]
        logp = torch.log_softmax(lm_head_fp32(hidden, weight), dim=-1)
        ref = logp.gather(1, torch.tensor(c.token_ids, device=ids.device)[:, None]).squeeze(1).cpu()
        diffs.append((ref - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return {"mean_abs_diff": d.mean().item(), "max_abs_diff": d.max().item(), "tokens": d.numel()}


def machine_ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured here."""
    if device != "cuda":
        return {"copy_bytes_per_s": None, "bf16_flops_per_s": None}
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB, several times the L2
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    copy_s = timed(lambda: y.copy_(x), 20)
    mm_s = timed(lambda: a @ b, 20)
    return {"copy_bytes_per_s": 2 * x.numel() / copy_s, "bf16_flops_per_s": 2 * 8192**3 / mm_s}


def roofline(shape: str, concurrency: int, prompt: int, new: int, ceilings: dict) -> float | None:
    """Generated tokens over the least time: each decode step reads every weight once (the lm_head included, the
    embedding table only for its rows) and the whole live KV once; prefill does 2 * params FLOPs per token."""
    if ceilings["copy_bytes_per_s"] is None:
        return None
    s = SHAPES[shape]
    h, layers, kvh, d = s["hidden_size"], s["num_hidden_layers"], s["num_key_value_heads"], s["head_dim"]
    heads, inter, vocab = s["num_attention_heads"], s["intermediate_size"], s["vocab_size"]
    per_layer = h * heads * d * 2 + h * kvh * d * 2 + 3 * h * inter
    params = layers * per_layer + vocab * h
    kv_per_token = 2 * layers * kvh * d * 2  # bytes, bf16
    decode_bytes = sum(2 * params + concurrency * (prompt + t) * kv_per_token for t in range(new))
    seconds = decode_bytes / ceilings["copy_bytes_per_s"] + \
        2 * params * concurrency * prompt / ceilings["bf16_flops_per_s"]
    return concurrency * new / seconds


def commit() -> str | None:
    """The checkout's commit, "+changes" where its unison/ differs from it, and where the unison that ran came from
    when that is not the checkout's (an A/B's base tree, e.g. build/base on PYTHONPATH)."""
    if os.environ.get("UNISON_COMMIT"):  # set by the caller where the checkout has no .git
        return os.environ["UNISON_COMMIT"]
    import unison

    git = (lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip())
    try:
        root, head = git("rev-parse", "--show-toplevel"), git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/unison")
    except (OSError, subprocess.CalledProcessError):
        return None
    ran = os.path.relpath(os.path.dirname(os.path.dirname(os.path.abspath(unison.__file__))), root)
    return head + ("+changes" if changed else "") + ("" if ran == "." else f" (unison from {ran})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--suite", default=None, choices=sorted(SUITES), help="named set of workloads")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--transformers", action="store_true", help="also run transformers' continuous batching")
    p.add_argument("--reference", action="store_true", help="also report the reference path's logprob agreement")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--no-async", action="store_true", help="synchronous decode steps (engine.async_scheduling=false)")
    p.add_argument("--no-fused-projections", action="store_true",
                   help="cuBLAS's projections in the decode graphs (unison.engine.fused_linear off)")
    p.add_argument("--fused-rows", type=int, default=None,
                   help="the most rows the fused projections take (fused_linear.MAX_ROWS; more take cuBLAS's)")
    p.add_argument("--pointer-loads", action="store_true",
                   help="the fused projections' pointer-load kernels where tensor descriptors would run")
    p.add_argument("--no-fused-layers", action="store_true",
                   help="transformers' decoder layers and attention forwards in the engine (unison.engine.fused_layer "
                        "off: separate residual adds, q/k norms, RoPE and K/V write)")
    p.add_argument("--no-pdl", action="store_true",
                   help="the engine's kernels launched one after another (UNISON_PDL=0: no programmatic dependent "
                        "launch, unison.engine.gdc)")
    p.add_argument("--no-split", action="store_true",
                   help="cuBLAS's o_proj and down_proj in the decode graphs (fused_linear.SPLIT_ROWS = 0)")
    p.add_argument("--warmup", default="full", choices=["short", "full"],
                   help="full: the whole workload, on other prompts (both systems); short: 4 new tokens a request, "
                        "which leaves the decode graphs of the run's batch sizes to be captured inside it")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    if args.no_pdl:
        os.environ["UNISON_PDL"] = "0"
    if args.no_split:
        fused_linear.SPLIT_ROWS = 0
    if args.fused_rows is not None:
        fused_linear.MAX_ROWS = args.fused_rows
    if args.no_fused_projections:
        fused_linear.MAX_ROWS = 0
    if args.pointer_loads:
        triton_linear.loads_for = lambda *args: "pointer"
    if args.no_fused_layers:
        fused_layer.DEVICES = set()
    workloads = SUITES[args.suite] if args.suite else [
        (args.shape, args.concurrency, args.prompt, args.new, args.transformers)]
    ceilings = machine_ceilings(args.device)
    results = []
    for shape, conc, prompt, new, with_hf in workloads:
        name = f"{shape}/{conc}x({prompt}+{new})"
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = build(shape, args.device, dtype, "unison")
        prompts = prompts_for(model.config.vocab_size, conc, prompt)
        entry = {"name": name, "roofline_tokens_per_s": roofline(shape, conc, prompt, new, ceilings)}
        entry["unison"], done = run_unison(model, prompts, new, args)
        if len(results) == 0 and args.device == "cuda":
            entry["logprob_agreement"] = {"fast": logprob_agreement(model, done)}
            if args.reference:
                few = prompts[:8]
                _, ref_done = run_unison(model, few, new, args, attention="torch")
                _, fast_done = run_unison(model, few, new, args)
                entry["logprob_agreement"] = {"fast": logprob_agreement(model, fast_done),
                                              "reference": logprob_agreement(model, ref_done)}
        del model, done
        if args.device == "cuda":
            torch.cuda.empty_cache()
        entry["transformers_cb"] = run_transformers_cb(shape, prompts, new, args) if with_hf else {
            "not_run": "device-time budget: transformers' engine runs ~20x longer than unison's; compared on the "
                       "0.6B/256 and 4B/64 workloads only"}
        results.append(entry)
        u, hf = entry["unison"], entry["transformers_cb"].get("tokens_per_s")
        print(f"{name}: unison {u['tokens_per_s']:.0f} tok/s ({u['ms_per_decode_step'] or 0:.2f} ms/decode step, "
              f"host {u['host_ms_per_step']:.2f} ms/step, peak {u['peak_gib']:.1f} GiB)"
              + (f", transformers {hf:.0f} tok/s" if hf else "")
              + f", roofline {entry['roofline_tokens_per_s'] or 0:.0f}", flush=True)
        if args.json:  # after every workload, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           "torch": torch.__version__, "commit": commit(), "ceilings": ceilings,
                           "config": {"block_size": args.block_size, "max_batch_tokens": args.max_batch_tokens,
                                      "async_scheduling": not args.no_async, "warmup": args.warmup,
                                      "fused_projections": not args.no_fused_projections,
                                      "fused_layers": not args.no_fused_layers,
                                      "sampling": "T=1, logprobs, no stop tokens, random bf16 weights"},
                           "workloads": results}, f, indent=2)
    print(f"{'workload':32s} {'unison tok/s':>12s} {'ms/decode':>9s} {'hf tok/s':>9s} {'roofline':>9s}")
    for e in results:
        hf = e["transformers_cb"].get("tokens_per_s", float("nan"))
        print(f"{e['name']:32s} {e['unison']['tokens_per_s']:12.0f} {e['unison']['ms_per_decode_step'] or 0:9.2f} "
              f"{hf:9.0f} {e['roofline_tokens_per_s'] or 0:9.0f}")


if __name__ == "__main__":
    main()
