"""The trainer's differentiable MoE experts (unison.train.fused_experts) on a CUDA GPU at training shapes: fp32
gradients against autograd through transformers' eager experts, bf16 ones at the floor of transformers'
``grouped_mm`` bf16 path, and a packed training backward with and without them (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from test_moe_gpu import experts_layer, gpt_oss_layer, moe_model, routed
from transformers.integrations.moe import grouped_mm_experts_forward

from unison.engine import moe
from unison.train import fused_experts

pytestmark = pytest.mark.gpu

SHAPES = {"qwen3_moe": (128, 2048, 768, 8), "gpt_oss": (32, 2880, 2880, 4)}


def layer(family, dtype):
    experts, hidden, inter, _ = SHAPES[family]
    build = experts_layer if family == "qwen3_moe" else gpt_oss_layer
    return build(experts, hidden, inter, dtype).requires_grad_(True)


def grads(fn, block, x, w, upstream):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    params = dict(block.named_parameters())
    got = torch.autograd.grad((fn(x, w).float() * upstream).sum(), [x, w, *params.values()])
    return dict(zip(["x", "w", *params], got, strict=True))


def ours(block, idx):
    layout, gate_up_bias, down_bias = moe.module_layout(block)
    return lambda x, w: fused_experts.experts(x, idx, w, block.gate_up_proj, block.down_proj,
                                              gate_up_bias=gate_up_bias, down_bias=down_bias, layout=layout)


@pytest.mark.parametrize("tokens", [3, 700, 4096])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_training_kernels_gradients_on_gpu(family, tokens):
    experts, hidden, _, top_k = SHAPES[family]
    x, idx, w = routed(tokens, hidden, experts, top_k, tokens, torch.float32)
    upstream = torch.randn(tokens, hidden, device="cuda")
    fp32 = layer(family, torch.float32)
    if family == "gpt_oss":  # fp32 products in another order move a gate across the clamp now and then, where the
        fp32.limit = 1e4  # derivative jumps: the exact comparison without clamps (the CPU tests cross them)
    truth = grads(lambda x, w: fp32(x, idx, w), fp32, x, w, upstream)  # the module's eager loop over experts
    exact = grads(ours(fp32, idx), fp32, x, w, upstream)
    for name, want in truth.items():
        scale = want.abs().max().item()
        assert (exact[name] - want).abs().max().item() <= 1e-5 * scale, name
    if family == "gpt_oss":  # the bf16 comparison with the clamps at work
        fp32.limit = layer(family, torch.float32).limit
        truth = grads(lambda x, w: fp32(x, idx, w), fp32, x, w, upstream)
    bf16 = layer(family, torch.bfloat16)
    xb, wb = x.bfloat16(), w.bfloat16()
    theirs = grads(lambda x, w: grouped_mm_experts_forward(bf16, x, idx, w), bf16, xb, wb, upstream)
    mine = grads(ours(bf16, idx), bf16, xb, wb, upstream)
    for name, want in truth.items():
        floor = (theirs[name].float() - want).abs().max().item()
        gap = (mine[name].float() - want).abs().max().item()
        assert gap <= 1.5 * floor + 1e-3 * want.abs().max().item(), (name, gap, floor)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_packed_training_backward_through_the_kernels_on_gpu(family):
    from test_logprobs import packed_row
    from test_moe_grad import packed_backward

    model = moe_model(family)
    row = packed_row(model.config.vocab_size).to("cuda")
    upstream = torch.linspace(-1.0, 1.0, row.num_loss_tokens, device="cuda")

    def run(kernels):
        return packed_backward(model, row, upstream, kernels)

    logp, want = run(False)
    got_logp, got = run(True)
    torch.testing.assert_close(got_logp, logp, rtol=0, atol=1e-5)
    assert any("experts" in n for n in want) and set(got) == set(want)
    for name, grad in want.items():
        assert (got[name] - grad).abs().max().item() <= 1e-5 * max(grad.abs().max().item(), 1e-3), name
