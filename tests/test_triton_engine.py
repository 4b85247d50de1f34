"""The fast engine path on the CPU: the Triton decode kernel in Triton's interpreter, the mixed-step backend,
and the static-buffer decode runner (padding rows, scratch block) that CUDA graphs capture on the GPU."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import max_logprob_diff, random_prompts, record_returns, tiny_llama, tiny_qwen3

from unison.engine import Engine, EngineConfig, SamplingParams

pytest.importorskip("triton")

from unison.engine.fused_norm import fused_norms  # noqa: E402
from unison.engine.fused_rope import fused_rope, rope  # noqa: E402
from unison.engine.graphs import batch_ladder, no_collection  # noqa: E402
from unison.engine.triton_attention import num_splits, paged_decode, pipeline_stages  # noqa: E402
from unison.engine.triton_backend import TritonPagedBackend  # noqa: E402
from unison.engine.triton_sampler import FusedSampler, fused_sample  # noqa: E402


def reference_decode(q, k_pool, v_pool, tables, context_lens, block_size, scale, window=None, sinks=None,
                     softcap=None):
    """Each sequence's context gathered position by position, fp64 softmax (with the sink logit of each head as
    one more column, dropped after the softmax; scores softcapped first)."""
    out = []
    group = q.shape[1] // k_pool.shape[1]
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        pos = torch.arange(length)
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_pool[slots].double().repeat_interleave(group, 1)  # (L, H, Dk)
        v = v_pool[slots].double().repeat_interleave(group, 1)  # (L, H, Dv)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s[:, pos <= length - 1 - window] = float("-inf")
        if sinks is not None:
            p = torch.cat([s, sinks.double()[:, None]], -1).softmax(-1)[:, :-1]
        else:
            p = s.softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,splits,window,dtype", [
    (4, 4, 32, 16, 1, None, torch.float32),
    (4, 2, 32, 4, 3, None, torch.float32),
    (8, 2, 64, 16, 2, None, torch.bfloat16),
    (8, 1, 48, 8, 4, 7, torch.float16),
])
def test_decode_kernel_matches_reference(heads, kv_heads, head_dim, block_size, splits, window, dtype):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    blocks, batch = 48, 5
    k_pool = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:12] for _ in range(batch)]).int()
    # Odd lengths, block boundaries (exact multiples), a single key, a long one.
    context = torch.tensor([1, block_size, block_size + 1, 5 * block_size - 1, 12 * block_size], dtype=torch.int32)
    out = paged_decode(q, k_pool, v_pool, tables, context, block_size, head_dim**-0.5, window, splits=splits,
                       block_n=16)
    ref = reference_decode(q, k_pool, v_pool, tables, context, block_size, head_dim**-0.5, window)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel < (1e-6 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("k_dim,v_dim,sinks,softcap,splits,window,dtype", [
    (24, 12, True, None, 1, None, torch.float32),  # MLA widths (keys qk_nope + qk_rope, values v_head_dim), sinks
    (24, 12, True, None, 3, 5, torch.float32),  # ... split, with a window
    (16, 16, True, None, 2, None, torch.bfloat16),
    (16, 16, False, 1.5, 1, None, torch.float32),  # softcapping
    (32, 32, True, 2.0, 4, 7, torch.float32),  # both, split, windowed
])
def test_decode_kernel_with_sinks_softcap_and_mla_widths(k_dim, v_dim, sinks, softcap, splits, window, dtype):
    g = torch.Generator().manual_seed(k_dim + v_dim + splits)
    heads, kv_heads, block_size, blocks, batch = 4, 2, 4, 24, 4
    k_pool = torch.randn(blocks * block_size, kv_heads, k_dim, generator=g).to(dtype)
    v_pool = torch.randn(blocks * block_size, kv_heads, v_dim, generator=g).to(dtype)
    q = (2 * torch.randn(batch, heads, k_dim, generator=g)).to(dtype)  # scores of a few units: the cap bites
    sink = (3 * torch.randn(heads, generator=g)).to(dtype) if sinks else None
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in range(batch)]).int()
    context = torch.tensor([1, block_size, 5 * block_size - 1, 8 * block_size], dtype=torch.int32)
    out = paged_decode(q, k_pool, v_pool, tables, context, block_size, k_dim**-0.5, window, splits=splits,
                       block_n=8, sinks=sink, softcap=softcap)
    ref = reference_decode(q, k_pool, v_pool, tables, context, block_size, k_dim**-0.5, window, sink, softcap)
    plain = reference_decode(q, k_pool, v_pool, tables, context, block_size, k_dim**-0.5, window)
    assert out.shape == (batch, heads, v_dim) and out.dtype == dtype
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < (1e-6 if dtype == torch.float32 else 5e-3)
    assert ((plain - ref).norm() / ref.norm()).item() > 1e-2  # the features change the result


def test_split_count_heuristic():
    assert num_splits(256, 8, 4096, 132) == 1  # 2048 programs already fill the GPU
    assert num_splits(64, 8, 576, 132) == 1  # 512: three a multiprocessor already (one split measured faster)
    assert num_splits(16, 8, 4096, 132) == 8
    assert pipeline_stages(64, 128, 128, 2) == 3  # bf16 heads of 128: the measured configuration
    assert pipeline_stages(64, 256, 256, 2) == 2 and pipeline_stages(64, 128, 128, 4) == 2  # wider tiles as before
    assert num_splits(4, 8, 4096, 132) == 16  # few sequences: split the context
    assert num_splits(4, 8, 100, 132) == 1  # ...but never below 256 keys a split
    assert batch_ladder(256)[:6] == [1, 2, 4, 8, 16, 24] and batch_ladder(256)[-1] == 256
    assert batch_ladder(5) == [1, 2, 4, 5]


class _Cycle:
    """Cyclic garbage whose finalizer says whether it ran inside a ``no_collection`` block (GC off)."""

    def __init__(self, seen: list):
        self.me, self.seen = self, seen

    def __del__(self):
        self.seen.append(gc.isenabled())


def test_no_collection_pauses_the_collector():
    """The decode graphs capture inside ``no_collection``: no cyclic garbage made inside is finalized inside (a
    finalizer during a capture can invalidate it: Triton unloads a kernel's module), all of it is after, and the
    collector's state comes back, an exception's way out too."""
    seen: list = []
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 10**6, 10**6)  # the youngest generation on every allocation while enabled
    try:
        with no_collection():
            assert not gc.isenabled()
            for _ in range(100):
                _Cycle(seen)
                [object() for _ in range(10)]
            assert seen == []
        assert gc.isenabled()
        gc.collect()
        assert len(seen) == 100 and all(seen)
        with pytest.raises(RuntimeError), no_collection():
            raise RuntimeError("capture failed")
        assert gc.isenabled()
        gc.disable()
        with no_collection():
            pass
        assert not gc.isenabled()  # a caller's own pause is kept
        gc.enable()
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()


def triton_engine(model, **kw) -> Engine:
    cfg = dict(num_blocks=128, block_size=4, max_batch_tokens=64, seed=0, attention="triton", max_num_seqs=16)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


@pytest.mark.parametrize("make,multiprocessors,splits", [(tiny_llama, None, 1), (tiny_qwen3, 8, 2)])
def test_triton_engine_logprobs_and_padding(make, multiprocessors, splits, monkeypatch):
    """Mixed steps (eager, kernel + per-request prefill) and decode-only steps (the runner, at padded ladder
    sizes: 5 requests run at 8) give teacher-forced logprobs: with one split (the interpreter's plan) and with
    two (planned for eight multiprocessors: 8 sequences x 1 KV head, the runner's 512 keys) and their combine."""
    planned = record_returns(monkeypatch, TritonPagedBackend, "splits_for")
    model = make()
    engine = triton_engine(model)
    engine.backend.multiprocessors = multiprocessors or engine.backend.multiprocessors
    done = engine.generate(random_prompts([5, 11, 17, 2, 9]), SamplingParams(max_new_tokens=12, stop_token_ids=()))
    stats = engine.stats()
    assert stats["graph_steps"] >= 10 and engine.runner.graphs.keys() >= {8}
    assert splits in planned and max(planned) == splits
    assert max_logprob_diff(model, done) < 1e-4


def test_triton_engine_equals_reference_engine_tokens():
    """Greedy: the same tokens and logprobs as the pure-PyTorch engine, with chunked prefill, prefix sharing in
    groups, and preemption (12 blocks for 3 requests of up to 32 tokens)."""
    prompts = random_prompts([7, 13, 3])
    params = SamplingParams(max_new_tokens=16, n=2, temperature=0, stop_token_ids=())
    results = []
    for attention in ("torch", "triton"):
        engine = triton_engine(tiny_llama(), attention=attention, max_batch_tokens=8, num_blocks=12)
        results.append(engine.generate(prompts, params))
        if attention == "triton":
            assert engine.stats()["num_preemptions"] > 0 and engine.stats()["graph_steps"] > 0
    for a, b in zip(*results, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_greedy_triton_engine_equals_hf_generate():
    model = tiny_qwen3()
    engine = triton_engine(model, max_batch_tokens=16)
    prompts = random_prompts([3, 21, 40])
    done = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=()))
    for prompt, c in zip(prompts, done, strict=True):
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                             pad_token_id=0)
        assert c.token_ids == ref[0, len(prompt):].tolist()


def test_runner_follows_in_place_updates():
    """The runner reads the live parameters: after an in-place update, decode logprobs follow the new weights."""
    model = tiny_llama()
    engine = triton_engine(model, inflight_policy="recompute")
    prompts = random_prompts([6, 6])
    engine.generate(prompts, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.weights_updated(engine.version + 1)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=10, stop_token_ids=()))
    assert max_logprob_diff(model, done) < 1e-4


def test_fused_sampler_logprobs_greedy_and_distribution():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(4, 300, generator=g)
    temps = [1.0, 0.7, 0.0, 1.3]
    tokens, logprobs = fused_sample(logits, temps, [11, 12, 13, 14], block_v=128)  # several vocabulary tiles
    for i, t in enumerate(temps):
        ref = torch.log_softmax(logits[i] / (t or 1.0), -1)
        assert logprobs[i].item() == pytest.approx(ref[tokens[i]].item(), abs=1e-5)
    assert tokens[2] == logits[2].argmax()
    # Frequencies of 400 draws (one per seed) match softmax within ~3.5 standard errors.
    row = torch.tensor([0.0, 1.0, 2.0, -1.0] + [-30.0] * 60)
    n = 400
    drawn, _ = fused_sample(row.repeat(n, 1), [1.0] * n, list(range(n)), block_v=64)
    freq = torch.bincount(drawn, minlength=64).float() / n
    p = row.softmax(-1)
    assert ((freq - p).abs()[:4] <= 3.5 * (p * (1 - p) / n).sqrt()[:4] + 1e-3).all()
    # A row's draw depends only on its seed and logits, not on the rest of the batch.
    alone, _ = fused_sample(logits[1:2], [0.7], [12], block_v=128)
    assert alone[0] == tokens[1]


def test_fused_sampler_split_vocabulary_equals_one_part():
    """Splitting each row's vocabulary into parts, or into tiles of another width, changes neither the draw (a
    token's noise depends on its seed and index alone) nor (beyond fp32 summation order) the logprob, and a tie
    across parts goes to the lowest index, like argmax."""
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(5, 1000, generator=g)
    logits[4, [70, 650, 900]] = 50.0  # a greedy row whose maximum is tied in three parts
    temps, seeds = [1.0, 0.5, 2.0, 1.0, 0.0], [1, 2, 3, 4, 5]
    whole = FusedSampler(logits.device, block_v=64, target_programs=1)
    split = FusedSampler(logits.device, block_v=64, target_programs=64)  # 16 tiles: 16 parts of one tile
    wide = FusedSampler(logits.device, block_v=256, target_programs=8)
    (t1, l1), (t2, l2), (t3, l3) = whole(logits, temps, seeds), split(logits, temps, seeds), wide(logits, temps, seeds)
    assert torch.equal(t1, t2) and torch.equal(t1, t3)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    torch.testing.assert_close(l1, l3, atol=1e-5, rtol=0)
    assert t2[4] == 70
    assert not torch.equal(whole(logits, temps, [s + 1 for s in seeds])[0][:4], t1[:4])  # the seed matters


def test_seeded_requests_reproducible_regardless_of_batch_with_fused_sampler():
    prompt = random_prompts([6])[0]
    params = SamplingParams(max_new_tokens=8, n=2, seed=7, stop_token_ids=())
    alone = triton_engine(tiny_llama()).generate([prompt], params)
    crowd = triton_engine(tiny_llama()).generate(random_prompts([4, 9], seed=3) + [prompt], params)[-2:]
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowd]
    assert alone[0].token_ids != alone[1].token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_the_module(dtype):
    model = tiny_qwen3(dtype=dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    heads = torch.randn(3, 5, 4, 32, generator=g).to(dtype)  # q_norm over head_dim
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(torch.rand(64, generator=g) + 0.5)
        ref, ref_heads = layer.input_layernorm(x), layer.self_attn.q_norm(heads)
        with fused_norms(model) as count:
            assert count == 2 * 4 + 1  # per layer: input, post-attention, q_norm, k_norm; plus the final norm
            out, out_heads = layer.input_layernorm(x), layer.self_attn.q_norm(heads)
        assert "forward" not in layer.input_layernorm.__dict__  # restored after the block
    for a, b in ((out, ref), (out_heads, ref_heads)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        else:  # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): two roundings, 2 ulps
            assert ((a.float() - b.float()).abs() <= b.float().abs() * 2**-6 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_matches_transformers(dtype):
    """q and k as the attention forward hands them over (transposed views), cos and sin of the model's rotary
    embedding: the kernel equals transformers' function, and ``fused_rope`` swaps it in for the block only."""
    from transformers.models.qwen3 import modeling_qwen3

    model = tiny_qwen3(dtype=dtype)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 7, 4, 32, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, 7, 2, 32, generator=g).to(dtype).transpose(1, 2)
    positions = torch.tensor([[0, 1, 5, 9, 100, 3, 40]])
    cos, sin = model.model.rotary_emb(q, positions)
    original = modeling_qwen3.apply_rotary_pos_emb
    ref_q, ref_k = original(q, k, cos, sin)
    with fused_rope(model) as count:
        assert count == 1 and modeling_qwen3.apply_rotary_pos_emb is not original
        out_q, out_k = modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin)
        # Not covered (cos in another dtype): transformers' own function, unchanged.
        other_q, _ = modeling_qwen3.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    assert modeling_qwen3.apply_rotary_pos_emb is original
    assert other_q.dtype == torch.float64
    for out, ref, x in ((out_q, ref_q, q), (out_k, ref_k, k)):
        assert out.shape == ref.shape and out.stride() == ref.stride() and out.dtype == ref.dtype
        if dtype == torch.float32:
            assert torch.equal(out, ref)
        else:  # the interpreter truncates fp32 -> bf16 where the GPU rounds: an ulp of each term and of the sum
            terms = x.float().abs() + modeling_qwen3.rotate_half(x).float().abs()  # |cos|, |sin| <= 1
            assert ((out.float() - ref.float()).abs() <= 3 * 2.0**-7 * terms).all()
    direct_q, _ = rope(q, k, cos, sin)
    assert torch.equal(direct_q, out_q)


def test_write_kv_equals_index_copies():
    """The backend's one-kernel K/V write: what two index copies write, from strided inputs (keys as transformers
    lays them out, (N, KVH, D) views of (KVH, N, D)), other widths for values (MLA), nothing written elsewhere."""
    from unison.engine.triton_backend import write_kv
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 5, 16, generator=g).transpose(0, 1)  # (5, 3, 16), strided
    v = torch.randn(5, 3, 8, generator=g)
    slots = torch.tensor([7, 0, 12, 3, 9])
    pools = [torch.randn(16, 3, 16, generator=g), torch.randn(16, 3, 8, generator=g)]
    ref = [p.clone() for p in pools]
    ref[0].index_copy_(0, slots, k)
    ref[1].index_copy_(0, slots, v)
    assert write_kv(k, v, *pools, slots)
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])
    assert not write_kv(k.double(), v, *pools, slots)  # another dtype: the caller's index copies
