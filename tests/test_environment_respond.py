"""Environments that answer the model's plain text (``respond``), and the built-in ``sum_feedback`` task built on
them: the reply is a user message in the episode's tokens (context, mask 0), None ends the episode, a raising or
hanging ``respond`` drops the episode, a huge reply is cut, ``respond`` is never a tool, and an engine without
``extend`` (``unison serve``'s clients) gets the same episodes.

The model's turns are scripted; the engine, its continued requests, the tokenizer, the chat template and the
task's rows (reasoning-gym, generated offline) are the real ones."""

from __future__ import annotations

import math
import re
import time

import pytest
from multiturn_helpers import ScriptedEngine, byte_tokenizer, one_thread  # noqa: F401
from test_environments import _spans
from test_environments import make_loop as environments_loop

from unison.episodes import EpisodeConfig, environment_tools
from unison.tasks import DataConfig, load_task
from unison.tasks.gym import ANSWER_FORMAT
from unison.tasks.multiturn import TRY_AGAIN, SumFeedback

IM_END = "<|im_end|>"
NO_NUMBER = 'I will call <tool_call>{"name": "add"}</tool_call>'  # no number; and no tools to call here


def gold(context: str) -> int:
    a, op, b = re.search(r"problem: (\d+) ([+-]) (\d+) =", context).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def player(req, context: str) -> str:
    """0 answers right at once; 1 too high, then right; 2 without a number, too low, then right; 3 always too high."""
    index = int(req.request_id.rsplit("-", 1)[1])
    turn = context.count("<|im_start|>assistant\n") - 1  # the model turns before this one
    answer = gold(context)
    script = {0: [answer], 1: [answer + 1, answer], 2: [None, answer - 1, answer], 3: [answer + 5] * 9}[index]
    said = script[turn]
    return f"{NO_NUMBER}{IM_END}" if said is None else f"So: <answer>{said}</answer>{IM_END}"


def make_loop(env_factory=SumFeedback, episode=None, size=4, script=player, **cfg):
    """tests/test_environments.make_loop on the built-in sum_feedback task, with its rewards."""
    task = load_task(DataConfig(source="sum_feedback", size=size))
    tok = byte_tokenizer()
    cfg = dict(max_concurrent_rollouts=4, max_new_tokens=48) | cfg
    return environments_loop(env_factory, task.reward_fns, tok, episode or EpisodeConfig(max_turns=3),
                             ScriptedEngine(tok, script), data=task.rows, **cfg)


def test_the_environments_reply_is_a_user_message_of_context_tokens_and_none_ends_the_episode():
    loop = make_loop()
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 4
    tok = loop.tokenizer
    reminder = re.escape(ANSWER_FORMAT)
    user = r"\n<\|im_start\|>user\n{}<\|im_end\|>\n<\|im_start\|>assistant\n"
    by_turns = {}
    for s in batch:
        prompt = tok.decode(list(s.prompt_ids), skip_special_tokens=False)
        assert "<tools>" not in prompt and prompt.endswith(f"{ANSWER_FORMAT}{IM_END}\n<|im_start|>assistant\n")
        answer = gold(prompt)
        spans = _spans(s.completion_mask)
        texts = [(tok.decode(list(s.completion_ids[a:b]), skip_special_tokens=False), m) for a, b, m in spans]
        model = [t for t, m in texts if m]
        context = [t for t, m in texts if not m]
        assert all(m for _, m in texts[::2]) and not any(m for _, m in texts[1::2])  # model, reply, model, ...
        assert all(re.fullmatch(r"(So: <answer>-?\d+</answer>|" + re.escape(NO_NUMBER) + ")" + re.escape(IM_END), t)
                   for t in model)
        assert all(lp == 0.0 for lp, m in zip(s.engine_logprobs, s.completion_mask, strict=True) if not m)
        by_turns[len(model)] = (model, context, s.reward)
        if model[-1] == f"So: <answer>{answer}</answer>{IM_END}":  # a right answer ends the episode: no reply after
            assert len(context) == len(model) - 1
    # 1 turn: right at once; 2: too high, then right; 3 (max_turns): player 2 or 3, their last reply never shown
    right_at_once, high_then_right = by_turns[1], by_turns[2]
    # solved 1.0, solved_first_try 0.2, format 0.2 and closeness 0.3 of the last turn's answer
    assert right_at_once[1] == [] and right_at_once[2] == pytest.approx(1.0 + 0.2 + 0.2 + 0.3)
    assert re.fullmatch(user.format(rf"Too high\. Try again\. {reminder}"), high_then_right[1][0])
    assert high_then_right[2] == pytest.approx(1.0 + 0.2 + 0.3)
    three = [s for s in batch if sum(1 for _, _, m in _spans(s.completion_mask) if m) == 3]
    replies = sorted(tok.decode(list(s.completion_ids[a:b]), skip_special_tokens=False)
                     for s in three for a, b, m in _spans(s.completion_mask) if not m)
    assert [re.fullmatch(user.format(f"(.*?) {reminder}"), r).group(1) for r in replies] == [
        "I found no number in your answer.", "Too high. Try again.", "Too high. Try again.", "Too low. Try again."]
    off_by_5 = 0.3 * math.exp(-5)  # closeness of an answer 5 too high (a one-digit sum: scale 1)
    assert sorted(s.reward for s in three) == pytest.approx([0.2 + off_by_5, 1.5])  # always wrong; solved 3rd
    assert metrics["reward/solved"] == pytest.approx(0.75) and metrics["reward/solved_first_try"] == 0.25
    assert metrics["episode/turns_mean"] == pytest.approx(9 / 4) and metrics["tools/errors/malformed"] == 0


def by_feedback(req, context: str) -> str:
    """The first turn by player (right; 2 too high; 3 too low; no number), then whatever the last reply asks for."""
    answer, replies = gold(context), re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", context, re.DOTALL)[1:]
    if not replies:
        said = [answer, answer + 2, answer - 3, None][int(req.request_id.rsplit("-", 1)[1])]
    else:
        said = answer + 1 if replies[-1].startswith("I found no number") else answer
    return f"{NO_NUMBER}{IM_END}" if said is None else f"<answer>{said}</answer>{IM_END}"


def test_an_engine_without_extend_gets_the_same_episodes_as_new_requests():
    """As through `unison serve`: each next turn is a new request of the whole conversation."""
    episodes, requests = [], []
    for continues in (True, False):
        loop = make_loop(script=by_feedback)
        loop.continues = continues
        batch, metrics = loop.next_batch(trainer_version=0)
        assert metrics["episode/turns_mean"] == pytest.approx((1 + 2 + 2 + 3) / 4)
        episodes.append(sorted((s.prompt_ids, s.completion_ids, s.completion_mask, s.reward) for s in batch))
        requests.append(len({rid for rid, _ in loop.engine.turns}))
    assert episodes[0] == episodes[1] and requests == [4, 8]  # 4 later turns: extended, or new requests


class RaisingRespond(SumFeedback):
    def respond(self, text: str) -> str | None:
        reply = super().respond(text)
        if reply and reply.startswith("Too high"):
            raise ConnectionError("the judge went away")
        return reply


class HangingRespond(SumFeedback):
    def respond(self, text: str) -> str | None:
        reply = super().respond(text)
        if reply and reply.startswith("Too high"):
            time.sleep(3)
        return reply


@pytest.mark.parametrize("env", [RaisingRespond, HangingRespond])
def test_a_respond_that_raises_or_hangs_drops_its_episode_not_the_run(env):
    loop = make_loop(env, EpisodeConfig(max_turns=3, tool_timeout_s=0.3))
    batch, metrics = loop.next_batch(trainer_version=0)
    # players 1 and 3 answer too high first: their episodes are dropped; 0 and 2 train, two of each group of four
    assert metrics["rollout/dropped_episodes"] == 4 and len(batch) == 4
    assert sorted(s.reward for s in batch) == pytest.approx([1.5, 1.5, 1.7, 1.7])


class Verbose(SumFeedback):
    def respond(self, text: str) -> str | None:
        reply = super().respond(text)
        return None if reply is None else reply + " Think." * 2_000_000  # 14 MB


def test_a_huge_reply_is_cut_to_max_tool_result_chars_and_counted():
    loop = make_loop(Verbose, EpisodeConfig(max_turns=2, max_tool_result_chars=300))
    batch, metrics = loop.next_batch(trainer_version=0)
    tok = loop.tokenizer
    replies = [tok.decode(list(s.completion_ids[a:b]), skip_special_tokens=False)
               for s in batch for a, b, m in _spans(s.completion_mask) if not m]
    assert len(replies) == 3 and metrics["tools/truncated"] == 3  # players 1, 2 and 3 were wrong once
    for r in replies:
        content = r.split("user\n", 1)[1].split(IM_END)[0]
        assert len(content) == 300 and re.search(r"Think\.?\.\.\. \[cut: 140000\d\d characters, the first 300 shown\]$",
                                                 content), content


class Hinted(SumFeedback):
    def hint(self) -> str:
        """A hint about the sum."""
        return "Add the two numbers."


class Silent:
    def reset(self, **row) -> None:
        pass


def test_respond_is_not_a_tool_and_an_environment_needs_tools_or_respond():
    assert environment_tools(SumFeedback()) == []
    assert [t.__name__ for t in environment_tools(Hinted())] == ["hint"]
    with pytest.raises(ValueError, match="Silent has no public methods besides reset and no respond"):
        environment_tools(Silent())


def hint_first(req, context: str) -> str:
    """Even players ask for a hint (a tool call), then answer 1 too low, then right; odd ones answer right at once."""
    if int(req.request_id.rsplit("-", 1)[1]) % 2:
        return f"<answer>{gold(context)}</answer>{IM_END}"
    if "<|im_start|>tool" not in context:
        return f'<tool_call>{{"name": "hint", "arguments": {{}}}}</tool_call>{IM_END}'
    return f"<answer>{gold(context) - ('Too low' not in context)}</answer>{IM_END}"


def test_an_environment_with_tools_and_respond_gets_tool_calls_and_plain_turns_apart():
    loop = make_loop(Hinted, script=hint_first)
    batch, metrics = loop.next_batch(trainer_version=0)
    assert metrics["episode/tool_calls_mean"] == 0.5 and metrics["episode/turns_mean"] == 2
    tok = loop.tokenizer
    prompt = tok.decode(list(batch[0].prompt_ids), skip_special_tokens=False)
    schemas = re.search(r"<tools>\n(.*)\n</tools>", prompt).group(1)
    assert '"name": "hint"' in schemas and "respond" not in schemas and "reset" not in schemas
    texts = sorted(tok.decode(list(s.completion_ids), skip_special_tokens=False) for s in batch)
    answer, a, b = r"<answer>-?\d+</answer><\|im_end\|>", r"<\|im_start\|>", r"<\|im_end\|>\n"
    assert all(re.fullmatch(answer, t) for t in texts[:2]), texts
    for t in texts[2:]:  # the call's reply is a tool message, the plain turn's a user message
        assert re.fullmatch(rf"<tool_call>.*?</tool_call>{b}{a}tool\nAdd the two numbers\.{b}{a}assistant\n{answer}\n"
                            rf"{a}user\nToo low\. Try again\. .*?{b}{a}assistant\n{answer}", t), t


def test_sum_feedback_rows_build_from_reasoning_gym_and_its_replies_are_exact():
    task = load_task(DataConfig(source="sum_feedback", size=8, seed=3))
    assert task.multi_turn and task.environment_factory is SumFeedback and len(task.rows) == 8
    for row in task.rows:
        assert re.fullmatch(re.escape(TRY_AGAIN) + r"\nState the final answer to the following arithmetic problem: "
                            r"\d [+-] \d =\n" + re.escape(ANSWER_FORMAT), row["prompt"]), row["prompt"]
        assert int(row["answer"]) == gold(row["prompt"])
    env = SumFeedback()
    env.reset(**{**task.rows[0], "answer": "7"})
    reminder = " Put the final answer in <answer></answer> tags."
    assert env.respond("It is <answer>9</answer>") == "Too high. Try again." + reminder
    assert env.respond("The answer is 3.") == "Too low. Try again." + reminder
    assert env.respond("<answer>seven</answer>") == "I found no number in your answer." + reminder
    assert not env.solved
    assert env.respond("3 + 4 = <answer>7</answer>") is None
    assert env.solved and env.solved_at == 4 and env.attempts == 4
    with pytest.raises(ValueError, match="numeric answer"):
        SumFeedback().reset(answer="seven")
