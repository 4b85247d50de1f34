"""What the rollout loop and the trainer see of an engine: the local ``Engine`` and the clients of ``unison serve``
servers (``unison.rollout.remote.RemoteEngine``) alike.

A group's ids are data: ``submit`` returns its request ids and every ``Completion`` carries its ``request_id`` and
``group_id``. Callers key their bookkeeping by those and never parse them.

>>> ids = engine.submit([1, 2, 3], SamplingParams(n=4))
>>> done = [c for _ in range(100) for c in engine.step()]
>>> with engine.lend() as lent:  # the training step
...     train()
>>> engine.weights_updated(version=1)
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

from .types import Completion, SamplingParams


class GenerationEngine(Protocol):
    @property
    def version(self) -> int:
        """The weight version new tokens are sampled with (what ``Completion.weight_versions`` records)."""

    @property
    def num_unfinished(self) -> int:
        """Submitted samples whose completions have not come out of ``step()`` yet."""

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[str]:
        """Queue ``params.n`` samples of one prompt (one group). Returns their request ids; raises ValueError for a
        request the engine refuses up front (an empty prompt, one longer than the context). The local engine and
        the servers' clients also take ``images=`` (a vision-language prompt's ``unison.vision.prompt.ImagePrompt``);
        the rollout loop passes it only for rows with images."""

    def step(self) -> list[Completion]:
        """Advance generation; returns the completions that finished since the last call, aborted ones included."""

    def abort(self, request_ids: Iterable[str]) -> int:
        """Stop these requests: each comes out of the next ``step()`` as an "abort" completion. Returns how many were
        unfinished; unknown and finished ids are ignored."""

    def weights_updated(self, version: int) -> None:
        """The policy's weights are now ``version``: what is sampled from here on is stamped with it, and nothing
        computed with the old weights is served again from a cache."""

    def lend(self) -> AbstractContextManager[int]:
        """Lend the engine's device memory to the caller for a ``with`` block (the training step); yields the bytes
        lent, 0 where the engine holds none on this device."""
