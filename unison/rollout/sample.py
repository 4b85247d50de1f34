"""A scored sample: what the rollout loop hands to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unison.vision.prompt import ImagePrompt


def shown(prompt, completion: str, reward: float, parts: dict[str, float], row: dict) -> dict:
    """A ``Sample.shown``."""
    record = {"prompt": prompt, "completion": completion, "reward": reward,
              **{f"reward/{name}": value for name, value in parts.items()}}
    if "answer" in row:
        record["answer"] = row["answer"]
    return record


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt, scored, with its group advantage.

    ``engine_logprobs[i]`` is the engine's logprob of ``completion_ids[i]`` under the distribution it was
    sampled from (after temperature); ``weight_versions[i]`` the weight version that sampled it.

    A multi-turn episode is one sample whose completion interleaves the model's turns with tool and environment
    tokens: ``completion_mask[i]`` is True where ``completion_ids[i]`` is the model's (trained, with its engine
    logprob), False for context tokens (their logprob entries are placeholders, never used). None: all trained.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    engine_logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    reward: float
    advantage: float
    group_id: str = ""
    finish_reason: str = "stop"
    completion_mask: tuple[bool, ...] | None = None
    images: ImagePrompt | None = field(default=None, compare=False, repr=False)
    """A vision-language prompt's images through the tower (shared by the group's samples)."""
    shown: dict | None = field(default=None, compare=False, repr=False)
    """What the completion log shows of it (``log.completions_every``): the prompt and completion texts as the reward
    functions saw them, the reward, each function's value, the row's answer where it has one."""

    def __post_init__(self):
        if not self.prompt_ids or not self.completion_ids:
            raise ValueError("a Sample needs a non-empty prompt and completion")
        if len(self.engine_logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.engine_logprobs)} engine logprobs for {len(self.completion_ids)} tokens")
        if self.completion_mask is not None and len(self.completion_mask) != len(self.completion_ids):
            raise ValueError(f"a completion mask of {len(self.completion_mask)} for {len(self.completion_ids)} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_loss_tokens(self) -> int:
        """The completion tokens trained on (the model's own)."""
        return len(self.completion_ids) if self.completion_mask is None else sum(self.completion_mask)

    @cached_property
    def oldest_version(self) -> int:
        """The oldest weight version among its tokens. Computed once: the rollout loop checks every ready sample's
        staleness at every engine step (1,000 ready samples of 512 tokens took 5 ms a check, uncached)."""
        return min(self.weight_versions) if self.weight_versions else 0
