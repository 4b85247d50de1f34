"""Families whose attention is more than plain causal SDPA, against the same weights on transformers' eager
attention: GptOss (attention sinks, sliding window), DeepSeek-V3 and V2 (MLA: keys and values of different
widths), Gemma2 (attention logit softcapping, query_pre_attn_scalar), Cohere2 (sliding RoPE layer), Granite
(attention_multiplier as ``scaling``). Through the engine (chunked prefill, preemption, prefix sharing), the
packed training forward with its gradients, and the plain forward."""

from __future__ import annotations

import pytest
import torch
from arch_models import FAMILIES, tiny
from conftest import random_prompts, teacher_forced_logprobs

from unison.engine import NO_MASK, Engine, EngineConfig, SamplingParams
from unison.engine.cache import KVPool, kv_widths

FAMILY_NAMES = list(FAMILIES)


def small_engine(model, **kw) -> Engine:
    # 12 blocks of 4 tokens for 6 requests of up to 30 tokens: preemption; 16 tokens a step: chunked prefill.
    cfg = dict(num_blocks=12, block_size=4, max_batch_tokens=16, seed=0, attention="torch")
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_logprobs_equal_eager_through_chunking_and_preemption(family):
    model, eager = tiny(family)
    engine = small_engine(model)
    prompts = random_prompts([10, 7, 3, 9, 5, 8], seed=1)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=20, n=1, stop_token_ids=()))
    assert engine.stats()["num_preemptions"] > 0
    assert all(len(c.token_ids) == 20 for c in done)
    diff = max((teacher_forced_logprobs(eager, c.prompt_ids, c.token_ids) - torch.tensor(c.logprobs)).abs().max()
               for c in done)
    assert diff < 1e-4, f"{family}: engine logprobs {diff:.2e} from eager"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_greedy_equals_eager_generate(family):
    model, eager = tiny(family)
    engine = small_engine(model, num_blocks=64)
    prompts = random_prompts([3, 21, 14], seed=2)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=16, n=2, temperature=0, stop_token_ids=()))
    for i, prompt in enumerate(prompts):
        ref = eager.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert done[2 * i].token_ids == ref and done[2 * i + 1].token_ids == ref  # the second shares the prefix


def _packed(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_forward_and_gradients_equal_eager_per_sample(family):
    model, eager = tiny(family)
    model.train(), eager.train()  # dropout is 0 in these configs; training mode as the trainer runs it
    lengths = [11, 1, 17, 6]  # longer than the sliding window (8), a one-token segment
    ids, pos, cu = _packed(lengths)
    probe = torch.randn(sum(lengths), 256, generator=torch.Generator().manual_seed(4))
    packed = model(ids, position_ids=pos, attention_mask=NO_MASK, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=max(lengths), max_length_k=max(lengths), use_cache=False).logits[0]
    (packed * probe).sum().backward()
    loss = 0.0
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = eager(ids[:, start:end], use_cache=False).logits[0]
        assert (packed[start:end] - alone).abs().max() < 1e-4
        loss = loss + (alone * probe[start:end]).sum()
    loss.backward()
    grads = dict(eager.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        ref = grads[name].grad
        if ref is None:  # e.g. experts no token was routed to
            assert p.grad is None or not p.grad.any(), name
            continue
        scale = ref.abs().max().clamp_min(1e-3)
        assert ((p.grad - ref).abs().max() / scale) < 1e-4, f"{family}: gradient of {name}"
        checked += 1
    assert checked > 10
    if family == "gpt_oss":  # the sinks are trained: a real gradient, equal to eager's
        sinks = [p.grad for n, p in model.named_parameters() if n.endswith("sinks")]
        assert len(sinks) == 2 and all(g.abs().max() > 1e-3 for g in sinks)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_plain_forward_with_padding_equals_eager(family):
    model, eager = tiny(family)
    ids = torch.randint(3, 256, (2, 13))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :5] = 0
    a = model(ids, attention_mask=mask).logits
    b = eager(ids, attention_mask=mask).logits
    assert (a[0] - b[0]).abs().max() < 1e-5 and (a[1, 5:] - b[1, 5:]).abs().max() < 1e-5


def test_the_features_bite():
    """Without the sinks or the softcapping the same weights give other logits: the tests above could fail."""
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    model, eager = tiny("gpt_oss")
    ref = eager(ids).logits
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert (eager(ids).logits - ref).abs().max() > 1e-2
    model, eager = tiny("gemma2")
    ref = eager(ids).logits
    eager.config.attn_logit_softcapping = None
    for layer in eager.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (eager(ids).logits - ref).abs().max() > 1e-2


def test_kv_widths_of_mla_and_plain_configs():
    model, _ = tiny("deepseek_v3")
    text = model.config.get_text_config()
    assert [(x.kv_heads, x.key_dim, x.value_dim) for x in kv_widths(text, mla_cache="expanded")] == [(4, 24, 12)] * 2
    assert kv_widths(text, tp=2, mla_cache="expanded")[0].kv_heads == 2
    assert kv_widths(text, tp=2)[0].kv_heads == 1  # the latent: one row per token on every rank
    gpt, _ = tiny("gpt_oss")
    assert [(x.kv_heads, x.key_dim, x.value_dim) for x in kv_widths(gpt.config)] == [(2, 16, 16)] * 2
    with pytest.raises(ValueError, match="tensor-parallel size 4"):
        kv_widths(gpt.config, tp=4)
    pool = KVPool(3, 4, kv_widths(text, mla_cache="expanded"), torch.float32, torch.device("cpu"))
    assert pool.k[1].shape == (12, 4, 24) and pool.v[1].shape == (12, 4, 12)
    assert pool.nbytes == 2 * 12 * 4 * (24 + 12) * 4
    pool.v[0].fill_(1.0)  # views do not overlap
    assert not pool.k[0].any() and not pool.k[1].any() and not pool.v[1].any()
