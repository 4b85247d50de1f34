"""Steps with prompt chunks as graph rows (unison.engine.row_graphs) on a CUDA GPU in bf16 (``pytest -m gpu``):
captured, replayed, and as close to the fp32 model as the eager prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, record_returns, teacher_forced_logprobs
from transformers import Qwen3Config, Qwen3ForCausalLM

from unison.engine import Engine, EngineConfig, SamplingParams, row_graphs
from unison.engine.graphs import DecodeRunner

pytestmark = pytest.mark.gpu


def test_row_graphs_at_the_bf16_floor(monkeypatch):
    """The 0.6B heads (16 query, 8 KV, 128 wide), a GRPO rollout's shape (8 prompts x 8 samples) and a second turn
    appended to each: with the row graphs on, the prompts and the appended turns run as rows (several graph sizes,
    each captured once and replayed), and the logprobs' gap to the fp32 model's teacher-forced ones is the eager
    prefill's. Every graph step's logits are rows of the decode runner's one buffer (replayed or capturing)."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                      eos_token_id=2)
    with torch.device("cuda"):
        ref = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(ref.state_dict())
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=8, stop_token_ids=())
    gaps, stats, one_buffer = {}, {}, []
    decoded = record_returns(monkeypatch, DecodeRunner)
    rowed = record_returns(monkeypatch, row_graphs.RowRunner)
    for rows in (True, False):
        monkeypatch.setenv("UNISON_ROW_GRAPHS", "1" if rows else "0")
        monkeypatch.setenv("UNISON_PIECE_GRAPHS", "0")  # the rows against the eager step (not the graph pieces')
        engine = Engine(model, EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=64, seed=0))
        for prompt in random_prompts([64] * 8, vocab=4096, seed=1):
            engine.submit(prompt, params, continuable=True)
        done, ended = [], []
        for turn in range(3):  # the third turn replays the graphs the second captured
            for c, tool in zip(ended, random_prompts([2 + i % 5 for i in range(len(ended))], vocab=4096,
                                                     seed=turn), strict=True):
                engine.extend(c.request_id, tool, SamplingParams(max_new_tokens=24, stop_token_ids=()))
            ended = []
            while engine.num_unfinished:
                ended += engine.step()
            done += ended
        stats[rows] = engine.stats()
        one_buffer.append({out.untyped_storage().data_ptr() for out in decoded + rowed}
                          == {engine.runner.logits.untyped_storage().data_ptr()})
        decoded.clear()
        rowed.clear()
        gaps[rows] = torch.cat([(teacher_forced_logprobs(ref, c.prompt_ids, c.token_ids)
                                 - torch.tensor(c.logprobs)).abs() for c in done]).mean().item()
    print(f"mean |engine - fp32| rows {gaps[True]:.3e}, eager {gaps[False]:.3e}; row steps "
          f"{stats[True]['row_graph_steps']}, graphs {stats[True]['graphs_captured']} against "
          f"{stats[False]['graphs_captured']}")
    assert stats[True]["row_graph_steps"] >= 3 and stats[False]["row_graph_steps"] == 0
    assert stats[True]["graphs_captured"] > stats[False]["graphs_captured"]
    assert one_buffer == [True, True]
    assert gaps[True] < 1.25 * gaps[False] + 1e-4


def test_row_graphs_on_by_default_on_the_gpu(monkeypatch):
    """Unset, ``UNISON_ROW_GRAPHS`` leaves the rows on where the engine captures graphs; ``0`` turns them off."""
    model = Qwen3ForCausalLM._from_config(Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=64),
                                          attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
    monkeypatch.delenv("UNISON_ROW_GRAPHS", raising=False)
    assert Engine(model, EngineConfig(num_blocks=64, block_size=16)).rows is not None
    monkeypatch.setenv("UNISON_ROW_GRAPHS", "0")
    assert Engine(model, EngineConfig(num_blocks=64, block_size=16)).rows is None
