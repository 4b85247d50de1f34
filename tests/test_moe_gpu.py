"""unison's MoE experts kernels on a CUDA GPU: against the PyTorch reference and transformers' paths at decode and
prefill shapes, inside a CUDA graph with the routing changed between replays, in the engine, and the fallback
under autograd (run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from unison.engine import Engine, EngineConfig, SamplingParams, moe
from unison.engine.triton_moe import (
    ExpertsLayout,
    align,
    align_reference,
    block_sizes,
    experts_reference,
    fused_experts,
)

pytestmark = pytest.mark.gpu


def experts_layer(experts, hidden, inter, dtype, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts)
    with torch.device("cuda"):
        block = Qwen3MoeExperts(cfg)
        with torch.no_grad():
            block.gate_up_proj.normal_(0, hidden**-0.5)
            block.down_proj.normal_(0, inter**-0.5)
    return block.to(dtype).requires_grad_(False)


def gpt_oss_layer(experts, hidden, inter, dtype, seed=0):
    """GptOss's experts (transposed, interleaved, biased; limit 7, alpha 1.702) with random weights and biases."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts))
        with torch.no_grad():
            block.gate_up_proj.normal_(0, 3 * hidden**-0.5)  # gate/up of a few units: the clamps at 7 are hit
            block.gate_up_proj_bias.normal_(0, 0.5)
            block.down_proj.normal_(0, inter**-0.5)
            block.down_proj_bias.normal_(0, 0.5)
    return block.to(dtype).requires_grad_(False)


def routed(tokens, hidden, experts, top_k, seed, dtype):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    w, idx = logits.softmax(-1).topk(top_k, dim=-1)
    return x, idx, (w / w.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("experts,hidden,inter,top_k", [(128, 2048, 768, 8), (60, 512, 200, 4)])
def test_kernels_match_reference_and_grouped_mm_on_gpu(tokens, experts, hidden, inter, top_k):
    fp32 = experts_layer(experts, hidden, inter, torch.float32)
    x, idx, w = routed(tokens, hidden, experts, top_k, tokens, torch.float32)
    with torch.inference_mode():
        out = fused_experts(x, idx, w, fp32.gate_up_proj, fp32.down_proj)
        ref = experts_reference(x, idx, w, fp32.gate_up_proj, fp32.down_proj)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, f"fp32 kernels vs reference: {rel:.2e}"  # IEEE fp32 products, never TF32
        bf16 = experts_layer(experts, hidden, inter, torch.bfloat16)
        xb, wb = x.bfloat16(), w.bfloat16()
        ours = fused_experts(xb, idx, wb, bf16.gate_up_proj, bf16.down_proj)
        theirs = grouped_mm_experts_forward(bf16, xb, idx, wb)
        truth = ref  # fp32 (batched_mm would gather T * K expert matrices: 47 GB at T=1000)
        err_ours = ((ours.float() - truth).norm() / truth.norm()).item()
        err_theirs = ((theirs.float() - truth).norm() / truth.norm()).item()
        gap = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
        print(f"T={tokens} E={experts}: bf16 vs fp32 ours {err_ours:.2e} grouped_mm {err_theirs:.2e}; gap {gap:.2e}")
        assert err_ours < 1.1 * err_theirs + 1e-4  # at the bf16 floor
        assert gap < 1e-2


@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("experts,hidden,inter,top_k", [(32, 2880, 2880, 4), (12, 512, 200, 2)])
def test_gpt_oss_kernels_match_reference_and_grouped_mm_on_gpu(tokens, experts, hidden, inter, top_k):
    fp32 = gpt_oss_layer(experts, hidden, inter, torch.float32)
    assert moe.unsupported(fp32) is None
    layout = ExpertsLayout(transposed=True, interleaved=True, gate="gptoss", alpha=fp32.alpha, limit=fp32.limit)
    x, idx, w = routed(tokens, hidden, experts, top_k, tokens, torch.float32)
    with torch.inference_mode():
        out = moe.kernels_forward(fp32, x, idx, w)
        ref = experts_reference(x, idx, w, fp32.gate_up_proj, fp32.down_proj, gate_up_bias=fp32.gate_up_proj_bias,
                                down_bias=fp32.down_proj_bias, layout=layout)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, f"fp32 kernels vs reference: {rel:.2e}"
        bf16 = gpt_oss_layer(experts, hidden, inter, torch.bfloat16)
        xb, wb = x.bfloat16(), w.bfloat16()
        ours = moe.kernels_forward(bf16, xb, idx, wb)
        theirs = grouped_mm_experts_forward(bf16, xb, idx, wb)
        err_ours = ((ours.float() - ref).norm() / ref.norm()).item()
        err_theirs = ((theirs.float() - ref).norm() / ref.norm()).item()
        gap = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
        print(f"GptOss T={tokens} E={experts}: bf16 vs fp32 ours {err_ours:.2e} grouped_mm {err_theirs:.2e}; "
              f"gap {gap:.2e}")
        assert err_ours < 1.1 * err_theirs + 1e-4  # at the bf16 floor
        assert gap < 1e-2


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (64, 128, 8), (256, 128, 8), (8192, 128, 8),
                                                  (3, 60, 4), (1, 16, 1), (500, 256, 8)])
def test_routing_kernel_matches_torch_ops_on_gpu(tokens, experts, top_k):
    _, idx, _ = routed(tokens, 64, experts, top_k, tokens, torch.float32)
    block_m = block_sizes(tokens * top_k, experts).block_m
    got, ref = align(idx, experts, block_m), align_reference(idx, experts, block_m)
    for field in ("perm", "bounds", "first_block", "block_expert"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_kernels_replay_in_a_cuda_graph_with_new_routing(family):
    """No host sync and a grid fixed by the shapes: one capture serves any routing written into its inputs."""
    make = experts_layer if family == "qwen3_moe" else gpt_oss_layer
    block = make(128, 2048, 768, torch.bfloat16)
    x, idx, w = routed(64, 2048, 128, 8, 0, torch.bfloat16)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe.kernels_forward(block, x, idx, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.kernels_forward(block, x, idx, w)
        for seed in (1, 2):
            x2, idx2, w2 = routed(64, 2048, 128, 8, seed, torch.bfloat16)
            if seed == 2:
                idx2[:, 0] = 5  # one expert takes every token: several blocks of it
            x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
            graph.replay()
            eager = moe.kernels_forward(block, x2, idx2, w2)
            assert torch.equal(out, eager)


def test_grad_enabled_keeps_transformers_differentiable_path():
    block = experts_layer(16, 256, 128, torch.bfloat16).requires_grad_(True)
    x, idx, w = routed(9, 256, 16, 4, 0, torch.bfloat16)
    x.requires_grad_(True)
    assert not moe.kernels_apply(block, x)
    out = moe.unison_experts_forward(block, x, idx, w)
    out.float().sum().backward()
    assert block.gate_up_proj.grad is not None and x.grad is not None
    with torch.inference_mode():
        assert moe.kernels_apply(block, x)


def moe_model(family: str):
    """A 2-layer fp32 model with 30 experts, top-4: Qwen3-MoE, or GptOss with biases that matter and its sinks
    and sliding window."""
    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=64, num_experts_per_tok=4, eos_token_id=2)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, num_experts=30, moe_intermediate_size=96, max_position_embeddings=2048)
        cls = Qwen3MoeForCausalLM
    else:  # its own yarn RoPE and position limit
        cfg = GptOssConfig(**common, num_local_experts=30, intermediate_size=96, sliding_window=32,
                           layer_types=["sliding_attention", "full_attention"])
        cls = GptOssForCausalLM
    with torch.device("cuda"):
        model = cls._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_bias", "sinks")):  # transformers initialises these to zero
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_engine_decodes_through_the_kernels_exactly_in_fp32(family):
    model = moe_model(family)
    assert len(moe.kernel_modules(model)) == 2
    model.set_experts_implementation("batched_mm")  # transformers' fp32 path on CUDA, for the reference forwards
    prompts = random_prompts([7, 33, 100], vocab=4096)
    runs = {}
    for kernel in ("triton", "transformers"):
        engine = Engine(model, EngineConfig(num_blocks=256, max_batch_tokens=64, seed=0, moe_kernel=kernel))
        runs[kernel] = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=()))
        assert engine.stats()["graph_steps"] > 0
        diff = max((teacher_forced_logprobs(model, c.prompt_ids, c.token_ids) - torch.tensor(c.logprobs)).abs().max()
                   for c in runs[kernel])
        assert diff < 1e-3, f"{kernel}: engine vs teacher-forced {diff:.2e}"
    assert [c.token_ids for c in runs["triton"]] == [c.token_ids for c in runs["transformers"]]
