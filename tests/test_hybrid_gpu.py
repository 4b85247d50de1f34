"""Hybrid models at bf16 on a CUDA GPU (``pytest -m gpu``): the engine's state pool through flash-linear-attention's
kernels (varlen chunks from per-request initial states, batched one-token decode) and the CUDA-graph decode step,
whole models at the bf16 floor; the varlen kernel path against the per-request PyTorch reference."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from hybrid_models import tiny_hybrid
from test_architectures_gpu import assert_at_the_bf16_floor

from unison.engine.state import StateLayer, StatePool, StepStates
from unison.train.boundaries import pytorch_body

pytestmark = pytest.mark.gpu
FLA = importlib.util.find_spec("fla") is not None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "lfm2", "falcon_h1"])
def test_engine_and_packed_forward_at_the_bf16_floor(family):
    engine = assert_at_the_bf16_floor(family, tiny_hybrid(family), tiny_hybrid(family, attn="eager"))
    # Decode steps ran through the CUDA graphs (the states' slots in their inputs), the groups forked.
    assert engine.runner is not None and engine.stats()["graph_steps"] > 0
    assert engine.stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.skipif(not FLA, reason="flash-linear-attention (the unison[hybrid] extra) is not installed")
@pytest.mark.parametrize("single", [False, True])
def test_gated_delta_kernels_from_per_request_states_match_the_reference(single):
    """flash-linear-attention's varlen chunk kernel (and its one-token recurrent kernel) from per-request initial
    states, against transformers' PyTorch bodies one request at a time: outputs and final states."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    model = tiny_hybrid("qwen3_5")
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    chunk = pytorch_body(module.torch_chunk_gated_delta_rule)  # transformers' PyTorch bodies
    recurrent = pytorch_body(module.torch_recurrent_gated_delta_rule)
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
