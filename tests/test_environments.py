"""Multi-turn episodes end to end on the CPU: environments (TRL's shape), tool turns rendered by the chat template,
one sample per episode whose mask trains exactly the model's tokens, and a training step on them.

The model's turns are scripted (a tiny random model never calls a tool); the engine, its continued requests, the
tokenizer, the chat template, the tools and the trainer are the real ones."""

from __future__ import annotations

import math
import re

import pytest
import torch
from multiturn_helpers import ScriptedEngine, byte_tokenizer, one_thread  # noqa: F401

from unison.episodes import ChatRenderer, EpisodeConfig, MultiTurnRolloutLoop, TemplateError
from unison.rollout.loop import RolloutConfig
from unison.tasks import DataConfig, load_task
from unison.tasks.multiturn import GuessNumber, guessed, solved
from unison.train.logprobs import policy_logprobs
from unison.train.loss import LossConfig
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.packing import pack_samples
from unison.train.step import train_step

IM_END = "<|im_end|>"


def call(n: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>{IM_END}'


def player(req, context: str) -> str:
    """Sample 0 and 2 search by halving; 1 always guesses 1; 3 first sends a malformed call, then halves."""
    feedback = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", context, re.DOTALL)
    guesses = [int(g) for g in re.findall(r'"number": (\d+)', context)]
    if feedback and feedback[-1] == "correct":
        return f"Found it.{IM_END}"
    index = int(req.request_id.rsplit("-", 1)[1])  # the script's choice of player only
    if index == 1:
        return call(1)
    if index == 3 and not feedback:
        return f'<tool_call>{{"number": 5}}</tool_call>{IM_END}'
    lo, hi = 1, 8
    for g, f in zip(guesses, [f for f in feedback if f in ("higher", "lower")], strict=False):
        lo, hi = (g + 1, hi) if f == "higher" else (lo, g - 1)
    return call((lo + hi) // 2)


def rows(secrets=(7, 3, 6, 2)):
    return [{"prompt": "Find my number from 1 to 8.", "secret": s, "high": 8, "answer": str(s)} for s in secrets]


def make_loop(env_factory=GuessNumber, reward_fns=None, tokenizer=None, episode=None, engine=None, data=None,
              **cfg):
    """A multi-turn loop on the scripted engine (``data``: the task's rows, by default ``rows()``)."""
    tok = tokenizer or byte_tokenizer()
    engine = engine or ScriptedEngine(tok, player)
    base = dict(group_size=4, samples_per_step=4, max_concurrent_rollouts=8, max_new_tokens=64)
    base.update(cfg)
    return MultiTurnRolloutLoop(engine, tok, data or rows(), reward_fns or [(solved, 1.0), (guessed, 0.2)],
                                RolloutConfig(**base), stop_token_ids=[257], max_sample_tokens=2048,
                                episode_cfg=episode or EpisodeConfig(max_turns=6), environment_factory=env_factory)


def test_episode_tokens_are_the_engines_and_the_mask_covers_exactly_the_models_turns():
    loop = make_loop()
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 4
    tok = loop.tokenizer
    for s in batch:
        mask = torch.tensor(s.completion_mask)
        ids = torch.tensor(s.completion_ids)
        # the model's tokens are exactly the scripted turns, in order; everything else is template context
        model_text = tok.decode(ids[mask].tolist(), skip_special_tokens=False)
        assert model_text.count(IM_END) == sum(s.completion_mask[i] and s.completion_ids[i] == 257
                                               for i in range(len(ids)))
        spans = _spans(s.completion_mask)
        for start, end, is_model in spans:
            text = tok.decode(list(s.completion_ids[start:end]), skip_special_tokens=False)
            if is_model:
                assert text.endswith(IM_END) and "<|im_start|>" not in text
            else:
                assert re.fullmatch(r"\n<\|im_start\|>tool\n[^<]*<\|im_end\|>\n<\|im_start\|>assistant\n", text), text
        assert spans[0][2] and spans[-1][2]  # starts and ends with a model turn
        assert all(lp == 0.0 for lp, m in zip(s.engine_logprobs, s.completion_mask, strict=True) if not m)
    # A solved episode: its tokens decode to the template's rendering of its conversation, turn for turn
    s = next(s for s in batch if s.reward >= 1)
    text = tok.decode(list(s.prompt_ids + s.completion_ids), skip_special_tokens=False)
    assert re.fullmatch(r"<\|im_start\|>system\n.*<\|im_end\|>\n<\|im_start\|>user\nFind my number from 1 to 8\."
                        r"<\|im_end\|>\n<\|im_start\|>assistant\n(<tool_call>.*?</tool_call><\|im_end\|>\n"
                        r"<\|im_start\|>tool\n(higher|lower|correct)<\|im_end\|>\n<\|im_start\|>assistant\n)+"
                        r"Found it\.<\|im_end\|>", text, re.DOTALL), text
    assert metrics["episode/turns_mean"] > 1 and metrics["tools/errors/malformed"] >= 1
    assert metrics["episode/context_tokens_mean"] > 0 and metrics["rollout/dropped_episodes"] == 0


def test_reward_functions_get_the_last_turn_as_completion_and_completion_ids():
    seen = []

    def last_turn(prompts, completions, completion_ids, environments, **_):
        seen.extend(zip(completions, completion_ids, strict=True))
        return [float(env.solved) for env in environments]

    loop = make_loop(reward_fns=[(last_turn, 1.0)])
    batch, _ = loop.next_batch(trainer_version=0)
    assert len(seen) >= len(batch)
    tok = loop.tokenizer
    for s in batch:  # each sample's completion ends with its last model turn: those ids, that text
        text, ids = next((t, i) for t, i in seen if list(s.completion_ids[-len(i):]) == i)
        assert tok.decode(ids, skip_special_tokens=True) == text and ids[-1] == 257
        # the completion log shows the last turn as scored, the episode's turns and tool calls
        assert (s.shown["completion"], s.shown["reward"], s.shown["reward/last_turn"]) == (text, s.reward, s.reward)
        assert s.shown["turns"] == sum(is_model for _, _, is_model in _spans(s.completion_mask)) > 1


def test_engine_logprobs_of_the_models_tokens_match_the_trainers_and_tool_tokens_are_not_trained():
    loop = make_loop()
    batch, _ = loop.next_batch(trainer_version=0)
    (row,) = pack_samples(batch[:1], 4096, pad_id=258)
    s = batch[0]
    assert row.num_loss_tokens == s.num_loss_tokens == sum(s.completion_mask) < len(s.completion_ids)
    with torch.no_grad():
        logp, _ = policy_logprobs(loop.engine.model, row, temperature=1.0)
    assert torch.allclose(logp, row.engine_logprobs[row.loss_mask], atol=1e-4, rtol=0)
    # the mask's positions predict exactly the model's tokens
    trained = row.targets[row.loss_mask].tolist()
    assert trained == [t for t, m in zip(s.completion_ids, s.completion_mask, strict=True) if m]


def test_a_tiny_multi_turn_rollout_trains():
    loop = make_loop()
    batch, metrics = loop.next_batch(trainer_version=0)
    assert metrics["reward/mean"] > 0 and len({s.reward for s in batch}) > 1
    model = loop.engine.model
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-3), total_steps=1)
    before = model.model.embed_tokens.weight.detach().clone()
    with loop.engine.lend():
        out = train_step(model, opt, batch, LossConfig(), 1.0, 4096, 258, 256)
    loop.engine.weights_updated(1)
    assert math.isfinite(out["loss"]) and out["train/loss_tokens"] == sum(s.num_loss_tokens for s in batch)
    assert not torch.equal(before, model.model.embed_tokens.weight)
    batch2, _ = loop.next_batch(trainer_version=1)  # rolls out again after the update and the lend
    assert len(batch2) == 4
    # episodes in flight across the update: earlier turns keep version 0, turns after it carry 1
    versions = [[v for v, m in zip(s.weight_versions, s.completion_mask, strict=True) if m] for s in batch2]
    assert all(vs == sorted(vs) and set(vs) <= {0, 1} for vs in versions) and any(1 in vs for vs in versions)


class FlakyReset(GuessNumber):
    made = 0

    def reset(self, **row):
        FlakyReset.made += 1
        if FlakyReset.made % 3 == 0:
            raise ConnectionError("sandbox did not start")
        super().reset(**row)


class FlakyTool(GuessNumber):
    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        if number == 1:
            raise RuntimeError("the game server crashed")
        return super().guess(number)


def test_an_environment_whose_reset_or_tool_raises_drops_that_episode_not_the_run():
    loop = make_loop(env_factory=FlakyReset, samples_per_step=4)
    batch, metrics = loop.next_batch(trainer_version=0)
    assert metrics["rollout/dropped_episodes"] >= 1 and batch
    loop = make_loop(env_factory=FlakyTool)
    batch, metrics = loop.next_batch(trainer_version=0)
    assert metrics["rollout/dropped_episodes"] >= 1  # player 1's episodes
    assert all(len(s.completion_mask) for s in batch)


def test_limits_end_episodes_turns_and_tokens():
    loop = make_loop(episode=EpisodeConfig(max_turns=2))
    batch, metrics = loop.next_batch(trainer_version=0)
    assert metrics["episode/turns_mean"] <= 2
    assert all(len(_spans(s.completion_mask)) <= 3 for s in batch)
    prompt = len(make_loop()._start_group(rows()[0])[0].prompt_ids)
    loop = make_loop(episode=EpisodeConfig(max_turns=6, max_tokens=prompt + 40))
    batch, metrics = loop.next_batch(trainer_version=0)
    assert all(s.num_tokens <= prompt + 40 for s in batch)
    assert any(s.finish_reason == "length" for s in batch) and metrics["completion/truncated_frac"] > 0


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = byte_tokenizer()
    # drops the content of every assistant turn but the last (as reasoning-dropping templates do)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or "
                         "loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "call"}]
    context = tok(renderer.render(messages, False), add_special_tokens=False)["input_ids"]
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        renderer.continuation(context, messages, [{"role": "tool", "content": "3"}])


def test_the_built_in_guess_number_task_runs_multi_turn():
    task = load_task(DataConfig(source="guess_number", size=8, gym={"high": 8}))
    assert task.multi_turn and len(task.rows) == 8
    tok = byte_tokenizer()
    loop = MultiTurnRolloutLoop(ScriptedEngine(tok, player), tok, task.rows, task.reward_fns,
                                RolloutConfig(group_size=4, samples_per_step=8, max_concurrent_rollouts=8,
                                              max_new_tokens=64), stop_token_ids=[257], max_sample_tokens=2048,
                                episode_cfg=EpisodeConfig(max_turns=6),
                                environment_factory=task.environment_factory)
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 8 and metrics["reward/solved"] > 0 and metrics["reward/guessed"] == 1.0


def _spans(mask):
    """(start, end, is_model) runs of the mask."""
    spans, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            spans.append((start, i, mask[start]))
            start = i
    return spans


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def test_unison_train_runs_a_task_with_tools(model_dir, tmp_path):
    import json

    from test_train_e2e import count_w7, run_cfg

    from unison.tasks import Task
    from unison.train.loop import train

    rows = [{"prompt": " ".join(f"w{3 + (i * 11 + j) % 250}" for j in range(4 + i % 5)), "answer": "w7"}
            for i in range(20)]
    out = tmp_path / "mt"
    # the random model never calls the tool: one-turn episodes, through the multi-turn loop and its metrics
    train(run_cfg(model_dir, out, "--max_steps=1", "--step.max_tokens_per_row=256", "--episode.max_turns=3"),
          Task("tiny_tools", rows, [(count_w7, 1.0)], tools=[add]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert all(r["episode/turns_mean"] == 1 and r["tools/errors/malformed"] == 0 for r in records)


def fewest_guesses(prompts, completions, environments, **_):
    return [float(env.solved) - 0.1 * env.guesses for env in environments]


def test_episodes_through_unison_serve_resubmit_each_turn():
    """A remote engine has no extend(): each next turn is a new request of the whole conversation."""
    import threading
    from http.server import ThreadingHTTPServer

    from unison.rollout.remote import RemoteEngine
    from unison.serve import GenerationServer, make_handler
    from unison.sync import Receiver

    tok = byte_tokenizer()
    engine = ScriptedEngine(tok, player)
    server = GenerationServer(engine, Receiver(dict(engine.model.named_parameters()), version=0))  # its own weights
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, timeout=60))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    remote = RemoteEngine([f"http://127.0.0.1:{http.server_address[1]}"])
    try:
        loop = MultiTurnRolloutLoop(remote, tok, rows(secrets=(2,)), [(fewest_guesses, 1.0)],
                                    RolloutConfig(group_size=4, samples_per_step=4, max_concurrent_rollouts=4,
                                                  max_new_tokens=64), stop_token_ids=[257], max_sample_tokens=2048,
                                    episode_cfg=EpisodeConfig(max_turns=6), environment_factory=GuessNumber)
        batch, metrics = loop.next_batch(trainer_version=0)
    finally:
        remote.close()
        http.shutdown()
        server.stop()
    assert len(batch) == 4 and metrics["episode/turns_mean"] > 2
    for s in batch:  # the same token sequence as the local engine builds: model turns masked in, replies out
        text = tok.decode(list(s.completion_ids), skip_special_tokens=False)
        assert text.endswith(f"Found it.{IM_END}") and "<|im_start|>tool\ncorrect<|im_end|>" in text
        assert sum(s.completion_mask) < len(s.completion_mask)
