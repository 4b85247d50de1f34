"""LoRA through the GPU engine (Triton kernels, CUDA graphs): fp32 exact against the model's own forward, and the
captured decode graphs read the adapters' new values after an optimizer step (run with ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_engine_gpu import gpu_qwen3, logprob_diffs

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.lora import LoraConfig, apply_lora
from unison.train.optimizer import MasterAdamW, OptimConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lora_weights", ["unmerged", "merged"])
def test_gpu_engine_decodes_through_adapters_across_updates(lora_weights):
    model = gpu_qwen3(torch.float32)
    torch.manual_seed(0)
    apply_lora(model, LoraConfig(r=8, alpha=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    engine = Engine(model, EngineConfig(num_blocks=256, block_size=16, max_batch_tokens=256, seed=0,
                                        lora_weights=lora_weights))
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-2), total_steps=3)
    params = SamplingParams(max_new_tokens=32, n=2, stop_token_ids=())
    for version in range(2):
        done = engine.generate(random_prompts([7, 40, 90], vocab=4096, seed=version), params)
        assert engine.stats()["graph_steps"] > 0
        assert logprob_diffs(model, done).max() < 1e-3, version  # the graphs replay the current adapters
        ids = torch.randint(3, 4096, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(version))
        model(ids, labels=ids).loss.backward()
        assert opt.step().changed_fraction > 0
        opt.zero_grad()
        engine.weights_updated(version + 1)
