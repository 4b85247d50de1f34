"""Tool calls and environment responds in the background (``EpisodeConfig.tools_in_background``, the default): a
slow tool holds up its own episode while the engine decodes the others, the loop waits for a reply only when nothing
is left to decode, and the episodes are those of the loop that waits for every step's tools.

The model's turns are scripted (tests/test_environments.py's players); the engine, its continued requests, the
tokenizer, the chat template, the environments and their tools are the real ones."""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future

import pytest
from multiturn_helpers import one_thread  # noqa: F401
from test_environment_respond import make_loop as respond_loop
from test_environments import make_loop, rows

from unison.episodes import EpisodeConfig
from unison.episodes import loop as episodes_loop
from unison.tasks.multiturn import GuessNumber

SLOW_SECRET = 7


class GatedGuess(GuessNumber):
    """GuessNumber whose games with the secret 7 answer a guess only once ``gate`` is set."""

    gate = threading.Event()

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        if self.secret == SLOW_SECRET:
            assert GatedGuess.gate.wait(timeout=60), "the test never opened the gate"
        return super().guess(number)


@pytest.fixture
def gate():
    GatedGuess.gate.clear()
    yield GatedGuess.gate
    GatedGuess.gate.set()  # no thread stays blocked after the test


def episode(background: bool = True, **kw) -> EpisodeConfig:
    return EpisodeConfig(max_turns=6, tools_in_background=background, **kw)


def test_a_slow_tool_holds_up_its_own_episodes_while_the_engine_decodes_the_others(gate):
    """Two groups in flight; the tools of the secret-7 group wait on a gate. The other group's episodes run to their
    end and come out as a batch while the gated calls are still running; opened, the gated group finishes."""
    loop = make_loop(GatedGuess, engine=None, data=rows((SLOW_SECRET, 3)), episode=episode(),
                     samples_per_step=4, max_concurrent_rollouts=8)
    batch, metrics = loop.next_batch(trainer_version=0)
    assert not gate.is_set()
    assert len(batch) == 4 and len({s.group_id for s in batch}) == 1
    texts = [loop.tokenizer.decode(list(s.completion_ids)) for s in batch]
    assert all("correct" in t for t in texts if "Found it" in t) and any("Found it" in t for t in texts)
    gated = [a.episode for a in loop.awaiting.values()]
    assert len(gated) == 4 and all(ep.row["secret"] == SLOW_SECRET for ep in gated)
    for ep in gated:  # each waits on its first well-formed guess: no game reply in its tokens yet
        assert not re.search("higher|lower|correct", loop.tokenizer.decode(ep.tokens)), ep.turns
    gate.set()
    batch2, metrics2 = loop.next_batch(trainer_version=0)
    assert len(batch2) == 4 and batch2[0].group_id != batch[0].group_id
    assert all(s.reward is not None for s in batch2) and metrics2["episode/turns_mean"] > 1


def test_an_idle_engine_waits_for_replies_instead_of_spinning(gate):
    """Every episode's tool waits on the gate, which opens 0.2 s after the loop first blocks on the replies: the
    loop blocks (a handful of idle engine steps, not one per pass of a busy loop) and counts the wait in
    rollout/tool_wait_s."""
    loop = make_loop(GatedGuess, data=rows((SLOW_SECRET,)), episode=episode(), max_concurrent_rollouts=4)
    steps, step, collect = [0], loop.engine.step, loop._collect

    def counted():
        steps[0] += 1
        return step()

    def collect_then_open(block):
        if block and not gate.is_set() and not timers:
            timers.append(threading.Timer(0.2, gate.set))
            timers[0].start()
        collect(block)

    timers = []
    loop.engine.step, loop._collect = counted, collect_then_open
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(timers) == 1 and len(batch) == 4
    idle = steps[0] - loop.engine.stats()["steps"]  # step() calls that found nothing to run
    assert idle <= 4, (idle, steps[0])  # at most one per episode that ended on a reply; a busy loop makes thousands
    assert metrics["rollout/tool_wait_s"] >= 0.1  # the wait began before the timer started


@pytest.mark.parametrize("make", [make_loop, respond_loop], ids=["tools", "respond"])
def test_background_tools_give_the_episodes_of_the_loop_that_waits(make):
    """Instant tools (guess_number) and an instant respond (sum_feedback): each episode's tokens, mask, rewards and
    logprobs are those of the loop that runs every step's tools before the next step."""
    batches = []
    for background in (False, True):
        cfg = EpisodeConfig(max_turns=6 if make is make_loop else 3, tools_in_background=background)
        loop = make(episode=cfg, samples_per_step=8, max_concurrent_rollouts=8) if make is make_loop else \
            make(episode=cfg, size=8, samples_per_step=8, max_concurrent_rollouts=8)
        batch, metrics = loop.next_batch(trainer_version=0)
        batches.append(sorted(batch, key=lambda s: (s.prompt_ids, s.completion_ids)))
        assert metrics["rollout/dropped_episodes"] == 0 and metrics["episode/turns_mean"] > 1
    assert len(batches[0]) == len(batches[1]) == 8
    for a, b in zip(*batches, strict=True):
        assert (a.prompt_ids, a.completion_ids, a.completion_mask, a.reward, a.advantage) == \
            (b.prompt_ids, b.completion_ids, b.completion_mask, b.reward, b.advantage)
        assert max(abs(x - y) for x, y in zip(a.engine_logprobs, b.engine_logprobs, strict=True)) < 1e-4


def test_the_loop_frees_kv_only_when_an_episode_ended():
    """Engine.release drains the overlapped decode's step in flight: the loop calls it only with episodes to free,
    not after every step (it did, which kept a multi-turn rollout's decode from ever overlapping the host)."""
    loop = make_loop(episode=episode())
    calls, release = [], loop.engine.release

    def recorded(ids):
        ids = list(ids)
        calls.append(ids)
        return release(ids)

    loop.engine.release = recorded
    loop.next_batch(trainer_version=0)
    assert calls and all(calls)


def test_a_reply_joins_its_episode_an_engine_step_after_its_turn_ended(monkeypatch):
    """A reply that is already in (here every call runs inline) joins its episode only after the next engine step,
    unless the engine has nothing else to decode: a call that returns at once has then always returned, so the
    episodes do not hang on the threads' timing. An ended episode's KV is freed at once."""

    def inline(fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future

    monkeypatch.setattr(episodes_loop, "in_background", inline)
    loop = make_loop(data=rows((7, 3)), episode=episode(), max_concurrent_rollouts=8)
    ended_at, blocking, seen = {}, [False], []
    land, collect, extend, release = loop._land, loop._collect, loop.engine.extend, loop.engine.release

    def landed(completions):
        ended_at.update((c.request_id, loop.steps + 1) for c in completions)  # the step this _land counts
        land(completions)

    def collected(block):
        blocking[0] = block
        collect(block)
        blocking[0] = False

    def extended(rid, tokens, params=None):
        seen.append(("extend", loop.steps > ended_at[rid], blocking[0]))
        return extend(rid, tokens, params)

    def released(ids):
        ids = list(ids)
        seen.extend(("release", loop.steps > ended_at[rid], False) for rid in ids)
        return release(ids)

    loop._land, loop._collect, loop.engine.extend, loop.engine.release = landed, collected, extended, released
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 4 and metrics["episode/turns_mean"] > 1
    assert {kind for kind, _, _ in seen} == {"extend", "release"}
    assert all(later or idle for kind, later, idle in seen if kind == "extend"), seen
    assert any(later and not idle for kind, later, idle in seen if kind == "extend")
    assert not any(later for kind, later, _ in seen if kind == "release"), seen
