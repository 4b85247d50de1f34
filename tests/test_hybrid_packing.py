"""Packed training of hybrid models keeps samples apart in every layer, exactly: packed logprobs and gradients equal
per-sample forwards, and new tokens in one sample leave the other samples' logprobs bit-identical. The leak test
at startup (check_packed_attention) passes every family that is exact and refuses a layer that ignores boundaries."""

from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.nn.functional as F
from arch_models import FAMILIES, tiny
from conftest import tiny_llama, tiny_qwen3
from hybrid_models import HYBRIDS, tiny_hybrid

import unison.train.logprobs as logprobs_module
from unison.rollout.sample import Sample
from unison.train.boundaries import keep_samples_apart, segment_causal_conv1d
from unison.train.leak import check_packed_attention, experts_per_token
from unison.train.logprobs import policy_logprobs
from unison.train.packing import pack_samples

HYBRID_NAMES = list(HYBRIDS)
# (prompt, completion) lengths: samples longer than a Mamba chunk (8), a one-token completion, and a padding segment.
SHAPES = [(7, 9), (3, 12), (11, 1), (5, 6)]


def make_samples(seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(prompt_ids=tuple(rng.randrange(3, 256) for _ in range(p)),
                   completion_ids=tuple(rng.randrange(3, 256) for _ in range(c)),
                   engine_logprobs=(0.0,) * c, weight_versions=(0,) * c, reward=0.0, advantage=1.0)
            for p, c in SHAPES]


def packed_row(samples: list[Sample]):
    (row,) = pack_samples(samples, max_tokens_per_row=64, pad_id=0, pad_to=16)
    assert row.num_samples == 4 and len(row.cu_seqlens) == 6  # four samples and a padding segment
    return row


def own_logprobs(model, sample: Sample) -> torch.Tensor:
    """The model's own forward of the sample alone: log softmax of its logits at the completion tokens, (C,)."""
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.completion_ids)])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(sample.prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.completion_ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("family", HYBRID_NAMES)
def test_packed_logprobs_and_gradients_equal_per_sample(family):
    model = tiny_hybrid(family).train()  # as the step may run it: FalconH1's mixer then tries its fused path first
    samples = make_samples()
    row = packed_row(samples)
    packed, _ = policy_logprobs(model, row, chunk_size=5)
    probe = torch.randn(packed.shape, generator=torch.Generator().manual_seed(1))
    (packed * probe).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = torch.cat([own_logprobs(model, samples[k]) for k in row.sample_index])
    (alone * probe).sum().backward()
    assert (packed - alone).abs().max() < 1e-4
    checked = 0
    for name, p in model.named_parameters():
        if p.grad is None:  # an expert no token was routed to
            assert name not in packed_grads, name
            continue
        scale = p.grad.abs().max().clamp_min(1e-3)
        assert (packed_grads[name] - p.grad).abs().max() < 1e-4 * scale, name
        checked += 1
    assert checked > 20


def restore_transformers_functions(model, monkeypatch) -> list[str]:
    """Put transformers' own sequence functions back in the model's modeling module for the test."""
    names = keep_samples_apart(model)
    for qualified in names:
        module_name, name = qualified.rsplit(".", 1)
        module = sys.modules[module_name]
        monkeypatch.setattr(module, name, getattr(module, name).__wrapped__)
    return names


@pytest.mark.parametrize("family", HYBRID_NAMES)
@torch.no_grad()
def test_new_tokens_in_one_sample_leave_the_others_bit_identical(family, monkeypatch):
    model = tiny_hybrid(family)
    samples = make_samples()
    row = packed_row(samples)
    with experts_per_token(model):  # grouped expert matmuls regroup tokens: see unison.train.leak
        before = split(policy_logprobs(model, row)[0], row, samples)
    for k in range(len(samples)):  # every sample perturbed in turn: the others before and after it in the row
        changed = list(samples)
        s = samples[k]
        changed[k] = Sample(tuple((t + 7) % 253 + 3 for t in s.prompt_ids), tuple((t + 11) % 253 + 3 for t in
                            s.completion_ids), s.engine_logprobs, s.weight_versions, s.reward, s.advantage)
        new_row = packed_row(changed)
        assert new_row.sample_index == row.sample_index and torch.equal(new_row.cu_seqlens, row.cu_seqlens)
        with experts_per_token(model):
            after = split(policy_logprobs(model, new_row)[0], row, samples)
        assert not torch.equal(before[k], after[k])
        for j in range(len(samples)):
            if j != k:
                assert torch.equal(before[j], after[j]), f"sample {k}'s tokens changed sample {j}'s logprobs"
    # Control: transformers' own functions run the conv and the scan across the boundaries, or refuse them.
    restore_transformers_functions(model, monkeypatch)
    monkeypatch.setattr(logprobs_module, "keep_samples_apart", lambda m: [])  # or it installs unison's again
    if family.startswith("qwen3"):
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            policy_logprobs(model, row)
    else:
        leaky = split(policy_logprobs(model, row)[0], row, samples)
        assert max((leaky[j] - before[j]).abs().max() for j in range(len(samples))) > 1e-3


def split(logprobs: torch.Tensor, row, samples) -> dict[int, torch.Tensor]:
    parts = logprobs.split([len(samples[i].completion_ids) for i in row.sample_index])
    return dict(zip(row.sample_index, parts, strict=True))


EXACT = {**{f: lambda f=f: tiny(f)[0] for f in FAMILIES}, "llama": tiny_llama, "qwen3": tiny_qwen3,
         **{f: lambda f=f: tiny_hybrid(f) for f in HYBRID_NAMES}}


@pytest.mark.parametrize("family", list(EXACT))
def test_leak_check_passes_every_exact_family(family):
    model = EXACT[family]()
    experts = model.get_experts_implementation()
    check_packed_attention(model)
    if family in HYBRIDS:  # FalconH1's mixer runs another path in training mode
        check_packed_attention(model.train())
    assert model.get_experts_implementation() == experts  # given back after the per-token experts of the check


def test_leak_check_refuses_a_conv_that_ignores_boundaries(monkeypatch):
    import transformers.models.lfm2.modeling_lfm2 as lfm2

    model = tiny_hybrid("lfm2")
    own = restore_transformers_functions(model, monkeypatch)
    assert own == ["transformers.models.lfm2.modeling_lfm2.causal_conv1d_fn"]
    conv = lfm2.causal_conv1d_fn
    # A conv written against another signature: unison leaves it alone, and it runs across the boundaries.
    monkeypatch.setattr(lfm2, "causal_conv1d_fn", lambda x, w, b=None, act=None, **kw: conv(x, w, b, act))
    with pytest.raises(RuntimeError, match=r"Lfm2ForCausalLM's packed forward leaks across samples: new tokens in "
                                           r"sample 1 .* sample\(s\) \[2\]"):
        check_packed_attention(model)


def test_segment_conv_equals_each_segment_alone_with_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 20, generator=g, requires_grad=True)
    weight = torch.randn(6, 4, generator=g, requires_grad=True)
    bias = torch.randn(6, generator=g, requires_grad=True)
    cu = torch.tensor([0, 1, 9, 12, 20], dtype=torch.int32)  # a one-token segment, one shorter than the kernel
    out = segment_causal_conv1d(x, weight, bias, cu)
    ref = torch.cat([F.conv1d(x[:, :, s:e], weight[:, None], bias, padding=3, groups=6)[:, :, :e - s]
                     for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)], 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    probe = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * probe).sum(), (x, weight, bias))
    ref_grads = torch.autograd.grad((ref * probe).sum(), (x, weight, bias))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    whole = F.conv1d(x, weight[:, None], bias, padding=3, groups=6)[:, :, :20]
    assert (whole - ref).abs().max() > 0.1  # without the boundaries the windows would differ


def test_only_hybrid_layers_are_replaced():
    assert keep_samples_apart(tiny_llama()) == []
    names = keep_samples_apart(tiny_hybrid("falcon_h1"))
    assert [n.rsplit(".", 1)[1] for n in names] == ["causal_conv1d_fn", "mamba2_chunk_scan",
                                                    "mamba2_split_conv1d_scan_combined"]
