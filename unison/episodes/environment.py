"""Environments, in TRL's shape: ``environment_factory()`` makes one object per episode; ``reset(**row)`` starts the
episode (it may return an observation, appended to the prompt's last user message); every other public method is a
tool (type hints and a docstring, as for plain tool functions). Reward functions receive the episodes' objects as
``environments``, aligned with ``completions``.

>>> class GuessTheNumber:
...     def reset(self, secret: int, **row) -> str:
...         self.secret, self.solved = secret, False
...         return "I picked a number from 1 to 100."
...
...     def guess(self, number: int) -> str:
...         '''Guess the secret number.
...
...         Args:
...             number: Your guess.
...         '''
...         self.solved = number == self.secret
...         return "correct" if self.solved else ("higher" if number < self.secret else "lower")
>>> def solved(prompts, completions, environments, **_):
...     return [float(env.solved) for env in environments]

An environment may also answer the model's plain text, as verifiers' ``MultiTurnEnv.env_response`` does: after a
model turn without tool calls (and not cut by the token limit), ``respond(text)`` gets the turn's text; a string it
returns is the next user message, None ends the episode. ``respond`` is, like ``reset``, not a tool; an environment
with ``respond`` needs no tools at all. It sees the last turn of ``episode.max_turns`` too (so its state counts the
final answer), though its reply to that one is not shown.

>>> class Countdown:
...     def reset(self, **row) -> str:
...         self.left = 2
...         return "Say anything, twice."
...
...     def respond(self, text: str) -> str | None:
...         self.left -= 1
...         return f"{self.left} to go." if self.left else None
>>> environment_tools(Countdown())
[]

A tool method or ``respond`` that raises or hangs past ``episode.tool_timeout_s`` (or a ``reset`` that raises)
ends its episode, which is dropped and counted (``rollout/dropped_episodes``): the environment's state can no longer
be trusted. Plain tool functions, stateless, instead report their exceptions to the model.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

RESERVED = ("reset", "respond")
"""Environment methods the loop calls itself: never offered to the model as tools."""


def environment_tools(env: object) -> list[Callable]:
    """The environment's public methods other than ``reset`` and ``respond``: its tools, bound to it."""
    tools = []
    for name, member in inspect.getmembers(type(env)):
        if name.startswith("_") or name in RESERVED or not callable(member) or isinstance(member, type):
            continue
        tools.append(getattr(env, name))
    if not tools and not responds(env):
        raise ValueError(f"environment {type(env).__name__} has no public methods besides reset and no "
                         "respond(text) method: it offers the model no tools and answers none of its turns")
    return tools


def responds(env: object | None) -> bool:
    """Whether the environment answers the model's plain text (has ``respond(text)``)."""
    return env is not None and callable(getattr(env, "respond", None))


@dataclass(frozen=True)
class Failed:
    """An environment call that raised (or ran past its timeout), as text: ``why`` reads "ValueError: ...". Plain
    data, so that tensor-parallel rank 0, which alone runs the environments, can send it to the other ranks."""

    why: str


def respond_all(turns: list[tuple[object, str]], timeout_s: float) -> list[str | None | Failed]:
    """``env.respond(text)`` of every (environment, turn text), at once, each in a thread under ``timeout_s``: the
    reply as text (None: the episode ends), or what it raised (``Failed``; "TimeoutError: ..." for one past its
    timeout); results in order."""
    results: list = [Failed(f"TimeoutError: respond() took longer than {timeout_s:g} s")] * len(turns)

    def run(i: int) -> None:
        env, text = turns[i]
        try:
            reply = env.respond(text)
            results[i] = None if reply is None else str(reply)
        except Exception as e:  # a user's environment must not end the run: the caller drops the episode
            results[i] = Failed(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(turns))]
    deadline = time.perf_counter() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.perf_counter(), 0.0))
    return list(results)  # a copy: a thread past its timeout may still write into results


def reset_environment(env: object, row: dict) -> str | None:
    """``env.reset(**row)``; its observation as text (None if it returned none). Exceptions propagate: the caller
    drops the episode."""
    reset = getattr(env, "reset", None)
    if reset is None:
        raise ValueError(f"environment {type(env).__name__} has no reset(**row) method")
    observation = reset(**row)
    return None if observation is None else str(observation)
