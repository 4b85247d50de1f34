"""The engine's fused decoder layers on a CUDA GPU in bf16 (run on the GPU machine: ``pytest -m gpu``): the roundings
the interpreter cannot show, and the engine's logprobs with and without them."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from unison.engine import Engine, EngineConfig, SamplingParams, fused_layer
from unison.engine.fused_norm import add_rms_norm, rms_norm

pytestmark = pytest.mark.gpu
BF16_ULP = 2.0**-7


@pytest.mark.parametrize("width", [128, 1024, 2048])
def test_add_rms_norm_rounds_as_the_add_then_the_norm(width):
    """The sum bit for bit PyTorch's bf16 add; the norm of it bit for bit the norm kernel's."""
    x, residual = torch.randn(2, 300, width, device="cuda").to(torch.bfloat16)
    w = (torch.rand(width, device="cuda") + 0.5).to(torch.bfloat16)
    total, normed = add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, rms_norm(residual + x, w, 1e-6))


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_output_projection_shares_summed_in_the_norm_kernel_have_split_linears_bits(rows):
    """bf16 o_proj and down_proj of the 0.6B shape (biased or not) in 4 shares: the shares left unsummed and summed
    by the residual add + norm kernel give the bits of ``split_linear``'s output added there, eagerly and in a CUDA
    graph (with programmatic launches on Hopper) replayed ten times."""
    from unison.engine import triton_linear
    g = torch.Generator("cuda").manual_seed(rows)
    for n, k, bias in ((1024, 2048, False), (1024, 3072, True)):
        x = torch.randn(rows, k, generator=g, device="cuda").bfloat16()
        w = (torch.randn(n, k, generator=g, device="cuda") / 32).bfloat16()
        b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
        residual = torch.randn(rows, n, generator=g, device="cuda").bfloat16()
        norm_w = (torch.rand(n, generator=g, device="cuda") + 0.5).bfloat16()
        expected = add_rms_norm(triton_linear.split_linear(x, w, b, 4), residual, norm_w, 1e-6)
        args = (residual, norm_w, 1e-6)
        got = add_rms_norm(triton_linear.split_parts(x, w, b, 4), *args)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = add_rms_norm(triton_linear.split_parts(x, w, b, 4), *args)
        for _ in range(10):
            replayed[0].zero_()
            replayed[1].zero_()
            graph.replay()
            assert torch.equal(replayed[0], expected[0]) and torch.equal(replayed[1], expected[1])


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 8, 128), (32, 4, 128), (8, 1, 64)])
def test_qkv_rope_write_at_the_bf16_floor(qk_norm, heads, kv_heads, dim):
    """Against Qwen3's modules in bf16: RoPE rounds as transformers (each product, then the sum); the norm's fp32
    statistics may sum in another order, which moves a rounding by one step now and then. Every element within two
    rounding steps, nearly all the same bits; v written as is."""
    n, total_slots = 300, 1024
    q = torch.randn(n, heads, dim, device="cuda").to(torch.bfloat16)
    k, v = torch.randn(2, n, kv_heads, dim, device="cuda").to(torch.bfloat16)
    angle = torch.rand(n, dim // 2, device="cuda") * 1000
    angle = torch.cat([angle, angle], -1)
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    with torch.device("cuda"):
        q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6).to(torch.bfloat16), Qwen3RMSNorm(dim, eps=1e-6).to(torch.bfloat16)
    q_norm.weight.data.uniform_(0.5, 1.5)
    k_norm.weight.data.uniform_(0.5, 1.5)
    k_pool = torch.zeros(total_slots, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.randperm(total_slots, device="cuda")[:n]
    out = fused_layer.qkv_rope_write(q, k, v, cos, sin, k_pool, v_pool, slots, q_norm if qk_norm else None,
                                     k_norm if qk_norm else None)
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    if qk_norm:
        qh, kh = q_norm(qh), k_norm(kh)
    ref_q, ref_k = apply_rotary_pos_emb(qh, kh, cos[None], sin[None])
    for got, ref in ((out, ref_q[0].transpose(0, 1)), (k_pool[slots], ref_k[0].transpose(0, 1))):
        err = (got.float() - ref.float()).abs()
        same = (got == ref).float().mean().item()
        print(f"qkv_rope_write qk_norm={qk_norm} {heads}/{kv_heads}x{dim}: max |err| {err.max():.2e}, same bits "
              f"{same:.5f}")
        assert (err <= 2 * BF16_ULP * ref.float().abs().clamp_min(1.0)).all()
        assert same > (0.99 if qk_norm else 0.9999)
    assert torch.equal(v_pool[slots], v)


def test_engine_logprobs_with_the_fused_layers_at_the_bf16_floor(monkeypatch):
    """A bf16 Qwen3 through the engine (graphs, chunked prefill) with and without the fused layers, against the
    fp32 model's teacher-forced logprobs: the fused layers' gap is the unfused engine's, and they ran."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=2)
    with torch.device("cuda"):
        ref = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.data.add_(torch.randn_like(p) * 0.2)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(ref.state_dict())
    prompts = random_prompts([7, 40, 130, 300], vocab=4096)
    gaps, calls = {}, {True: 0, False: 0}
    original = fused_layer.qkv_rope_write
    for fused in (True, False):
        def counted(*a, fused=fused, **kw):
            calls[fused] += 1
            return original(*a, **kw)
        monkeypatch.setattr(fused_layer, "qkv_rope_write", counted)
        monkeypatch.setattr(fused_layer, "DEVICES", {"cuda"} if fused else set())
        engine = Engine(model, EngineConfig(num_blocks=512, block_size=16, max_batch_tokens=256, seed=0))
        done = engine.generate(prompts, SamplingParams(max_new_tokens=48, n=2, stop_token_ids=()))
        assert (calls[fused] > 0) == fused
        gaps[fused] = torch.cat([(teacher_forced_logprobs(ref, c.prompt_ids, c.token_ids)
                                  - torch.tensor(c.logprobs)).abs() for c in done]).mean().item()
    print(f"mean |engine - fp32| fused layers {gaps[True]:.3e}, transformers' layers {gaps[False]:.3e}")
    assert gaps[True] < 1.25 * gaps[False] + 1e-4


def test_engine_with_the_one_launch_attention_equals_the_two_launches(monkeypatch):
    """The 0.6B shape's heads (16 query, 8 KV, 128 wide) through the engine's decode graphs at 64 requests (one split
    a sequence) with ``rope_paged_decode``: the same tokens and logprobs, bit for bit, as with q/k norms, RoPE and
    the K/V write in a launch of their own."""
    from unison.engine import triton_backend

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                      eos_token_id=2)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
    prompts = random_prompts([60 + i for i in range(64)], vocab=4096)
    runs, calls = {}, {"n": 0}
    original = triton_backend.rope_paged_decode

    def counted(*a, **kw):
        calls["n"] += 1
        return original(*a, **kw)
    monkeypatch.setattr(triton_backend, "rope_paged_decode", counted)
    for one in (True, False):
        engine = Engine(model, EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=64, seed=0))
        engine.backend.rope_decode = one
        before = calls["n"]
        done = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, stop_token_ids=()))
        assert (calls["n"] > before) == one
        runs[one] = [(c.token_ids, c.logprobs) for c in done]
    assert runs[True] == runs[False]


def test_token_counts_reuse_the_compiled_kernels():
    """Any number of tokens (a decode batch, a prefill chunk) runs the variants compiled already: a compile in a
    rollout costs ~0.3 s."""
    import triton

    q_norm, k_norm = (Qwen3RMSNorm(128).to("cuda", torch.bfloat16) for _ in range(2))
    k_pool = torch.zeros(16384, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)

    def step(n):
        q = torch.randn(n, 16, 128, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn(2, n, 8, 128, device="cuda", dtype=torch.bfloat16)
        cos, sin = torch.randn(2, n, 128, device="cuda", dtype=torch.bfloat16)
        fused_layer.qkv_rope_write(q, k, v, cos, sin, k_pool, v_pool, torch.randperm(16384, device="cuda")[:n],
                                   q_norm, k_norm)
        x, residual = torch.randn(2, 1, n, 1024, device="cuda", dtype=torch.bfloat16)
        add_rms_norm(x, residual, q_norm.weight.new_ones(1024), 1e-6)

    compiled = []
    step(64)
    previous, triton.knobs.runtime.jit_cache_hook = triton.knobs.runtime.jit_cache_hook, \
        lambda *a, **kw: compiled.append(getattr(kw.get("fn"), "name", "?")) or False
    try:
        for n in (1, 7, 33, 300, 8192):
            step(n)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert not compiled, compiled
