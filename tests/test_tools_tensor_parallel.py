"""Multi-turn episodes under tensor parallelism: rank 0 alone resets the environments and runs the tools and
``respond`` (waited for, or in the background); every rank continues its episodes with rank 0's replies at the same
engine steps, so the ranks' requests stay the same (a reply that differed between ranks, or a tool that timed out on
one, would part them)."""

from __future__ import annotations

from test_tensor_parallel import run_two_ranks


def test_rank_zero_runs_the_environment_and_every_rank_gets_its_replies(tmp_path):
    zero, one = run_two_ranks("tools_tp_peer.py", out=tmp_path)
    for mode in ("waiting", "background"):
        a, b = zero[mode], one[mode]
        # Every episode ran its tool turn and the respond turn: 3 model turns each, 8 samples.
        assert len(a["samples"]) == 8 and a["turns_mean"] == b["turns_mean"] == 3, mode
        assert a["calls"]["reset"] >= 8 and a["calls"]["tool"] >= 8 and a["calls"]["respond"] >= 16, mode
        assert b["calls"] == {"reset": 0, "tool": 0, "respond": 0}, mode
        # prompts, every turn's tokens, rewards, and the engine steps they took: the same on both ranks
        assert b["samples"] == a["samples"] and b["engine_steps"] == a["engine_steps"], mode
        for text in b["texts"]:
            assert "on rank 0" in text and "on rank 1" not in text
        assert sorted({s[2] for s in a["samples"]}) == [1.0, 2.0, 3.0, 4.0]  # rewards read rank 0's environments
    assert zero["errors"] == ["ZeroDivisionError: division by zero"] * 2
    assert one["errors"] == ["RuntimeError: tensor-parallel rank 0 failed where this rank waited for its result: "
                             "ZeroDivisionError: division by zero"] * 2
    # on_main(..., empty={}): rank 0's result on both ranks; the empty one in one broadcast (its size), others in two
    assert zero["sent"] == one["sent"] == [({}, 1), ({"r0": "reply"}, 2), ({}, 1)]


def test_unison_train_with_tensor_parallelism_runs_episodes_on_rank_zero(tmp_path):
    """`unison train --dist.tp=2` with an environment that answers with its rank: the run's own check that every rank
    trained the same samples passes (an environment reset on each rank puts its rank in the prompt and fails it),
    and rank 1 never called the environment. (The random model's turns mostly end at the length limit, which ends
    an episode without ``respond``: the loop test above covers the replies.)"""
    import torch
    from multiturn_helpers import IM_END, VOCAB, byte_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=IM_END,
                                 pad_token_id=IM_END + 1)).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)  # ChatML: the environment's replies render as user turns
    zero, one = run_two_ranks("tools_tp_peer.py", str(model_dir), out=tmp_path)
    assert zero["turns_mean"] == one["turns_mean"] >= 1
    assert zero["calls"]["reset"] >= 8
    assert one["calls"] == {"reset": 0, "tool": 0, "respond": 0}
