"""Eager steps as graph pieces (unison.engine.piece_graphs) on a CUDA GPU in bf16 (``pytest -m gpu``): captured piece
by piece, replayed, and as close to the fp32 model as the eager step."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs
from transformers import Qwen3Config, Qwen3ForCausalLM

from unison.engine import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu


def test_piece_graphs_at_the_bf16_floor(monkeypatch):
    """The 0.6B heads (16 query, 8 KV, 128 wide), 24 prompts of 100-400 tokens under a budget of 2048 tokens a step
    (chunked prefill, decoding rows beside the chunks), then a second turn appended to each; the row graphs off, so
    that every eager step is a piece step: several sizes captured (L + 1 graphs each) and replayed, and the logprobs'
    gap to the fp32 model's teacher-forced ones is the eager engine's."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                      eos_token_id=2)
    with torch.device("cuda"):
        ref = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(ref.state_dict())
    monkeypatch.setenv("UNISON_ROW_GRAPHS", "0")
    lengths = [100 + 13 * i for i in range(24)]
    gaps, stats = {}, {}
    for pieces in (True, False):
        monkeypatch.setenv("UNISON_PIECE_GRAPHS", "1" if pieces else "0")
        engine = Engine(model, EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=32, max_batch_tokens=2048,
                                            seed=0))
        for prompt in random_prompts(lengths, vocab=4096, seed=1):
            engine.submit(prompt, SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=()),
                          continuable=True)
        done, ended = [], []
        for turn in range(3):  # the third turn replays what the second captured
            for c, tool in zip(ended, random_prompts([40 + 7 * i for i in range(len(ended))], vocab=4096,
                                                     seed=turn), strict=True):
                engine.extend(c.request_id, tool, SamplingParams(max_new_tokens=16, stop_token_ids=()))
            ended = []
            while engine.num_unfinished:
                ended += engine.step()
            done += ended
        stats[pieces] = engine.stats()
        gaps[pieces] = torch.cat([(teacher_forced_logprobs(ref, c.prompt_ids, c.token_ids)
                                   - torch.tensor(c.logprobs)).abs() for c in done]).mean().item()
        if pieces:
            sizes = sorted(engine.pieces.graphs)
            assert all(len(p) == cfg.num_hidden_layers + 1 and len(c) == cfg.num_hidden_layers
                       for p, c in engine.pieces.graphs.values())
    print(f"mean |engine - fp32| pieces {gaps[True]:.3e}, eager {gaps[False]:.3e}; piece steps "
          f"{stats[True]['piece_graph_steps']} of {stats[True]['steps'] - stats[True]['graph_steps']} eager, "
          f"sizes {sizes}, graphs {stats[True]['graphs_captured']}")
    assert stats[True]["piece_graph_steps"] == stats[True]["steps"] - stats[True]["graph_steps"] >= 6
    assert stats[False]["piece_graph_steps"] == 0 and len(sizes) >= 2
    assert gaps[True] < 1.25 * gaps[False] + 1e-4


def test_piece_graphs_on_by_default_on_the_gpu(monkeypatch):
    """Unset, ``UNISON_PIECE_GRAPHS`` leaves ``EngineConfig.piece_graphs`` to decide (on by default); ``0`` turns
    them off."""
    model = Qwen3ForCausalLM._from_config(Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=64),
                                          attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
    monkeypatch.delenv("UNISON_PIECE_GRAPHS", raising=False)
    assert Engine(model, EngineConfig(num_blocks=64, block_size=16)).pieces is not None
    assert Engine(model, EngineConfig(num_blocks=64, block_size=16, piece_graphs=False)).pieces is None
    monkeypatch.setenv("UNISON_PIECE_GRAPHS", "0")
    assert Engine(model, EngineConfig(num_blocks=64, block_size=16, piece_graphs=True)).pieces is None
