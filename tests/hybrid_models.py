"""Tiny random hybrid models: a linear-attention, conv or state-space layer beside full attention, two layers each.

Qwen3Next (gated delta-net + short conv, MoE), Qwen3.5 (gated delta-net + short conv, dense), Lfm2 (short conv),
FalconH1 (Mamba2 + conv beside attention in every layer). Weights are drawn at std 0.2, not the 0.02 init, so
every layer moves the logprobs by O(1) and a token carried across a boundary shows.
"""

from __future__ import annotations

import torch
import transformers

import unison.engine.attention  # noqa: F401  (registers the "unison" attention implementation)

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512, eos_token_id=2,
              bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
GATED_DELTA_NET = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "full_attention"])

HYBRIDS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        **GATED_DELTA_NET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", GATED_DELTA_NET),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
        layer_types=["conv", "full_attention"])),
    # Mamba chunks of 8 tokens: the test rows' samples span several chunks and start mid-chunk.
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=32,
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_d_conv=4)),
}


def tiny_hybrid(family: str, seed: int = 0, attn: str = "unison", dtype=torch.float32) -> torch.nn.Module:
    """The family's tiny model on ``attn``, in eval mode; the same ``seed`` gives the same weights."""
    config_name, model_name, kw = HYBRIDS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**COMMON, **kw)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=attn, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()
