"""Lending the KV pool through CUDA virtual memory, and host-placed optimizer state, on a GPU (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_engine_gpu import gpu_qwen3, logprob_diffs
from test_optimizer import make_params, set_grads

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.state_store import HostStore

pytestmark = pytest.mark.gpu


def test_lending_frees_the_pool_and_keeps_graphs():
    model = gpu_qwen3(torch.bfloat16)
    engine = Engine(model, EngineConfig(num_blocks=32768, block_size=16, seed=0))  # 1 GiB of KV
    assert engine.pool.fixed_address
    prompts = random_prompts([20, 64, 7], vocab=4096)
    params = SamplingParams(max_new_tokens=60, n=2, stop_token_ids=())
    for p in prompts:
        engine.submit(p, params)
    for _ in range(20):
        engine.step()
    graphs, address = dict(engine.runner.graphs), engine.pool.storage.data_ptr()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    with engine.lend() as lent:
        freed = torch.cuda.mem_get_info()[0] - free_before
        borrowed = torch.empty(lent, dtype=torch.uint8, device="cuda")  # the training step uses it
        borrowed.fill_(7)
        del borrowed
    print(f"lent {lent / 2**30:.2f} GiB, device free memory rose by {freed / 2**30:.2f} GiB")
    assert freed >= 0.95 * lent
    assert engine.pool.storage.data_ptr() == address
    done = []
    while engine.num_unfinished:
        done += engine.step()
    assert all(engine.runner.graphs[b] is g for b, g in graphs.items())  # kept and replayed, not recaptured
    diff = logprob_diffs(model, done)
    assert diff.mean() < 2e-2 and diff.max() < 0.5


def test_host_placement_bit_identical_on_gpu():
    cfg = OptimConfig(lr=1e-4, weight_decay=0.01, max_grad_norm=1.0)
    a = {n: torch.nn.Parameter(p.cuda()) for n, p in make_params(torch.bfloat16).items()}
    b = {n: torch.nn.Parameter(p.cuda()) for n, p in make_params(torch.bfloat16).items()}
    gpu_opt = MasterAdamW(a.items(), cfg, total_steps=10)
    host_opt = MasterAdamW(b.items(), cfg, total_steps=10, store=HostStore(chunk_numel=100, in_flight=2))
    for step in range(10):
        for params in (a, b):
            set_grads(params, step, 1.0)
        gpu_opt.step()
        host_opt.step()
    for name in a:
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name
        assert torch.equal(gpu_opt.state[name].master.cpu(), host_opt.state[name].master)
    assert host_opt.state["w1"].master.is_pinned()
