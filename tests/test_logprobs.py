"""The chunked lm_head equals a full-logits reference: values, entropy, and gradients (tied and untied)."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import unison.engine.attention  # noqa: F401  (registers attn_implementation="unison")
from unison.engine.attention import NO_MASK
from unison.engine.lm_head import IDENTITY, HeadTransform
from unison.rollout.sample import Sample
from unison.train.logprobs import chunked_logprobs, full_logprobs_reference, policy_logprobs
from unison.train.packing import pack_samples

TEMPERATURE = 0.7


# Granite's logits_scaling = 4, Gemma2's final softcap (3 saturates logits of std ~4), and both (MuseSpark).
TRANSFORMS = [IDENTITY, HeadTransform(scale=0.25), HeadTransform(softcap=3.0), HeadTransform(scale=0.5, softcap=3.0)]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=["plain", "scale", "softcap", "scale+softcap"])
@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_chunked_equals_reference_with_grads(chunk_size, transform):
    torch.manual_seed(0)
    m, h, v = 37, 16, 50  # chunk 8 does not divide 37; chunk 64 is one chunk
    hidden = torch.randn(m, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (m,))
    upstream = torch.randn(m)

    logp, entropy = chunked_logprobs(hidden, weight, targets, TEMPERATURE, chunk_size, with_entropy=True,
                                     transform=transform)
    (logp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = full_logprobs_reference(hidden, weight, targets, TEMPERATURE, transform)
    (ref_logp * upstream).sum().backward()

    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == entropy.shape == (m,)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad  # documented as detached
    assert grads[1].abs().max() > 0.1  # a real gradient, not two zeros agreeing
    if not transform.is_identity:  # ... and the transform really changes the logprobs
        assert (logp - full_logprobs_reference(hidden, weight, targets, TEMPERATURE)[0]).abs().max() > 0.1


def test_identity_transform_adds_no_operation():
    x = torch.randn(3, 5)
    assert IDENTITY.apply_(x) is x and IDENTITY.is_identity
    torch.testing.assert_close(HeadTransform(scale=0.5).apply_(x.clone(), inv_temp=2.0), x, rtol=0, atol=0)


def test_temperature_changes_logprobs():
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(5, 8), torch.randn(20, 8), torch.randint(0, 20, (5,))
    cold, _ = chunked_logprobs(hidden, weight, targets, temperature=0.5)
    plain = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    hot = torch.log_softmax(hidden @ weight.T / 0.5, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(cold, hot, rtol=0, atol=1e-5)
    assert (cold - plain).abs().max() > 0.1
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, targets, temperature=0.0)


def test_bf16_weight_gives_fp32_logprobs_close_to_fp32():
    torch.manual_seed(2)
    hidden, weight, targets = torch.randn(9, 16), torch.randn(40, 16) * 0.3, torch.randint(0, 40, (9,))
    logp, _ = chunked_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=4)
    ref, _ = full_logprobs_reference(hidden, weight, targets)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref, rtol=0, atol=0.1)


def tiny_llama(tied: bool) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tied)
    torch.manual_seed(3)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32)


def packed_row(vocab: int):
    rng = random.Random(4)
    samples = []
    for p, c in [(5, 9), (3, 7), (6, 4)]:
        samples.append(Sample(prompt_ids=tuple(rng.randrange(vocab) for _ in range(p)),
                              completion_ids=tuple(rng.randrange(vocab) for _ in range(c)),
                              engine_logprobs=(0.0,) * c, weight_versions=(0,) * c, reward=0.0, advantage=1.0))
    (row,) = pack_samples(samples, max_tokens_per_row=64, pad_id=0)
    return row


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_policy_logprobs_grads_equal_full_logits(tied):
    model = tiny_llama(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    row = packed_row(model.config.vocab_size)
    m = row.num_loss_tokens  # 20, not a multiple of the chunk size
    upstream = torch.linspace(-1.0, 1.0, m)

    logp, entropy = policy_logprobs(model, row, temperature=TEMPERATURE, chunk_size=6, with_entropy=True)
    (logp * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    logits = model(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=NO_MASK,
                   cu_seq_lens_q=row.cu_seqlens, cu_seq_lens_k=row.cu_seqlens,
                   max_length_q=row.max_seqlen, max_length_k=row.max_seqlen).logits[0]
    log_probs = torch.log_softmax(logits[row.loss_mask].float() / TEMPERATURE, -1)
    ref = log_probs.gather(1, row.targets[row.loss_mask, None]).squeeze(1)
    (ref * upstream).sum().backward()

    assert logp.shape == (m,) and entropy.shape == (m,)
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1).detach(), rtol=0, atol=1e-5)
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    # With tied weights the one Parameter carries both the lm_head and the embedding contributions.
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert grads[head].abs().max() > 0


def test_policy_logprobs_under_no_grad():
    model = tiny_llama(tied=False)
    row = packed_row(model.config.vocab_size)
    with torch.no_grad():
        logp, entropy = policy_logprobs(model, row, chunk_size=7)
    assert entropy is None and not logp.requires_grad and logp.shape == (row.num_loss_tokens,)
    assert (logp <= 0).all()
