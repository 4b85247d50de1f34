"""Tiny random models of the families with attention features beyond plain causal SDPA (attention sinks, MLA,
logit softcapping, non-default scaling, sliding windows), each with an eager twin holding the same weights."""

from __future__ import annotations

import torch
import transformers

import unison.engine.attention  # noqa: F401  (registers the "unison" attention implementation)

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512, eos_token_id=2,
              bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)

# Final-logit transforms (Gemma2's final softcapping, Granite's logits_scaling, Cohere2's logit_scale) belong to
# the lm_head and are tested there; here they are neutral so that these tests see the attention alone.
FAMILIES = {
    # Sinks on a sliding layer (window 8) and a full one; GQA 4/2.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=16, rope_theta=150000.0))),
    # MLA: keys 16 + 8 wide, values 12 wide; the q LoRA path; a dense then an MoE layer.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1)),
    # MLA without the q LoRA, values wider than the keys' rope part.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=20,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)),
    # Attention logit softcapping (small, so that it bites), query_pre_attn_scalar scaling, a sliding layer.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0, final_logit_softcapping=None, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    # A sliding layer with RoPE, a full layer without.
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, logit_scale=1.0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    # attention_multiplier arrives as ``scaling``.
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.6,
        embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=1.0)),
}


def tiny(family: str, seed: int = 0, dtype=torch.float32):
    """(model on the "unison" attention, its eager twin with the same weights), both in eval mode."""
    config_name, model_name, kw = FAMILIES[family]
    cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    make_config = getattr(transformers, config_name)
    model = cls._from_config(make_config(**COMMON, **kw), attn_implementation="unison", dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # initialised to zero-mean noise: make them large enough to matter
                p.copy_(2.0 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight", "q_b_proj.weight")):
                p.mul_(4.0)  # attention logits of a few units, not ~0.1: softcapping and masks then matter
    eager = cls._from_config(make_config(**COMMON, **kw), attn_implementation="eager", dtype=dtype).eval()
    assert model.config._attn_implementation == "unison" and eager.config._attn_implementation == "eager"
    eager.load_state_dict(model.state_dict())
    return model, eager
