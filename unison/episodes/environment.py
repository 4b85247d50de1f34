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

A tool method that raises (or a ``reset`` that does) ends its episode, which is dropped and counted
(``rollout/dropped_episodes``): the environment's state can no longer be trusted. Plain tool functions, stateless,
instead report their exceptions to the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable


def environment_tools(env: object) -> list[Callable]:
    """The environment's public methods other than ``reset``: its tools, bound to it."""
    tools = []
    for name, member in inspect.getmembers(type(env)):
        if name.startswith("_") or name == "reset" or not callable(member) or isinstance(member, type):
            continue
        tools.append(getattr(env, name))
    if not tools:
        raise ValueError(f"environment {type(env).__name__} has no public methods besides reset: it offers the "
                         "model no tools")
    return tools


def reset_environment(env: object, row: dict) -> str | None:
    """``env.reset(**row)``; its observation as text (None if it returned none). Exceptions propagate: the caller
    drops the episode."""
    reset = getattr(env, "reset", None)
    if reset is None:
        raise ValueError(f"environment {type(env).__name__} has no reset(**row) method")
    observation = reset(**row)
    return None if observation is None else str(observation)
