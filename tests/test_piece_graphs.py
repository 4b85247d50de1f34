"""Eager steps as graph pieces (unison.engine.piece_graphs), eagerly through the same buffers on the CPU: padded to
the ladder's sizes, cut at every layer's attention, the engine's tokens and logprobs are its eager steps'."""

from __future__ import annotations

import pytest
import torch
from conftest import drain, max_logprob_diff, random_prompts, record_returns, tiny_llama, tiny_qwen3

from unison.config import load_config
from unison.train.config import TrainConfig

pytest.importorskip("triton")

from unison.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    SamplingParams,
    fused_layer,
    fused_linear,
    piece_graphs,
)

PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=(), seed=3)


def _engine(model, pieces: bool, monkeypatch, **config) -> Engine:
    monkeypatch.setenv("UNISON_ROW_GRAPHS", "0")
    monkeypatch.setenv("UNISON_PIECE_GRAPHS", "1" if pieces else "0")
    return Engine(model, EngineConfig(**{"num_blocks": 128, "block_size": 4, "seed": 0, "attention": "triton",
                                         "max_num_seqs": 4, "max_batch_tokens": 40, **config}))


def _run(engine: Engine) -> list:
    """Three prompts, one sampled twice, then each first turn continued: prompts longer than a step's budget
    (chunked prefill beside decoding rows), steps of chunks alone, appended turns over a cached context."""
    ids = [engine.submit(p, SamplingParams(**{**PARAMS.__dict__, "n": n}), continuable=True)
           for p, n in zip(random_prompts([23, 50, 9], seed=5), (1, 2, 1), strict=True)]
    first = drain(engine)
    for rid, tool in zip([i[0] for i in ids], random_prompts([13, 3, 22], seed=6), strict=True):
        engine.extend(rid, tool)
    return first + drain(engine)


def test_ladder():
    assert piece_graphs.ladder(8192) == [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                                         8192]
    assert piece_graphs.ladder(40) == [40] and piece_graphs.ladder(100) == [64, 96, 100]
    for top in (200, 2048, 5000):
        sizes = piece_graphs.ladder(top)
        assert sizes[-1] == top and all(b / a <= 1.5 for a, b in zip(sizes, sizes[1:], strict=False))


@pytest.mark.parametrize(("make", "fused"), [(tiny_llama, False), (tiny_qwen3, True)],
                         ids=["llama-modules", "qwen3-fused_layers"])
def test_eager_steps_as_pieces_equal_the_eager_engine(make, fused, monkeypatch):
    """Every eager step (prompt chunks, with decoding rows or without, appended turns) runs through the pieces, padded
    to its ladder size: the completions' tokens are the eager engine's, their logprobs the same to float precision
    and teacher-forced ones; each layer's attention is one cut, over the step's real tokens only."""
    if fused:
        for module in (fused_linear, fused_layer):
            monkeypatch.setattr(module, "DEVICES", {"cpu", "cuda"})
    model = make()
    eager_engine = _engine(model, False, monkeypatch)
    eager = _run(eager_engine)
    assert eager_engine.pieces is None and eager_engine.stats()["piece_graph_steps"] == 0
    engine = _engine(model, True, monkeypatch)
    attended, attend = [], piece_graphs.PieceRunner._attend

    def recorded(runner, cut):
        attended.append(runner._n)
        return attend(runner, cut)
    monkeypatch.setattr(piece_graphs.PieceRunner, "_attend", recorded)
    cut = record_returns(monkeypatch, piece_graphs.PieceRunner, "__call__")
    done = _run(engine)
    stats = engine.stats()
    assert stats["piece_graph_steps"] == stats["steps"] - stats["graph_steps"] >= 4
    assert len(attended) == stats["piece_graph_steps"] * model.config.num_hidden_layers
    padded = {engine.pieces.meta.shape[1]} | set(piece_graphs.ladder(40))
    assert padded == {40}  # a budget of 40 tokens: one size
    assert max(attended) <= 40 and min(attended) < 40  # over the real tokens, never the padding
    assert [c.token_ids for c in done] == [c.token_ids for c in eager]
    for a, b in zip(done, eager, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert max_logprob_diff(model, done) < 1e-4
    assert all(out.untyped_storage().data_ptr() == engine.runner.logits.untyped_storage().data_ptr()
               for out in cut)


def test_padding_writes_only_the_scratch_block(monkeypatch):
    """A step of 37 tokens padded to 64: the 27 padding rows write their K/V into the scratch block alone; every
    block a request holds has what the eager step writes there."""
    model = tiny_qwen3()
    with torch.no_grad():  # (token 0, the padding's, embeds as zeros in these models: its keys would be too)
        model.model.embed_tokens.weight[0].normal_()
    prompt = random_prompts([37], seed=9)[0]
    pools = []
    for pieces in (False, True):
        engine = _engine(model, pieces, monkeypatch, max_batch_tokens=64)
        engine.submit(prompt, SamplingParams(max_new_tokens=1, stop_token_ids=()))
        engine.step()
        assert engine.stats()["piece_graph_steps"] == pieces
        pools.append(engine.pool)
    eager, piece = pools
    scratch = 128 * 4  # the scratch block's first slot: num_blocks * block_size
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(piece.k[layer][:scratch], eager.k[layer][:scratch], atol=1e-6, rtol=0)
        torch.testing.assert_close(piece.v[layer][:scratch], eager.v[layer][:scratch], atol=1e-6, rtol=0)
        assert piece.k[layer][scratch:].abs().sum() > 0 and eager.k[layer][scratch:].abs().sum() == 0


def test_pieces_off_and_past_the_budget(monkeypatch):
    """On by default, yet off without graphs (the CPU) whatever ``engine.piece_graphs`` says; ``UNISON_PIECE_GRAPHS``
    decides where set; a step of more tokens than the budget (decoding rows past it) or more sampled rows than the
    logits buffer holds runs eagerly."""
    model = tiny_qwen3()
    monkeypatch.delenv("UNISON_PIECE_GRAPHS", raising=False)
    assert EngineConfig().piece_graphs is True
    assert load_config(TrainConfig, overrides=["--engine.piece_graphs=false"]).engine.piece_graphs is False
    for on in (False, True):
        assert Engine(model, EngineConfig(num_blocks=32, block_size=4, attention="triton",
                                          piece_graphs=on)).pieces is None
    assert piece_graphs.enabled(True, True) and not piece_graphs.enabled(False, True)
    monkeypatch.setenv("UNISON_PIECE_GRAPHS", "0")
    assert not piece_graphs.enabled(True, True)
    monkeypatch.setenv("UNISON_PIECE_GRAPHS", "1")
    assert piece_graphs.enabled(False, False)
    runner = _engine(model, True, monkeypatch).pieces
    assert runner.takes(40, 4) and not runner.takes(41, 1) and not runner.takes(8, 5) and not runner.takes(0, 0)
