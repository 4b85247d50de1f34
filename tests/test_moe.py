"""unison's MoE experts kernels (Triton's interpreter on the CPU) against their PyTorch reference and transformers'
``grouped_mm`` path; which experts modules and calls take them; the engine's switch scoped to its own forwards."""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_models import tiny
from conftest import max_logprob_diff, random_prompts
from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

pytest.importorskip("triton")

from unison.engine import Engine, EngineConfig, SamplingParams, moe  # noqa: E402
from unison.engine.triton_moe import (  # noqa: E402
    BlockSizes,
    ExpertsLayout,
    align,
    align_reference,
    experts_reference,
    fused_experts,
    num_blocks,
)

# E = 7 (a multiple of nothing), H = 40 and I = 24 (partial K and N tiles at 16).
EXPERTS, HIDDEN, INTER = 7, 40, 24


def qwen3_moe_config(**kw) -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(**{**dict(
        vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0), **kw})


def experts_block(dtype, seed=0):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    torch.manual_seed(seed)
    block = Qwen3MoeExperts(qwen3_moe_config())
    with torch.no_grad():
        block.gate_up_proj.normal_(0, 0.3)
        block.down_proj.normal_(0, 0.3)
    return block.to(dtype)


def gpt_oss_block(dtype, top_k, seed=0):
    """GptOss's experts (transposed, interleaved, biased) with random weights and biases; a limit of 1.3 (not a
    bf16 value: 1.296875 there) that the gate and up values cross in both directions."""
    torch.manual_seed(seed)
    block = GptOssExperts(transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                     num_local_experts=EXPERTS, num_experts_per_tok=top_k,
                                                     swiglu_limit=1.3))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.to(dtype).requires_grad_(False)


def routing(tokens, top_k, seed, weights_dtype):
    """Each token's top_k distinct experts among the first E - 2: the last two are hit by no token."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(EXPERTS - 2, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g).softmax(-1).to(weights_dtype)
    return idx, w


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("dtype,weights_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_fused_experts_match_reference_and_grouped_mm(tokens, top_k, dtype, weights_dtype):
    block = experts_block(dtype, seed=tokens * 10 + top_k)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    idx, w = routing(tokens, top_k, tokens + top_k, weights_dtype)
    sizes = BlockSizes(16, 16, 16)  # T=33, K=3: ~20 pairs an expert, so experts span two blocks
    with torch.no_grad():
        out = fused_experts(x, idx, w, block.gate_up_proj, block.down_proj, sizes)
        ref = experts_reference(x, idx, w, block.gate_up_proj, block.down_proj, block_m=sizes.block_m)
        hf = grouped_mm_experts_forward(block, x, idx, w)
    assert out.dtype == dtype and out.shape == (tokens, HIDDEN) and torch.isfinite(out).all()
    scale = hf.float().abs().max().item()
    if dtype == torch.float32:
        assert (out - ref).abs().max().item() < 1e-5 * scale
        assert (out - hf).abs().max().item() < 1e-5 * scale
    else:  # the same roundings: only the fp32 accumulation order may differ (bit-equal on this CPU: 0.0 measured)
        for other in (ref, hf):
            rel = ((out.float() - other.float()).norm() / other.float().norm()).item()
            assert rel < 1e-3, f"relative error {rel:.2e}"


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("dtype,weights_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_gpt_oss_experts_on_the_kernels_match_transformers(tokens, top_k, dtype, weights_dtype):
    block = gpt_oss_block(dtype, top_k, seed=tokens * 10 + top_k)
    assert moe.unsupported(block) is None
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    idx, w = routing(tokens, top_k, tokens + top_k, weights_dtype)
    gate_up = torch.einsum("th,ehn->etn", x.float(), block.gate_up_proj.float()) + block.gate_up_proj_bias[:, None]
    assert (gate_up > block.limit).any() and (gate_up < -block.limit).any()  # both clamps matter
    layout = ExpertsLayout(transposed=True, interleaved=True, gate="gptoss", alpha=block.alpha, limit=block.limit)
    with torch.no_grad():
        out = moe.kernels_forward(block, x, idx, w, BlockSizes(16, 16, 16))  # partial tiles of H=40 and 2I=48
        ref = experts_reference(x, idx, w, block.gate_up_proj, block.down_proj, gate_up_bias=block.gate_up_proj_bias,
                                down_bias=block.down_proj_bias, layout=layout)
        # the shape's default blocks (one N tile, one K tile) at T=33 (where an expert spans two 16-row blocks)
        wide = moe.kernels_forward(block, x, idx, w) if tokens == 33 else ref
        theirs = [grouped_mm_experts_forward(block, x, idx, w), batched_mm_experts_forward(block, x, idx, w)]
    assert out.dtype == dtype and out.shape == (tokens, HIDDEN) and torch.isfinite(out).all()
    scale = theirs[0].float().abs().max().item()
    for other in [ref, wide, *theirs]:
        if dtype == torch.float32:
            assert (out - other).abs().max().item() < 1e-5 * scale
        else:  # every rounding where torch rounds: bit-equal on this CPU (the GPU's fp32 sums may differ in order)
            assert torch.equal(out, other), (out.float() - other.float()).abs().max().item()


def test_fused_experts_name_what_does_not_fit():
    block = gpt_oss_block(torch.float32, 2)
    x = torch.randn(3, HIDDEN)
    idx, w = routing(3, 2, 0, torch.float32)
    gptoss = ExpertsLayout(transposed=True, interleaved=True, gate="gptoss", alpha=1.702, limit=7.0)
    with pytest.raises(ValueError, match="default layout: down_proj"):  # GptOss's weights read as the default
        fused_experts(x, idx, w, block.gate_up_proj, block.down_proj)
    with pytest.raises(ValueError, match="gate_up_bias is"):
        fused_experts(x, idx, w, block.gate_up_proj, block.down_proj, gate_up_bias=block.down_proj_bias,
                      layout=gptoss)
    with pytest.raises(ValueError, match="'swiglu' is not one of"):
        fused_experts(x, idx, w, block.gate_up_proj, block.down_proj, layout=ExpertsLayout(True, True, "swiglu"))


def test_default_block_sizes_and_an_expert_taking_every_token():
    """The shape-chosen blocks (64 wide N tiles, 128 deep K over H=40) and a routing where one expert gets all."""
    block = experts_block(torch.float32)
    x = torch.randn(20, HIDDEN)
    idx = torch.stack([torch.tensor([3, t % 3]) for t in range(20)])  # expert 3: 20 pairs; 0-2 the others
    w = torch.rand(20, 2)
    with torch.no_grad():
        out = fused_experts(x, idx, w, block.gate_up_proj, block.down_proj)
        hf = grouped_mm_experts_forward(block, x, idx, w)
    assert (out - hf).abs().max().item() < 1e-5 * hf.abs().max().item()


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_has_a_fixed_grid_and_each_block_one_expert(block_m):
    g = torch.Generator().manual_seed(block_m)
    for idx in (torch.randint(0, EXPERTS, (9, 3), generator=g), torch.full((9, 3), 6), torch.tensor([[2]])):
        r = align(idx, EXPERTS, block_m)
        pairs = idx.numel()
        assert r.block_expert.numel() == num_blocks(pairs, EXPERTS, block_m)  # the routing never changes the grid
        counts = torch.bincount(idx.flatten(), minlength=EXPERTS)
        live = r.block_expert[r.block_expert < EXPERTS]
        assert torch.equal(torch.bincount(live, minlength=EXPERTS), (counts + block_m - 1) // block_m)
        assert torch.equal(live, live.sort().values) and (r.block_expert[len(live):] == EXPERTS).all()
        assert torch.equal(idx.flatten()[r.perm], idx.flatten().sort().values)
        ref = align_reference(idx, EXPERTS, block_m)  # the routing kernel against its torch ops
        for field in ("perm", "bounds", "first_block", "block_expert"):
            assert torch.equal(getattr(r, field), getattr(ref, field)), field


def test_which_experts_modules_take_the_kernels():
    qwen = transformers.Qwen3MoeForCausalLM._from_config(qwen3_moe_config(), attn_implementation="unison")
    assert len(moe.kernel_modules(qwen)) == 2
    gpt_oss, _ = tiny("gpt_oss")
    experts = [m for m in gpt_oss.modules() if moe.is_experts_module(m)]
    assert len(experts) == 2 and moe.kernel_modules(gpt_oss) == experts
    block = experts_block(torch.float32)
    for flag, value in (("is_transposed", True), ("has_bias", True), ("has_post_expert_norm", True)):
        setattr(block, flag, value)  # a default-gate module with biases (no bias tensors) is refused, and so on
        assert flag in moe.unsupported(block)
        setattr(block, flag, not value)
    block.act_fn = torch.nn.GELU()
    assert "act_fn" in moe.unsupported(block)


def test_near_misses_of_gpt_oss_keep_transformers_path():
    for flag, value in (("has_bias", False), ("is_concatenated", True), ("is_transposed", False),
                        ("_is_expert_parallel", True), ("has_post_expert_norm", True)):
        block = gpt_oss_block(torch.float32, 2)
        setattr(block, flag, value)
        assert flag in moe.unsupported(block), flag

    class ClampedElsewhere(GptOssExperts):  # GptOss's layout, another gate
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    block = ClampedElsewhere(transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER,
                                                        num_local_experts=EXPERTS))
    assert "_apply_gate" in moe.unsupported(block)
    qwen = experts_block(torch.float32)  # the default gate under GptOss's flags
    qwen.is_concatenated, qwen.is_transposed, qwen.has_bias = False, True, True
    assert "_apply_gate" in moe.unsupported(qwen)
    block = gpt_oss_block(torch.float32, 2)
    block.down_proj_bias = torch.nn.Parameter(torch.zeros(EXPERTS, HIDDEN + 1))
    assert "down_proj_bias" in moe.unsupported(block)
    block = gpt_oss_block(torch.float32, 2)
    block.gate_up_proj_bias.data = block.gate_up_proj_bias.data.bfloat16()
    assert "bfloat16" in moe.unsupported(block)
    del block.gate_up_proj_bias
    assert "gate_up_proj_bias" in moe.unsupported(block)


FAMILIES = {  # transformers 5.24's classes on the supported layout (default flags, SiLU)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=5, moe_intermediate_size=24,
                                                                 shared_expert_intermediate_size=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5, intermediate_size=24)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(n_routed_experts=5, moe_intermediate_size=24,
                                                             first_k_dense_replace=0, n_group=1, topk_group=1)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=5, moe_intermediate_size=24, first_k_dense_replace=0, n_group=1, topk_group=1,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_supported_families_take_the_kernels_and_agree(family):
    config, model_class, kw = FAMILIES[family]
    cfg = getattr(transformers, config)(**{**dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1,
                                                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                                                  intermediate_size=32), **kw})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)._from_config(cfg, attn_implementation="unison")
    (block,) = moe.kernel_modules(model)
    with torch.no_grad():
        block.gate_up_proj.normal_(0, 0.3)
        block.down_proj.normal_(0, 0.3)
        x = torch.randn(6, HIDDEN)
        idx, w = routing(6, 2, 1, torch.float32)
        out = fused_experts(x, idx, w, block.gate_up_proj, block.down_proj, BlockSizes(16, 16, 16))
        hf = block(x, idx, w)  # the model's own experts implementation
    assert (out - hf).abs().max().item() < 1e-5 * hf.abs().max().item()


def test_a_forward_autograd_records_keeps_transformers_path():
    block = experts_block(torch.float32)
    x = torch.randn(3, HIDDEN)
    assert moe.needs_grad(block, x)  # a training forward: parameters that require grad
    with torch.no_grad():
        assert not moe.needs_grad(block, x)
    with torch.inference_mode():
        assert not moe.needs_grad(block, x)
    block.requires_grad_(False)
    assert not moe.needs_grad(block, x) and moe.needs_grad(block, x.requires_grad_())
    assert not moe.kernels_apply(block, x.detach())  # the CPU: never the kernels
    idx, w = routing(3, 2, 0, torch.float32)
    with torch.no_grad():
        assert torch.equal(moe.unison_experts_forward(block, x, idx, w), grouped_mm_experts_forward(block, x, idx, w))


def test_engine_switches_experts_for_its_own_forwards_only():
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM._from_config(qwen3_moe_config(), attn_implementation="unison").eval()
    experts = moe.kernel_modules(model)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__)) for m in experts]
    off = Engine(model, EngineConfig(num_blocks=16, moe_kernel="transformers"))
    assert not isinstance(off.local_forward, moe.WithExpertsKernels)
    # attention="triton": decode through the static-buffer runner (the CUDA-graph path, eager on the CPU)
    engine = Engine(model, EngineConfig(num_blocks=16, seed=0, attention="triton"))
    assert isinstance(engine.local_forward, moe.WithExpertsKernels)  # the default
    done = engine.generate(random_prompts([5, 9]), SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                  stop_token_ids=()))
    assert len(seen) == 2 * 3 and all(seen)  # 2 layers x (a prefill step, two decode steps), each switched
    assert all("forward" not in m.__dict__ for m in experts)  # and restored after each
    # On the CPU the switched modules fall back to their own path: exact against a plain forward.
    assert max_logprob_diff(model, done) < 1e-4
    seen.clear()
    model.train()
    model(torch.tensor([done[0].prompt_ids])).logits.sum().backward()  # a training forward: the class's own path
    assert seen == [False, False] and experts[0].gate_up_proj.grad is not None
    for h in hooks:
        h.remove()


def test_engine_switches_gpt_oss_experts_for_its_own_forwards_only():
    model, _ = tiny("gpt_oss")
    experts = moe.kernel_modules(model)
    with torch.no_grad():
        for m in experts:  # biases that matter (transformers initialises them to zero)
            m.gate_up_proj_bias.normal_(0, 0.5)
            m.down_proj_bias.normal_(0, 0.5)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append("forward" in m.__dict__)) for m in experts]
    engine = Engine(model, EngineConfig(num_blocks=16, seed=0, attention="triton"))
    assert isinstance(engine.local_forward, moe.WithExpertsKernels) and engine.local_forward.modules == experts
    done = engine.generate(random_prompts([5, 9]), SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                  stop_token_ids=()))
    assert len(seen) == 2 * 3 and all(seen)  # 2 layers x (a prefill step, two decode steps), each switched
    assert all("forward" not in m.__dict__ for m in experts)
    assert max_logprob_diff(model, done) < 1e-4  # the CPU: the modules' own path inside the switch
    for h in hooks:
        h.remove()


def test_models_load_with_the_registered_unison_experts():
    torch.manual_seed(0)
    ids = torch.tensor([random_prompts([6])[0]])
    model = transformers.Qwen3MoeForCausalLM._from_config(qwen3_moe_config(), attn_implementation="unison",
                                                           experts_implementation="unison").eval()
    assert model.config._experts_implementation == "unison"
    with torch.no_grad():
        ours = model(ids).logits
        model.set_experts_implementation("grouped_mm")
        assert torch.equal(ours, model(ids).logits)  # the CPU: "unison" is transformers' grouped_mm there
