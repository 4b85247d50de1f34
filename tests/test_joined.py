"""Projections that share their input laid out as one matrix (``unison.engine.fused_linear.pack_projections``) and
trained as one GEMM each way (``unison.train.joined``, ``unison.train.fused_qk``): the same parameters, values,
checkpoints, logprobs and gradients as apart."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from test_fused_train import _logprobs_and_grads
from test_logprobs import packed_row
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from unison.engine.fused_linear import joined, pack_projections
from unison.train import fused_qk
from unison.train import joined as joined_mlp
from unison.train.checkpoint import save_hf_checkpoint
from unison.train.logprobs import policy_logprobs

pytest.importorskip("triton")


def _groups(model):
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        yield [mlp.gate_proj.weight, mlp.up_proj.weight]


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_packing_keeps_the_parameters_and_their_values(build, tmp_path):
    model = build()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    assert all(joined(g) is None for g in _groups(model))
    assert pack_projections(model) == 2 * model.config.num_hidden_layers
    assert pack_projections(model) == 0  # laid out already
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
        assert p.is_leaf and p.requires_grad
    for group in _groups(model):
        whole = joined(group)
        assert whole is not None and torch.equal(whole, torch.cat([w.detach() for w in group]))
    save_hf_checkpoint(model, None, str(tmp_path / "ckpt"))  # disjoint views of one storage: each saved whole
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    state = loaded.state_dict()
    for name, (_, value) in before.items():
        assert torch.equal(state[name], value), name


def tiny_qwen2(seed: int = 0, vocab: int = 256) -> Qwen2ForCausalLM:
    """Qwen2's attention: biased q/k/v, no q/k norms."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # zero-initialised biases would not show a bias gradient gone astray
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return model


def test_biases_are_joined_and_wrapped_projections_keep_their_own_weights():
    model = tiny_qwen2()
    attn = model.model.layers[0].self_attn
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    values = torch.cat([b.detach() for b in biases])
    assert pack_projections(model) == 2 * model.config.num_hidden_layers
    assert torch.equal(joined(biases), values)

    class Wrapped(torch.nn.Linear):  # as a LoRA layer or a tensor-parallel shard: not a plain nn.Linear
        pass

    model = tiny_llama()
    attn = model.model.layers[0].self_attn
    wrapped = Wrapped(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    attn.k_proj = wrapped
    assert pack_projections(model) == 2 * model.config.num_hidden_layers - 1  # that layer's MLP is laid out
    assert joined([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2, tiny_qwen3], ids=["llama", "qwen2", "qwen3"])
def test_training_over_joined_weights_equals_the_projections_apart(build, monkeypatch):
    """Logprobs, entropies and every parameter's gradient as the unpacked model's through the same fused kernels:
    q/k/v (with RoPE, and Qwen3's q/k norms) and every SwiGLU's gate/up as one GEMM each way."""
    calls = {"qkv": 0, "gated": 0}
    for module, name, key in ((fused_qk._QKVRope, "apply", "qkv"), (joined_mlp._GatedUp, "apply", "gated")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a))
    apart, packed = build(vocab=128), build(vocab=128)
    pack_projections(packed)
    row = packed_row(apart.config.vocab_size)
    logp, entropy, grads = _logprobs_and_grads(apart, row, kernels=True)
    assert calls == {"qkv": 0, "gated": 0}
    got_logp, got_entropy, got_grads = _logprobs_and_grads(packed, row, kernels=True)
    layers = packed.config.num_hidden_layers
    assert calls == {"qkv": layers, "gated": layers}
    torch.testing.assert_close(got_logp, logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_entropy, entropy, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        assert grad.abs().max() > 0, name


def _saved_bytes(model, row) -> int:
    """The bytes of the distinct storages autograd keeps for the backward of a packed row's forward."""
    storages = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy_logprobs(model, row, temperature=0.7, chunk_size=6, kernels=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2, tiny_qwen3], ids=["llama", "qwen2", "qwen3"])
def test_joined_projections_keep_no_more_activations(build):
    """What the backward keeps: no more than apart for a Llama (RoPE's backward reads nothing of [q | k | v]); for
    Qwen3 (its q/k norms' backward reads q and k) at most v's contiguous copy a layer more."""
    apart, packed = build(vocab=128), build(vocab=128)
    pack_projections(packed)
    row = packed_row(apart.config.vocab_size)
    extra = _saved_bytes(packed, row) - _saved_bytes(apart, row)
    cfg = apart.config
    v_bytes = row.num_tokens * cfg.num_key_value_heads * apart.model.layers[0].self_attn.head_dim * 4
    assert extra <= (cfg.num_hidden_layers * v_bytes if build is tiny_qwen3 else 0), (extra, v_bytes)
