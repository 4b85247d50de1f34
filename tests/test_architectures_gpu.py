"""Sinks, MLA widths and softcapping at bf16 on a CUDA GPU, whole models: the engine's logprobs and the packed
training forward sit at the bf16 floor, i.e. no further from an fp32 eager forward of the same weights than a
plain bf16 eager forward is (run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

import copy

import pytest
import torch
from arch_models import tiny
from conftest import random_prompts, teacher_forced_logprobs

from unison.engine import NO_MASK, Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "gemma2"])
def test_engine_and_packed_forward_at_the_bf16_floor(family):
    model, eager = tiny(family)
    engine = assert_at_the_bf16_floor(family, model, eager)
    assert type(engine.backend).__name__ == "TritonPagedBackend"


def assert_at_the_bf16_floor(family: str, model, eager, device: str = "cuda") -> Engine:
    """The engine's sampled logprobs (a few prompts, a group of 2 each) and the packed training forward's logits,
    each no further from an fp32 eager forward of the same weights than a bf16 eager forward is (2x and 1e-3 of
    slack). ``model``: on the unison attention, fp32 (moved to ``device`` in bf16 here); ``eager``: the same weights
    on eager attention. Returns the engine."""
    ref32 = eager.to(device)
    eager16 = copy.deepcopy(eager).to(torch.bfloat16)
    model = model.to(device, torch.bfloat16)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=16, max_batch_tokens=64, seed=0))
    done = engine.generate(random_prompts([7, 40, 100], seed=8), SamplingParams(max_new_tokens=24, n=2,
                                                                                 stop_token_ids=()))
    gap, floor = [], []
    for c in done:
        ref = teacher_forced_logprobs(ref32, c.prompt_ids, c.token_ids)
        gap.append((torch.tensor(c.logprobs) - ref).abs())
        floor.append((teacher_forced_logprobs(eager16, c.prompt_ids, c.token_ids) - ref).abs())
    gap, floor = torch.cat(gap), torch.cat(floor)
    print(f"{family} engine logprobs vs fp32 eager: mean {gap.mean():.2e} max {gap.max():.2e}; "
          f"bf16 eager: mean {floor.mean():.2e} max {floor.max():.2e}")
    assert gap.mean() <= 2 * floor.mean() + 1e-3

    lengths = [60, 1, 130, 33]
    ids = torch.randint(3, 256, (1, sum(lengths)), device=device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    with torch.no_grad():
        packed = model(ids, position_ids=pos, attention_mask=NO_MASK, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(lengths), max_length_k=max(lengths), use_cache=False).logits[0].float()
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
        ref = torch.cat([ref32(ids[:, a:b]).logits[0] for a, b in bounds])
        plain = torch.cat([eager16(ids[:, a:b]).logits[0].float() for a, b in bounds])
    gap, floor = (packed - ref).abs(), (plain - ref).abs()
    print(f"{family} packed logits vs fp32 eager: mean {gap.mean():.2e} max {gap.max():.2e}; "
          f"bf16 eager: mean {floor.mean():.2e} max {floor.max():.2e}")
    assert gap.mean() <= 2 * floor.mean() + 1e-3
    return engine


@pytest.mark.parametrize("splits", [1, 4])
def test_mla_latent_decode_kernel_at_the_deepseek_shape(splits):
    """The compiled latent-cache kernel at DeepSeek's widths (512 latent + 64 rope, 16 heads) in bf16, against the
    reference in fp32 on the same bf16 inputs: no further than the bf16 rounding of the output."""
    from unison.engine.backend import StepLayout, TorchPagedBackend
    from unison.engine.triton_mla import mla_decode

    g = torch.Generator(device="cuda").manual_seed(9)
    block_size, heads, rank, rope, blocks = 16, 16, 512, 64, 400
    kv = torch.randn(blocks * block_size, 1, rank + rope, generator=g, device="cuda").to(torch.bfloat16)
    ctx = [1, 17, 300, 1000, 2048, 77]
    tables = torch.stack([torch.randperm(blocks, device="cuda", generator=g)[:128] for _ in ctx])
    q = torch.randn(len(ctx), heads, rank + rope, generator=g, device="cuda").to(torch.bfloat16)
    scale = (128 + 64) ** -0.5
    layout = StepLayout(list(range(len(ctx) + 1)), ctx, tables.tolist(), torch.zeros(len(ctx), dtype=torch.int64))
    ref_backend = TorchPagedBackend(block_size, torch.device("cuda"))
    ref = ref_backend.attend(ref_backend.prepare(layout), kv.float(), kv[..., :rank].float(), q.float(), scale, None)
    out = mla_decode(q, kv, rank, tables.to(torch.int32), torch.tensor(ctx, dtype=torch.int32, device="cuda"),
                     block_size, scale, splits=splits)
    err = (out.float() - ref).abs().max().item()
    rounding = (ref.to(torch.bfloat16).float() - ref).abs().max().item()
    print(f"mla_decode splits={splits}: max error {err:.2e}, bf16 rounding of the output {rounding:.2e}")
    assert err <= 4 * rounding + 1e-3
