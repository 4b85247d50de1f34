"""The trainer's differentiable MoE experts (unison.train.fused_experts) in Triton's interpreter: gradients of the
hidden states, routing weights, expert weights and biases against autograd through transformers' experts modules,
both layouts; then a packed training forward and backward of a tiny Qwen3-MoE and GptOss with and without them."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_logprobs import packed_row
from test_moe import EXPERTS, HIDDEN, experts_block, gpt_oss_block, qwen3_moe_config, routing

pytest.importorskip("triton")

from unison.engine import moe  # noqa: E402
from unison.engine.triton_moe import BlockSizes  # noqa: E402
from unison.train import fused_experts  # noqa: E402
from unison.train.logprobs import policy_logprobs  # noqa: E402
from unison.train.step import checkpointed_layers  # noqa: E402


def block_of(family: str, dtype, top_k: int = 2):
    block = experts_block(dtype) if family == "qwen3_moe" else gpt_oss_block(dtype, top_k)
    return block.requires_grad_(True)


def grads(fn, block, x, w, upstream):
    """fn's output and the gradients of (output * upstream).sum() w.r.t. x, w and the block's parameters."""
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    params = dict(block.named_parameters())
    out = fn(x, w)
    got = torch.autograd.grad((out.float() * upstream).sum(), [x, w, *params.values()])
    return out.detach(), dict(zip(["x", "w", *params], got, strict=True))


def ours(block, idx, sizes=None):
    layout, gate_up_bias, down_bias = moe.module_layout(block)
    return lambda x, w: fused_experts.experts(x, idx, w, block.gate_up_proj, block.down_proj, sizes,
                                              gate_up_bias=gate_up_bias, down_bias=down_bias, layout=layout)


def inputs(tokens, top_k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    idx, w = routing(tokens, top_k, seed, torch.float32)
    return x, idx, w, torch.randn(tokens, HIDDEN, generator=g)


@pytest.mark.parametrize("family,tokens,top_k,tiles", [("qwen3_moe", 33, 3, "small"), ("qwen3_moe", 1, 2, "default"),
                                                       ("gpt_oss", 33, 2, "small"), ("gpt_oss", 5, 3, "default")])
def test_experts_gradients_equal_transformers_in_fp32(family, tokens, top_k, tiles, monkeypatch):
    block = block_of(family, torch.float32, top_k)
    x, idx, w, upstream = inputs(tokens, top_k, torch.float32, seed=tokens + top_k)
    sizes = None
    if tiles == "small":  # experts over two blocks of pairs, partial tiles of H (40) and I (24) in every kernel
        sizes = BlockSizes(16, 16, 16)
        monkeypatch.setattr(fused_experts, "weight_grad_sizes", lambda dtype: BlockSizes(16, 16, 8))
    ref, ref_grads = grads(lambda x, w: block(x, idx, w), block, x, w, upstream)
    out, got = grads(ours(block, idx, sizes), block, x, w, upstream)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, want in ref_grads.items():
        scale = want.abs().max().item()
        assert scale > 0, name
        assert (got[name] - want).abs().max().item() <= 1e-5 * scale, name
    # the two experts no token picked get zero gradients, written (not left uninitialised)
    assert got["down_proj"][EXPERTS - 2:].abs().max() == 0 and got["gate_up_proj"][EXPERTS - 2:].abs().max() == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_gradients_at_the_floor_of_transformers_bf16(family):
    fp32, bf16 = block_of(family, torch.float32), block_of(family, torch.bfloat16)
    x, idx, w, upstream = inputs(33, 2, torch.float32, seed=7)
    _, truth = grads(lambda x, w: fp32(x, idx, w), fp32, x, w, upstream)
    _, theirs = grads(lambda x, w: bf16(x, idx, w), bf16, x.bfloat16(), w, upstream)
    _, mine = grads(ours(bf16, idx), bf16, x.bfloat16(), w, upstream)
    for name, want in truth.items():
        floor = (theirs[name].float() - want).abs().max().item()
        gap = (mine[name].float() - want).abs().max().item()
        assert gap <= 1.5 * floor + 1e-3 * want.abs().max().item(), (name, gap, floor)


def test_frozen_experts_give_the_input_gradient_only():
    block = block_of("qwen3_moe", torch.float32).requires_grad_(False)
    x, idx, w, upstream = inputs(9, 2, torch.float32, seed=3)
    x.requires_grad_(True)
    (ref,) = torch.autograd.grad((block(x, idx, w) * upstream).sum(), [x])
    out = ours(block, idx)(x, w)
    (got,) = torch.autograd.grad((out * upstream).sum(), [x])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    empty = ours(block, idx[:0])(x[:0], w[:0])
    assert empty.shape == (0, HIDDEN)


def moe_models():
    torch.manual_seed(0)
    qwen = transformers.Qwen3MoeForCausalLM._from_config(qwen3_moe_config(vocab_size=96),
                                                         attn_implementation="unison")
    gpt = transformers.GptOssForCausalLM._from_config(transformers.GptOssConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=2, swiglu_limit=1.3,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"]), attn_implementation="unison")
    for model in (qwen, gpt):
        for block in moe.kernel_modules(model):
            with torch.no_grad():
                for p in block.parameters(recurse=False):
                    p.normal_(0, 0.3)
    return {"qwen3_moe": qwen, "gpt_oss": gpt}


def packed_backward(model, row, upstream, kernels: bool):
    """The packed training forward and backward with activation checkpointing, the experts on the differentiable
    kernels or on the model's own path: (logprobs, the parameters' gradients)."""
    model.zero_grad(set_to_none=True)
    with checkpointed_layers(model, True), fused_experts.experts_training(model) if kernels else \
            moe.experts_kernels([]):
        logp, _ = policy_logprobs(model, row, temperature=0.7, chunk_size=8, kernels=False)
        (logp * upstream).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_packed_training_through_the_experts_kernels_equals_transformers(family, monkeypatch):
    model = moe_models()[family]
    row = packed_row(model.config.vocab_size)
    upstream = torch.linspace(-1.0, 1.0, row.num_loss_tokens)

    def run(kernels: bool):
        return packed_backward(model, row, upstream, kernels)

    logp, ref_grads = run(kernels=False)
    monkeypatch.setattr(moe, "DEVICES", {"cuda", "cpu"})
    calls = []
    own = fused_experts.module_forward
    monkeypatch.setattr(fused_experts, "module_forward", lambda *a: calls.append(1) or own(*a))
    got_logp, got = run(kernels=True)
    # two layers, each run forward, then again by activation checkpointing's recomputation in the backward
    assert len(calls) == 4
    torch.testing.assert_close(got_logp, logp, rtol=0, atol=1e-5)
    experts_grads = [n for n in ref_grads if "experts" in n]
    assert experts_grads and set(got) == set(ref_grads)
    for name, want in ref_grads.items():
        assert (got[name] - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1e-3), name
    assert all("forward" not in m.__dict__ for m in moe.kernel_modules(model))  # every module itself again
