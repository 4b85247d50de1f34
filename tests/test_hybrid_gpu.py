"""Hybrid models at bf16 on a CUDA GPU (``pytest -m gpu``): the engine's state pool through flash-linear-attention's
kernels (varlen chunks from per-request initial states, batched one-token decode) and the CUDA-graph decode step,
whole models at the bf16 floor; the varlen kernel path against the per-request PyTorch reference."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import sys

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs
from hybrid_models import tiny_hybrid

from unison.engine import NO_MASK, Engine, EngineConfig, SamplingParams
from unison.engine.state import StateLayer, StatePool, StepStates

pytestmark = pytest.mark.gpu
FLA = importlib.util.find_spec("fla") is not None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "lfm2", "falcon_h1"])
def test_engine_and_packed_forward_at_the_bf16_floor(family):
    eager = tiny_hybrid(family, attn="eager")
    ref32 = eager.cuda()
    eager16 = copy.deepcopy(eager).to(torch.bfloat16)
    model = tiny_hybrid(family).to("cuda", torch.bfloat16)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=16, max_batch_tokens=64, seed=0))
    assert engine.runner is not None  # decode steps through the CUDA graphs, the states' slots in their inputs
    done = engine.generate(random_prompts([7, 40, 100], seed=8), SamplingParams(max_new_tokens=24, n=2,
                                                                                 stop_token_ids=()))
    assert engine.stats()["graph_steps"] > 0 and engine.stats()["prefix_cache_hit_rate"] > 0
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
    ids = torch.randint(3, 256, (1, sum(lengths)), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
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


@pytest.mark.skipif(not FLA, reason="flash-linear-attention (the unison[hybrid] extra) is not installed")
@pytest.mark.parametrize("single", [False, True])
def test_gated_delta_kernels_from_per_request_states_match_the_reference(single):
    """flash-linear-attention's varlen chunk kernel (and its one-token recurrent kernel) from per-request initial
    states, against transformers' PyTorch bodies one request at a time: outputs and final states."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    model = tiny_hybrid("qwen3_5")
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    chunk = inspect.unwrap(module.torch_chunk_gated_delta_rule)  # transformers' PyTorch bodies
    recurrent = inspect.unwrap(module.torch_recurrent_gated_delta_rule)
    lengths = [1] * 5 if single else [37, 1, 64, 130, 5]
    heads_k, heads_v, dk, dv, n = 2, 4, 64, 64, sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k = rand(1, n, heads_k, dk).bfloat16(), rand(1, n, heads_k, dk).bfloat16()
    v = rand(1, n, heads_v, dv).bfloat16()
    gate = -torch.rand(1, n, heads_v, device="cuda", generator=g) * 0.5
    beta = torch.rand(1, n, heads_v, device="cuda", generator=g).bfloat16()
    layer = StateLayer(0, "gated_delta", 8, 4, (heads_v, dk, dv))
    results = []
    for kernel in (True, False):
        pool = StatePool([layer], len(lengths) + 2, torch.device("cuda"))
        pool.recurrent[0].copy_(torch.randn(pool.recurrent[0].shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(1)) * 0.1)
        slots = torch.tensor([4, 0, 2, 1, 3][:len(lengths)], device="cuda")
        fresh = torch.tensor([False, True, False, False, False][:len(lengths)], device="cuda")
        states = StepStates(pool, slots, fresh, lengths)
        out, _ = states.gated_delta(0, q, k, v, gate, beta, 64, True, chunk_gated_delta_rule if kernel else chunk,
                                    fused_recurrent_gated_delta_rule if kernel else recurrent, kernel)
        results.append((out.float(), pool.recurrent[0].clone()))
    (out_k, st_k), (out_r, st_r) = results
    err_out = (out_k - out_r).abs().max().item() / out_r.abs().max().item()
    err_state = (st_k - st_r).abs().max().item() / st_r.abs().max().item()
    print(f"gated delta kernels vs reference ({'decode' if single else 'varlen'}): output {err_out:.2e}, "
          f"final states {err_state:.2e} (relative to the largest)")
    assert err_out < 2e-2 and err_state < 2e-2
