"""Steps with prompt chunks as graph rows (unison.engine.row_graphs), in Triton's interpreter: the engine's tokens
and logprobs equal its eager prefill's, first turns and continued ones, with the K/V written before any row attends."""

from __future__ import annotations

import pytest
import torch
from conftest import count_calls, drain, max_logprob_diff, random_prompts, record_returns, tiny_llama, tiny_qwen3

from unison.config import load_config
from unison.train.config import TrainConfig

pytest.importorskip("triton")

from unison.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    SamplingParams,
    fused_layer,
    fused_linear,
    row_graphs,
    triton_backend,  # noqa: E402
)
from unison.engine.graphs import DecodeRunner  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(), seed=3)


def _engine(model, rows: bool, monkeypatch) -> Engine:
    monkeypatch.setenv("UNISON_ROW_GRAPHS", "1" if rows else "0")
    return Engine(model, EngineConfig(num_blocks=96, block_size=4, seed=0, attention="triton", max_num_seqs=4))


def _turns(engine: Engine) -> list:
    """Two prompts (one sampled four times), then each first-turn request continued with appended tokens."""
    ids = [engine.submit(p, PARAMS if n == 1 else SamplingParams(**{**PARAMS.__dict__, "n": n}), continuable=True)
           for p, n in zip(random_prompts([7, 12], seed=5), (1, 2), strict=True)]
    first = drain(engine)
    for rid, tool in zip([i[0] for i in ids], random_prompts([5, 9], seed=6), strict=True):
        engine.extend(rid, tool)
    return first + drain(engine)


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused_layers"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3])
def test_prompt_chunks_as_graph_rows_equal_the_eager_prefill(make, fused, monkeypatch):
    """Every prefill step (the prompts, the appended turns) runs as rows (``row_graph_steps``); the completions'
    tokens are the eager engine's and their logprobs teacher-forced ones. With the fused layers (q/k norms, RoPE and
    the K/V write in one kernel) no row attends in the one-launch kernel, whose programs would read keys that others
    write."""
    if fused:
        for module in (fused_linear, fused_layer):
            monkeypatch.setattr(module, "DEVICES", {"cpu", "cuda"})
    model = make()
    eager = _turns(_engine(model, False, monkeypatch))
    one_launch = count_calls(monkeypatch, triton_backend, ["rope_paged_decode"])
    engine = _engine(model, True, monkeypatch)
    rows = _turns(engine)
    assert engine.stats()["row_graph_steps"] >= 2  # the first turns' prompts and the continued turns' tokens
    assert [c.token_ids for c in rows] == [c.token_ids for c in eager]
    assert max_logprob_diff(model, rows) < 1e-4
    for a, b in zip(rows, eager, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    if fused and make is tiny_qwen3:
        assert one_launch["rope_paged_decode"] > 0  # the decode steps take it ...
    before = one_launch["rope_paged_decode"]
    engine.submit(random_prompts([6], seed=8)[0], SamplingParams(max_new_tokens=1, stop_token_ids=()))
    engine.step()  # a step of one prompt chunk, sampled at once: rows alone
    assert one_launch["rope_paged_decode"] == before  # ... and no step of rows does


def test_steps_past_the_rows_budget_run_eagerly(monkeypatch):
    """A step whose rows would read more key bytes a layer than ``ROW_KV_BYTES``, or that has more rows than the
    largest graph (the ladder's, or fewer for a model whose rows times parameters pass ``ROW_TOKEN_PARAMS``), is
    prefilled eagerly (flash, or the reference on the CPU); the row graphs are on by default only where the engine
    captures graphs, and ``engine.row_graphs=false`` turns them off."""
    model = tiny_qwen3()
    assert _engine(model, False, monkeypatch).rows is None
    monkeypatch.delenv("UNISON_ROW_GRAPHS")
    assert Engine(model, EngineConfig(num_blocks=96, block_size=4, attention="triton")).rows is None  # the CPU
    monkeypatch.setenv("UNISON_ROW_GRAPHS", "1")
    cfg = load_config(TrainConfig, overrides=["--engine.row_graphs=false"]).engine  # unison train's override
    assert cfg.row_graphs is False
    off = Engine(model, EngineConfig(**{**cfg.__dict__, "num_blocks": 96, "block_size": 4, "attention": "triton"}))
    assert off.rows is None and _engine(model, True, monkeypatch).rows is not None
    params = sum(p.numel() for p in model.model.parameters()) - model.model.embed_tokens.weight.numel()
    monkeypatch.setattr(row_graphs, "ROW_TOKEN_PARAMS", 20 * params)
    assert _engine(model, True, monkeypatch).rows.max_rows == 16
    monkeypatch.setattr(row_graphs, "ROW_KV_BYTES", 1)
    engine = _engine(model, True, monkeypatch)
    done = engine.generate(random_prompts([7, 12], seed=5), PARAMS)
    assert engine.stats()["row_graph_steps"] == 0 and max_logprob_diff(model, done) < 1e-4
    monkeypatch.setattr(row_graphs, "ROW_KV_BYTES", 2**40)
    monkeypatch.setattr(row_graphs, "ROW_LADDER", (16,))
    engine = _engine(model, True, monkeypatch)
    engine.generate(random_prompts([20], seed=5), PARAMS)  # 20 prompt rows > 16
    assert engine.stats()["row_graph_steps"] == 0
    engine.generate(random_prompts([9], seed=7), PARAMS)
    assert engine.stats()["row_graph_steps"] == 1


def test_every_graph_step_writes_one_logits_buffer(monkeypatch):
    """The decode steps at every batch size and the steps of rows return their logits in the decode runner's one
    buffer (``DecodeRunner.logits``), where each captured graph's own output would stay allocated in the graphs'
    memory pool, one per size; the completions are still teacher-forced."""
    model = tiny_qwen3()
    engine = _engine(model, True, monkeypatch)
    decoded = record_returns(monkeypatch, DecodeRunner)
    rowed = record_returns(monkeypatch, row_graphs.RowRunner)
    for prompt, new in zip(random_prompts([7, 12, 5, 9], seed=5), (2, 3, 5, 8), strict=True):
        engine.submit(prompt, SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=()))
    done = drain(engine)
    assert {len(out) for out in decoded} >= {1, 2, 3, 4} and rowed  # the ladder's 1, 2 and 4
    buffer = engine.runner.logits.untyped_storage().data_ptr()
    assert all(out.untyped_storage().data_ptr() == buffer for out in decoded + rowed)
    assert max_logprob_diff(model, done) < 1e-4
