"""Programmatic dependent launch (``unison.engine.gdc``) on a CUDA GPU: the engine's decode, whose kernels start
before the kernel in front of them has finished, computes the same bits as with every kernel waiting its turn."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from transformers import Qwen3Config, Qwen3ForCausalLM

from unison.engine import Engine, EngineConfig, SamplingParams, gdc

pytestmark = pytest.mark.gpu


def _model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                      eos_token_id=2)
    with torch.device("cuda"):
        return Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).eval()


def _generate(model, monkeypatch, pdl: str):
    monkeypatch.setenv("UNISON_PDL", pdl)
    engine = Engine(model, EngineConfig(num_blocks=512, block_size=16, max_batch_tokens=1024, seed=0))
    done = engine.generate(random_prompts([5, 40, 130, 300, 77, 9, 260, 18] * 3, vocab=4096),
                           SamplingParams(max_new_tokens=150, stop_token_ids=()))
    return engine, done


def test_dependent_launches_change_no_bit(monkeypatch):
    """Sampled tokens and their logprobs, bit for bit, with and without programmatic launches: a kernel that read
    what the kernel before it had yet to write would change them. 24 requests of 5-300 prompt tokens, 150 new each:
    decode graphs of several batch sizes, replayed many times, and contexts past the prefetched first keys."""
    model = _model()
    assert torch.cuda.get_device_capability() >= (9, 0), "programmatic launch needs Hopper or later"
    monkeypatch.setenv("UNISON_PDL", "1")
    assert gdc.enabled(next(model.parameters()))
    engine, on = _generate(model, monkeypatch, "1")
    assert engine.stats()["graph_steps"] > 100
    _, off = _generate(model, monkeypatch, "0")
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert [c.logprobs for c in on] == [c.logprobs for c in off]
