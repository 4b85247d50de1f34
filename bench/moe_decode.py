"""Where MoE decode time goes: a Qwen3-MoE shape against a dense Qwen3 of the same active parameters, in one run.

    python bench/moe_decode.py --device cpu --shape tiny                 # quick, checks the script
    python bench/moe_decode.py --device cuda --json bench/results/h200/moe_decode/moe_decode.json
    python bench/moe_decode.py --device cuda --shape gptoss-12l --models moe,moe_transformers   # GptOss's experts

Random bf16 weights, no download. For each model and concurrency: the engine's decode tok/s (prompt 128, 128 new
tokens, T=1, no stop tokens), decode steps against graph steps, and the phases of a decode step; then decode steps
under torch.profiler, through the CUDA graphs and eagerly (``cuda_graphs=False``, where the MoE block's host syncs
would show), with the top kernels and CPU ops by self time and the count of each host-sync op per step. Last,
one MoE layer's experts alone at the decode shapes (transformers' ``grouped_mm`` path, its two grouped GEMMs
alone, a fixed-capacity ``bmm`` over every expert, and unison's Triton experts with their routing alignment alone),
each replayed as a CUDA graph, against reading the weights of the experts the router hit once. Diagnostics:
numbers, not a test.

The engine rows run with ``EngineConfig.moe_kernel`` from ``--moe-kernel`` (unison's Triton experts by default);
the "moe_transformers" run is the same model on transformers' experts path, so one run shows both.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.nn.functional as F
from engine import commit, machine_ceilings, prompts_for, sync
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3Config, Qwen3MoeConfig

from unison.engine import Engine, EngineConfig, SamplingParams, fused_norm, fused_rope, moe, triton_moe

# 16 layers of Qwen3-30B-A3B's layer shape: 10.6B parameters (untied head), 0.9B active per token.
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    # 8 of those layers (5.3B parameters): trains with fp32 AdamW masters on one H200 (bench/grpo_step.py).
    "qwen3moe-8l": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                        head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768),
    "qwen3moe-16l": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768),
    # GptOss (its experts transposed, interleaved, biased, clamped SwiGLU; attention sinks; window 128 on every
    # other layer): 12 of GptOss-20B's 24 layers, 32 experts, top-4 (10.7B parameters, 1.9B active per token).
    "gptoss-12l": dict(family="gpt_oss", hidden_size=2880, num_hidden_layers=12, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=64, vocab_size=201088, num_experts=32, num_experts_per_tok=4,
                       moe_intermediate_size=2880, sliding_window=128),
    "gptoss-tiny": dict(family="gpt_oss", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=6, num_experts_per_tok=2,
                        moe_intermediate_size=32, sliding_window=16),
}
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
            "aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::bincount", "cudaMemcpyAsync",
            "cudaGraphLaunch")


def build(kind: str, shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """kind "moe": Qwen3-MoE (or GptOss: the shape's family); "dense": Qwen3 with intermediate = top_k *
    moe_intermediate (same active params)."""
    s = dict(SHAPES[shape])
    experts, top_k, moe_inter = s.pop("num_experts"), s.pop("num_experts_per_tok"), s.pop("moe_intermediate_size")
    family, window = s.pop("family", "qwen3_moe"), s.pop("sliding_window", None)
    common = dict(s, max_position_embeddings=40960, tie_word_embeddings=False)
    if kind == "moe" and family == "gpt_oss":  # its own yarn RoPE and position limit, sinks, alternating window
        cfg = GptOssConfig(**s, tie_word_embeddings=False, num_local_experts=experts, num_experts_per_tok=top_k,
                           intermediate_size=moe_inter, sliding_window=window)
    elif kind == "moe":
        cfg = Qwen3MoeConfig(**common, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                             moe_intermediate_size=moe_inter, intermediate_size=top_k * moe_inter)
    else:
        cfg = Qwen3Config(**common, intermediate_size=top_k * moe_inter)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="unison", dtype=dtype)
    return model.eval()


@contextmanager
def moe_classes_fused(on: bool):
    """What-if (run "moe_fused"): the engine's one-kernel RMSNorm and RoPE also cover Qwen3-MoE's classes, whose
    math is Qwen3's; unison's lists name the dense classes only."""
    added = ({"Qwen3MoeRMSNorm"} - fused_norm.NORM_CLASSES, {"Qwen3MoeAttention"} - fused_rope.ATTENTION_CLASSES)
    if on:
        fused_norm.NORM_CLASSES.update(added[0])
        fused_rope.ATTENTION_CLASSES.update(added[1])
    try:
        yield
    finally:
        fused_norm.NORM_CLASSES.difference_update(added[0])
        fused_rope.ATTENTION_CLASSES.difference_update(added[1])


def wait_prefilled(engine: Engine) -> None:
    """Step until every submitted request has its first token: the steps after are decode-only."""
    while any(not r.output for r in engine._requests.values()):
        engine.step()


def run_engine(model, prompts, new: int, device: str, **engine_kw) -> tuple[dict, Engine]:
    """``engine_kw``: further EngineConfig fields (moe_kernel)."""
    blocks = len(prompts) * -(-(len(prompts[0]) + new + 64) // 16) + 8
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=16, seed=0, max_batch_tokens=8192,
                                        max_num_seqs=len(prompts), **engine_kw))
    engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=()))  # kernels and graphs
    sync(device)
    before, t0 = engine.stats(), time.perf_counter()
    done = engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=()))
    sync(device)
    elapsed, after = time.perf_counter() - t0, engine.stats()
    generated = sum(len(c.token_ids) for c in done)
    result = {"tokens_per_s": generated / elapsed, "elapsed_s": elapsed, "generated_tokens": generated,
              "steps": after["steps"] - before["steps"],
              "graph_steps": after["graph_steps"] - before["graph_steps"],
              "graphs_captured": after["graphs_captured"]}
    # Decode alone: the phases of 8 decode-only steps, each synchronised, then 16 steps unprofiled.
    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=40, stop_token_ids=()))
    wait_prefilled(engine)
    phases = engine.profile_phases()
    for _ in range(8):
        engine.step()
    engine.profile_phases(False)
    result["decode_phase_ms"] = {k: 1e3 * v / 8 for k, v in phases.items()}
    sync(device)
    t0 = time.perf_counter()
    for _ in range(16):
        engine.step()
    sync(device)
    result["ms_per_decode_step"] = 1e3 * (time.perf_counter() - t0) / 16
    result["decode_tokens_per_s"] = len(prompts) / result["ms_per_decode_step"] * 1e3
    while engine.num_unfinished:
        engine.step()
    return result, engine


def profile_decode(engine: Engine, prompts, device: str, steps: int = 4, stack: bool = False) -> dict:
    """Top kernels and CPU ops by self time, and host-sync ops per step, over ``steps`` decode-only steps; with
    ``stack``, the Python frames that called each host-sync op."""
    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=steps + 4, stop_token_ids=()))
    wait_prefilled(engine)
    engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities, with_stack=stack) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    while engine.num_unfinished:
        engine.step()
    events = prof.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]

    def row(e, attr):
        return {"name": e.key[:120], "self_us_per_step": getattr(e, attr) / steps, "calls_per_step": e.count / steps}

    kernel_us = sum(e.self_device_time_total for e in cuda) / steps
    callers = sync_callers(prof, steps) if stack else None
    return {
        "steps": steps, "profiled_wall_ms_per_step": wall_ms, "kernel_ms_per_step": kernel_us / 1e3,
        "kernels_per_step": sum(e.count for e in cuda) / steps,
        "top_kernels": [row(e, "self_device_time_total")
                        for e in sorted(cuda, key=lambda e: -e.self_device_time_total)[:20]],
        "top_cpu_ops": [row(e, "self_cpu_time_total")
                        for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:20]],
        "sync_ops_per_step": {name: sum(e.count for e in cpu if e.key == name) / steps for name in SYNC_OPS},
        "sync_callers": callers,
    }


def sync_callers(prof, steps: int) -> list[dict]:
    """Each host-sync op's Python call site (the innermost frames outside torch), with its calls per step."""
    sites: dict[tuple, int] = {}
    for e in prof.events():
        if e.name not in SYNC_OPS or e.name == "cudaGraphLaunch":
            continue
        frames, p = [], e.cpu_parent
        while p is not None and len(frames) < 4:
            if ".py(" in p.name and "torch/" not in p.name:
                frames.append(p.name)
            p = p.cpu_parent
        sites[(e.name, *frames)] = sites.get((e.name, *frames), 0) + 1
    return [{"op": k[0], "frames": list(k[1:]), "calls_per_step": n / steps}
            for k, n in sorted(sites.items(), key=lambda kv: -kv[1])[:12]]


def routing_stats(model, engine: Engine, prompts) -> dict:
    """Distinct experts the router picks per layer in one decode step of len(prompts) requests."""
    picks = []
    hooks = [router(layer.mlp).register_forward_hook(lambda m, i, out: picks.append(out[2].detach().clone()))
             for layer in model.model.layers]
    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=3, stop_token_ids=()))
    wait_prefilled(engine)
    picks.clear()
    engine.step()  # eager or a first capture: the hooks run at capture, a replay would not call them
    for h in hooks:
        h.remove()
    while engine.num_unfinished:
        engine.step()
    distinct = [int(p.unique().numel()) for p in picks if p.shape[0] == len(prompts)]
    counts = [torch.bincount(p.flatten(), minlength=model.model.layers[0].mlp.experts.num_experts) for p in picks
              if p.shape[0] == len(prompts)]
    return {"distinct_experts_per_layer": sum(distinct) / max(len(distinct), 1),
            "max_tokens_per_expert": max((int(c.max()) for c in counts), default=0), "layers_seen": len(distinct)}


def router(mlp: torch.nn.Module) -> torch.nn.Module:
    """The MoE block's router, returning (logits, top-k weights, top-k experts): Qwen3-MoE's ``gate``, GptOss's
    ``router``."""
    return mlp.gate if hasattr(mlp, "gate") else mlp.router


def experts_weights(ex: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, H, 2I) and (E, I, H) views of the experts' weights, as transformers passes them to grouped_mm."""
    if ex.is_transposed:
        return ex.gate_up_proj, ex.down_proj
    return ex.gate_up_proj.transpose(-2, -1), ex.down_proj.transpose(-2, -1)


def timed_ms(fn, device: str, reps: int = 20) -> dict:
    """Per-call ms of ``fn``: replayed as a CUDA graph on CUDA (eager if capture fails, with the reason)."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return {"ms": 1e3 * (time.perf_counter() - t0) / reps, "graph": False}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph, reason = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError as e:  # a host sync inside fn
        reason, run = str(e)[:200], fn
        torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(end) / reps, "graph": reason is None, "capture_error": reason}


@torch.inference_mode()
def experts_microbench(moe_model, dense_model, tokens: int, device: str, copy_bw: float | None) -> dict:
    """One layer's experts at a decode step of ``tokens`` rows, routed by layer 0's router."""
    mlp, dense_mlp = moe_model.model.layers[0].mlp, dense_model.model.layers[0].mlp
    ex = mlp.experts
    w_up, w_down = experts_weights(ex)
    e, h, inter = w_up.shape[0], w_up.shape[1], w_down.shape[1]
    x = torch.randn(tokens, h, device=device, dtype=ex.gate_up_proj.dtype)
    _, weights, idx = router(mlp)(x)
    k = idx.shape[1]
    counts = torch.bincount(idx.flatten(), minlength=e)
    hit = int((counts > 0).sum())
    ids_sorted, perm = torch.sort(idx.flatten())
    xs = x[perm // k]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w_up_rows = w_up.contiguous()  # the same weights laid out (E, H, 2I) row-major: does the layout matter?
    mid = torch.randn(tokens * k, inter, device=device, dtype=x.dtype)
    cap = -(-int(counts.max()) // 8) * 8  # fixed capacity: the host reads it once here, never per step
    xe = torch.randn(e, cap, h, device=device, dtype=x.dtype)
    me = torch.randn(e, cap, inter, device=device, dtype=x.dtype)

    def every_expert():  # exact and sync-free: every token through every expert, unrouted pairs weighted 0
        dense_w = torch.zeros(tokens, e, device=device, dtype=torch.float32).scatter_(1, idx, weights.float())
        gate_up = torch.matmul(x, w_up)  # (E, T, 2I)
        if ex.has_bias:
            gate_up = gate_up + ex.gate_up_proj_bias[:, None]
            out = torch.bmm(ex._apply_gate(gate_up), w_down) + ex.down_proj_bias[:, None]
            return (out * dense_w.T[..., None].to(x.dtype)).sum(0)
        return torch.bmm(ex._apply_gate(gate_up) * dense_w.T[..., None].to(x.dtype), w_down).sum(0)

    reference = ex(x, idx, weights)
    sizes = triton_moe.block_sizes(tokens * k, e, x.dtype)

    def unison_experts():
        return moe.kernels_forward(ex, x, idx, weights, sizes)
    expert_bytes = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * x.element_size()
    dense_bytes = sum(p.numel() for p in dense_mlp.parameters()) * x.element_size()
    out = {
        "tokens": tokens, "top_k": k, "experts": e, "distinct_experts_hit": hit, "max_tokens_per_expert":
            int(counts.max()), "capacity": cap, "experts_mib_hit": hit * expert_bytes / 2**20,
        "transformers_grouped_mm_forward": timed_ms(lambda: ex(x, idx, weights), device),
        "router_plus_experts": timed_ms(lambda: mlp(x[None]), device),
        "grouped_mm_up_only": timed_ms(lambda: F.grouped_mm(xs, w_up, offs=offs), device),
        "grouped_mm_down_only": timed_ms(lambda: F.grouped_mm(mid, w_down, offs=offs), device),
        "grouped_mm_up_only_row_major_b": timed_ms(lambda: F.grouped_mm(xs, w_up_rows, offs=offs), device),
        "bmm_fixed_capacity_up_down": timed_ms(lambda: (torch.bmm(xe, w_up), torch.bmm(me, w_down)), device),
        "every_expert_bmm": timed_ms(every_expert, device),
        "every_expert_max_abs_diff": float((every_expert() - reference).abs().max()),
        "reference_max_abs": float(reference.abs().max()),
        "dense_mlp_same_active": timed_ms(lambda: dense_mlp(x), device),
        "unison_block_sizes": asdict(sizes),
    }
    if device == "cuda" or triton_moe._INTERPRET:  # the CPU: only in Triton's interpreter (TRITON_INTERPRET=1)
        out["unison_triton_experts"] = timed_ms(unison_experts, device, reps=20 if device == "cuda" else 1)
        out["unison_align_only"] = timed_ms(lambda: triton_moe.align(idx, e, sizes.block_m), device)
        out["unison_max_abs_diff"] = float((unison_experts().float() - reference.float()).abs().max())
    if copy_bw:
        out["ideal_ms_hit_experts"] = 1e3 * hit * expert_bytes / copy_bw
        out["ideal_ms_dense_mlp"] = 1e3 * dense_bytes / copy_bw
        for row in ("transformers_grouped_mm_forward", "unison_triton_experts"):
            if row in out:
                out[f"{row}_fraction_of_copy_bw"] = out["ideal_ms_hit_experts"] / out[row]["ms"]
    return out


@torch.inference_mode()
def experts_prefill(moe_model, tokens: int, device: str) -> dict:
    """One layer's experts at a prefill chunk of ``tokens`` rows: transformers' grouped_mm against unison's kernels
    (compute-bound here, where the decode rows are memory-bound)."""
    mlp = moe_model.model.layers[0].mlp
    ex = mlp.experts
    w_up, w_down = experts_weights(ex)
    x = torch.randn(tokens, w_up.shape[1], device=device, dtype=ex.gate_up_proj.dtype)
    _, weights, idx = router(mlp)(x)
    reference = ex(x, idx, weights)
    flops = 2 * 3 * idx.numel() * w_up.shape[1] * w_down.shape[1]
    sizes = triton_moe.block_sizes(idx.numel(), w_up.shape[0], x.dtype)
    ours = timed_ms(lambda: moe.kernels_forward(ex, x, idx, weights, sizes), device)
    theirs = timed_ms(lambda: ex(x, idx, weights), device)
    diff = moe.kernels_forward(ex, x, idx, weights, sizes).float() - reference.float()
    return {"tokens": tokens, "unison_block_sizes": asdict(sizes), "transformers_grouped_mm_forward": theirs,
            "unison_triton_experts": ours, "unison_max_abs_diff": float(diff.abs().max()),
            "transformers_tflops": flops / theirs["ms"] / 1e9, "unison_tflops": flops / ours["ms"] / 1e9}


def roofline(model, concurrency: int, context: int, hit_fraction: float, bw: float) -> dict:
    """Decode tok/s if a step read, once each: the non-expert weights (lm_head, attention, norms, routers; the
    embedding only for its rows), the experts the router hit, and the live KV at ``context`` tokens."""
    cfg = model.config
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    other = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and "embed_tokens" not in n)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * concurrency * context
    step_bytes = 2 * (other + hit_fraction * expert_params) + kv
    return {"bytes_per_step_gb": step_bytes / 1e9, "step_ms": 1e3 * step_bytes / bw,
            "tokens_per_s": concurrency * bw / step_bytes}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="qwen3moe-16l", choices=sorted(SHAPES))
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--models", default="moe,moe_transformers,dense",
                   help="moe, dense, moe_transformers (moe on transformers' experts path, whatever --moe-kernel), "
                        "moe_fused (moe with RMSNorm/RoPE fused as for the dense classes)")
    p.add_argument("--moe-kernel", default="triton", choices=["triton", "transformers"],
                   help="EngineConfig.moe_kernel of the engine runs (transformers: the rows before unison's kernels)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    ceilings = machine_ceilings(args.device)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "commit": commit(), "ceilings": ceilings,
              "shape": SHAPES[args.shape], "prompt": args.prompt, "new": args.new, "runs": {}}
    models = {kind: build(kind, args.shape, args.device, dtype) for kind in ("moe", "dense")}
    for kind, model in models.items():
        report[f"{kind}_params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    report["experts_implementation"] = models["moe"].config._experts_implementation
    report["moe_kernel"] = args.moe_kernel
    report["experts_modules_on_kernels"] = len(moe.kernel_modules(models["moe"]))  # with moe_kernel=triton, on CUDA

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    for conc in [int(c) for c in args.concurrency.split(",")]:
        prompts = prompts_for(SHAPES[args.shape]["vocab_size"], conc, args.prompt)
        for kind in args.models.split(","):
            name, model = f"{kind}/{conc}", models[kind.split("_")[0]]
            moe_kernel = "transformers" if kind == "moe_transformers" else args.moe_kernel
            try:
                with moe_classes_fused(kind == "moe_fused"):
                    entry, engine = run_engine(model, prompts, args.new, args.device, moe_kernel=moe_kernel)
                    entry["profile_graphs"] = profile_decode(engine, prompts, args.device)
            except Exception as e:  # a what-if that fails is a result too; the other runs go on
                report["runs"][name] = {"error": repr(e)[:500]}
                print(f"{name}: failed: {e!r}"[:300], flush=True)
                continue
            if kind == "moe":
                eager = Engine(model, EngineConfig(num_blocks=conc * 20 + 8, max_batch_tokens=8192,
                                                   max_num_seqs=conc, cuda_graphs=False, moe_kernel=moe_kernel))
                entry["profile_eager"] = profile_decode(eager, prompts, args.device, steps=2, stack=True)
                entry["routing"] = routing_stats(model, eager, prompts)
                entry["experts_layer"] = experts_microbench(models["moe"], models["dense"], conc, args.device,
                                                            ceilings["copy_bytes_per_s"])
                if args.device == "cuda" and "experts_prefill" not in report:
                    report["experts_prefill"] = [experts_prefill(models["moe"], t, args.device) for t in (2048, 8192)]
                del eager
            bw = ceilings["copy_bytes_per_s"]
            experts, top_k = SHAPES[args.shape]["num_experts"], SHAPES[args.shape]["num_experts_per_tok"]
            hit = 1.0 if kind == "dense" else 1 - (1 - top_k / experts) ** conc  # uniform routing: measured 125.9
            if bw:
                ctx = args.prompt + args.new // 2
                entry["roofline_measured_bw"] = roofline(model, conc, ctx, hit, bw)
                entry["roofline_4.8TBps"] = roofline(model, conc, ctx, hit, 4.8e12)
            report["runs"][name] = entry
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
            g = entry["profile_graphs"]
            print(f"{name}: {entry['tokens_per_s']:.0f} tok/s, decode {entry['ms_per_decode_step']:.2f} ms/step "
                  f"({entry['decode_tokens_per_s']:.0f} tok/s), graph {entry['graph_steps']}/{entry['steps']} steps, "
                  f"kernels {g['kernel_ms_per_step']:.2f} ms/step in {g['kernels_per_step']:.0f} launches", flush=True)
            save()
    print(f"{'run':20s} {'tok/s':>8s} {'decode tok/s':>12s} {'ms/step':>8s} {'kern ms':>8s} {'graph/steps':>11s} "
          f"{'roofline':>9s}")
    for name, e in report["runs"].items():
        if "error" in e:
            continue
        r = e.get("roofline_measured_bw", {}).get("tokens_per_s", 0)
        print(f"{name:20s} {e['tokens_per_s']:8.0f} {e['decode_tokens_per_s']:12.0f} {e['ms_per_decode_step']:8.2f} "
              f"{e['profile_graphs']['kernel_ms_per_step']:8.2f} {e['graph_steps']:>5d}/{e['steps']:<5d} {r:9.0f}")
    for name, e in report["runs"].items():
        if "experts_layer" in e:
            x = e["experts_layer"]
            hf = x["transformers_grouped_mm_forward"]
            print(f"{name} experts layer: hit {x['distinct_experts_hit']}/{x['experts']}, hf grouped_mm "
                  f"{hf['ms']:.3f} ms (graph {hf['graph']}),"
                  f" gmm up {x['grouped_mm_up_only']['ms']:.3f} down {x['grouped_mm_down_only']['ms']:.3f}, bmm cap"
                  f" {x['capacity']} {x['bmm_fixed_capacity_up_down']['ms']:.3f}, every expert "
                  f"{x['every_expert_bmm']['ms']:.3f} (diff {x['every_expert_max_abs_diff']:.2g}), dense mlp "
                  f"{x['dense_mlp_same_active']['ms']:.3f}, ideal {x.get('ideal_ms_hit_experts', 0):.3f} ms")
            if "unison_triton_experts" in x:
                u = x["unison_triton_experts"]
                print(f"{name} unison triton experts {u['ms']:.3f} ms (graph {u['graph']}, diff "
                      f"{x['unison_max_abs_diff']:.2g}, {x.get('unison_triton_experts_fraction_of_copy_bw', 0):.0%} "
                      f"of copy bw), align alone {x['unison_align_only']['ms']:.3f} ms")
    for x in report.get("experts_prefill", []):
        hf = x["transformers_grouped_mm_forward"]
        print(f"experts layer at prefill {x['tokens']} tokens: hf grouped_mm {hf['ms']:.3f} ms "
              f"({x['transformers_tflops']:.0f} TFLOP/s), unison {x['unison_triton_experts']['ms']:.3f} ms "
              f"({x['unison_tflops']:.0f} TFLOP/s), diff {x['unison_max_abs_diff']:.2g}")


if __name__ == "__main__":
    main()
