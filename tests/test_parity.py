"""The parity guard passes what unison computes exactly and refuses, naming the class and the gap, a model with a
feature unison lacks: an attention bias its attention function ignores, Mamba layers, an unknown head transform."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers
from conftest import tiny_llama, tiny_qwen3
from hybrid_models import tiny_hybrid
from test_head_transforms import COMMON, DoubledLogits, build
from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from unison.engine import EngineConfig
from unison.parity import ParityError, check_parity


def gpt_oss() -> torch.nn.Module:  # attention sinks
    torch.manual_seed(0)
    cfg = GptOssConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    return GptOssForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3, lambda: build("Gemma3"), lambda: build("Granite"),
                                  lambda: build("Cohere2"), lambda: build("Gemma2", attn_logit_softcapping=5.0),
                                  gpt_oss],
                         ids=["llama", "qwen3", "gemma3", "granite", "cohere2", "gemma2-attn-softcap", "gpt-oss"])
def test_guard_passes_what_unison_computes_exactly(make):
    model = make().train()  # the guard scores in eval mode and gives the mode back
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = check_parity(model, EngineConfig(block_size=4))
    assert report.model == type(model).__name__ and report.dtype == "float32" and report.tokens == 3 * 2 * 8
    assert max(report.engine_max, report.trainer_max) < 1e-4  # fp32 on the CPU: ~1e-6
    assert model.training and model.config._attn_implementation == "unison"
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name


def test_guard_scores_the_training_forward_with_the_fused_kernels(monkeypatch):
    """The guard's trainer side runs the kernels the run trains with (here in Triton's interpreter)."""
    pytest.importorskip("triton")
    from unison.train import fused

    calls = []
    real = fused.silu_mul
    monkeypatch.setattr(fused, "silu_mul", lambda gate, up: calls.append(gate.shape) or real(gate, up))
    report = check_parity(tiny_qwen3(), EngineConfig(block_size=4), kernels=True)
    assert report.trainer_max < 1e-4 and len(calls) == 2  # one packed row through both layers' MLPs


def alibi_eager(module, query, key, value, attention_mask, alibi_slope: float, **kwargs):
    """transformers' eager attention plus a linear distance penalty on the scores (ALiBi)."""
    pos = torch.arange(key.shape[2])
    bias = (alibi_slope * (pos[None, :] - pos[:, None])).to(query.dtype)[-query.shape[2]:]
    return eager_attention_forward(module, query, key, value, attention_mask + bias, **kwargs)


class AlibiAttention(LlamaAttention):
    """Llama attention with a bias that only the model's own eager function applies; unison's attention function
    ignores the keyword, as it ignored GptOss's sinks (issue 18): engine and trainer agree, and both are wrong."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        assert cache is None
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        impl = self.config._attn_implementation
        attend = alibi_eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
        out, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0, alibi_slope=0.5,
                              **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def test_guard_refuses_an_attention_feature_unison_lacks():
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**COMMON), attn_implementation="unison",
                                          dtype=torch.float32).eval()
    for layer in model.model.layers:
        layer.self_attn.__class__ = AlibiAttention
    with pytest.raises(ParityError, match=r"LlamaForCausalLM .* in the engine by mean [0-9.e-]+, max [0-9.e-]+ nats; "
                                          r"the packed training forward by mean"):
        check_parity(model)
    assert model.config._attn_implementation == "unison"  # given back after the reference forward


def test_guard_refuses_sequence_layers_the_engine_does_not_know():
    # Conv, gated delta-net and Mamba2 layers keep per-request state in the engine (tests/test_hybrid_engine.py);
    # Jamba's Mamba1 mixer scans with functions the engine does not run per request: refused before any rollout.
    config = transformers.JambaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                      attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                      num_experts=2, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False)
    model = transformers.JambaForCausalLM._from_config(config, attn_implementation="unison")
    with pytest.raises(ValueError, match=r"JambaMambaMixer \(layer 0\): a sequence layer .* does not run per request"):
        check_parity(model)


def test_guard_refuses_a_conv_behind_a_callable_it_cannot_read(monkeypatch):
    # transformers reaches the short conv through causal_conv1d_forward (5.25, around its cache) or causal_conv1d_fn
    # (5.24); under that name a callable unison cannot read (a runtime's, keeping the state itself) is refused by name.
    import transformers.models.lfm2.modeling_lfm2 as lfm2

    name = "causal_conv1d_forward" if hasattr(lfm2, "causal_conv1d_forward") else "causal_conv1d_fn"
    monkeypatch.setattr(lfm2, name, functools.partial(getattr(lfm2, name)))
    with pytest.raises(ValueError, match=rf"Lfm2ShortConv \(layer 0\): .*{name}"):
        check_parity(tiny_hybrid("lfm2"))


def test_guard_refuses_two_sequence_modules_in_one_layer():
    # Inkling2's layers keep several short convs, each with its own state; the engine keeps one state per layer.
    model = tiny_hybrid("lfm2")
    model.model.layers[0].second_conv = copy.deepcopy(model.model.layers[0].conv)
    with pytest.raises(ValueError, match=r"Lfm2ShortConv \(layer 0\): a second sequence module in the layer"):
        check_parity(model)


def test_guard_refuses_an_unknown_head_transform():
    torch.manual_seed(0)
    model = DoubledLogits._from_config(LlamaConfig(**COMMON), attn_implementation="unison", dtype=torch.float32)
    with pytest.raises(ValueError, match="DoubledLogits.forward changes its logits"):
        check_parity(model)


def test_guard_in_bf16_sits_within_its_tolerance():
    report = check_parity(tiny_llama(dtype=torch.bfloat16))
    assert report.dtype == "bfloat16" and report.tolerance == (0.1, 2.0)
    assert report.engine_mean < report.tolerance[0] / 4 and report.trainer_mean < report.tolerance[0] / 4
