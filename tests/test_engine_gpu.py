"""Engine correctness on a CUDA GPU (run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.engine.fused_norm import fused_norms
from unison.engine.fused_rope import fused_rope

pytestmark = pytest.mark.gpu


def gpu_qwen3(dtype):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=2)
    with torch.device("cuda"):
        return Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=dtype).eval()


def logprob_diffs(model, done, **sampling) -> torch.Tensor:
    return torch.cat([(teacher_forced_logprobs(model, c.prompt_ids, c.token_ids, **sampling)
                       - torch.tensor(c.logprobs)).abs() for c in done])


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_fp32_logprobs_and_greedy_on_gpu(attention):
    model = gpu_qwen3(torch.float32)
    engine = Engine(model, EngineConfig(num_blocks=512, block_size=16, max_batch_tokens=256, seed=0,
                                        attention=attention))
    done = engine.generate(random_prompts([7, 33, 100, 250], vocab=4096),
                           SamplingParams(max_new_tokens=40, n=4, stop_token_ids=()))
    assert logprob_diffs(model, done).max() < 1e-3
    prompt = random_prompts([50], vocab=4096, seed=1)[0]
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=()))[0]
    ref = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=30,
                         min_new_tokens=30, pad_token_id=0)
    assert greedy.token_ids == ref[0, len(prompt):].tolist()


def test_bf16_logprobs_at_noise_floor_with_preemption():
    """bf16 engine vs a teacher-forced bf16 forward: the fast path (Triton decode, varlen chunks, CUDA graphs) is
    no worse than the reference path."""
    model = gpu_qwen3(torch.bfloat16)
    means = {}
    for attention in ("torch", "triton"):
        engine = Engine(model, EngineConfig(num_blocks=40, block_size=16, max_batch_tokens=128, seed=0,
                                            attention=attention))
        done = engine.generate(random_prompts([20, 64, 130, 5, 77, 9], vocab=4096),
                               SamplingParams(max_new_tokens=120, n=2, stop_token_ids=()))
        diff = logprob_diffs(model, done)
        stats = engine.stats()
        print(f"{attention}: bf16 engine vs teacher-forced |dlogp|: mean {diff.mean():.2e} max {diff.max():.2e} "
              f"over {diff.numel()} tokens, {stats['num_preemptions']} preemptions, "
              f"{stats['graph_steps']} graph steps")
        assert stats["num_preemptions"] > 0
        assert diff.mean() < 2e-2 and diff.max() < 0.5
        means[attention] = diff.mean().item()
    assert means["triton"] < 1.25 * means["torch"]


def test_moe_decode_graphs_with_fused_norms_and_rope_at_the_bf16_floor():
    """Qwen3-MoE through the graph decode path, whose norms and RoPE run fused (the same math as Qwen3's): bf16
    logprobs against a teacher-forced forward no worse than the reference path's, with the fused kernels switched
    in and the decode steps replayed as graphs (the experts' grouped_mm is sync-free)."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=128, max_position_embeddings=2048, eos_token_id=2)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).eval()
    with fused_norms(model) as norms, fused_rope(model) as ropes:
        assert norms > 0 and ropes > 0
    means = {}
    for attention in ("torch", "triton"):
        engine = Engine(model, EngineConfig(num_blocks=256, block_size=16, max_batch_tokens=256, seed=0,
                                            attention=attention))
        done = engine.generate(random_prompts([7, 33, 100], vocab=4096),
                               SamplingParams(max_new_tokens=60, n=2, stop_token_ids=()))
        diff = logprob_diffs(model, done)
        print(f"MoE {attention}: mean {diff.mean():.2e} max {diff.max():.2e}, {engine.stats()['graph_steps']} graphs")
        assert diff.mean() < 2e-2 and diff.max() < 0.5
        means[attention] = diff.mean().item()
    assert engine.stats()["graph_steps"] > 0
    assert means["triton"] < 1.25 * means["torch"]


def test_no_collection_runs_inside_a_decode_graph_capture():
    """Python's collector never runs while a decode graph captures, even set to run on almost every allocation: a
    finalizer run by a collection inside a capture can invalidate it (Triton's CompiledKernel.__del__ unloads its
    CUDA module). Without ``graphs.no_collection`` this test fails (checked on an H200, where a probe of the same
    calls, with a hook on the decoder making garbage, counted 1,960 collections inside the captures)."""
    model = gpu_qwen3(torch.bfloat16)
    inside: list[bool] = []

    def on_collection(phase, info):
        if phase == "start":
            inside.append(torch.cuda.is_current_stream_capturing())

    engine = Engine(model, EngineConfig(num_blocks=128, block_size=16, max_batch_tokens=256, seed=0))
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 10**6, 10**6)  # the youngest generation on (almost) every allocation
    gc.callbacks.append(on_collection)
    try:
        for lengths, n in (([9, 30, 17], 3), ([12], 2)):  # decode batches of 9 and 2 rows: two graph sizes
            engine.generate(random_prompts(lengths, vocab=4096), SamplingParams(max_new_tokens=20, n=n,
                                                                                stop_token_ids=()))
    finally:
        gc.callbacks.remove(on_collection)
        gc.set_threshold(*thresholds)
    assert engine.stats()["graphs_captured"] >= 2 and engine.stats()["graph_steps"] > 0
    assert len(inside) > 1000 and not any(inside)


def test_more_captured_batch_sizes_hold_no_more_memory():
    """Decode graphs of 7 more batch sizes (and their warm-ups) leave what the run holds on the GPU where it was:
    every size writes its logits into the runner's one buffer, and every warm-up runs on the runner's one side
    stream. (Before: each size's fp32 logits stayed in the graphs' pool, and each warm-up's new stream kept a cuBLAS
    workspace, 32 MiB on Hopper, for good: bench/results/h100/speed/graphmem.)"""
    model = gpu_qwen3(torch.bfloat16)
    engine = Engine(model, EngineConfig(num_blocks=512, block_size=16, max_batch_tokens=2048, max_num_seqs=64,
                                        seed=0))

    def through_sizes(n: int) -> None:  # request i stops after i + 2 tokens: decode batches of n, n - 1, ..., 1
        for i, prompt in enumerate(random_prompts([8] * n, vocab=4096, seed=n)):
            engine.submit(prompt, SamplingParams(max_new_tokens=i + 2, stop_token_ids=()))
        while engine.num_unfinished:
            engine.step()
        torch.cuda.synchronize()

    through_sizes(8)  # the ladder's 1, 2, 4 and 8
    captured, held = engine.stats()["graphs_captured"], torch.cuda.memory_allocated()
    through_sizes(64)  # ... and 16, 24, ..., 64
    assert engine.stats()["graphs_captured"] >= captured + 7
    assert torch.cuda.memory_allocated() - held < 2**20
