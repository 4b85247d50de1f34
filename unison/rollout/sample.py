"""A scored sample: what the rollout loop hands to the trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt, scored, with its group advantage.

    ``engine_logprobs[i]`` is the engine's logprob of ``completion_ids[i]`` under the distribution it was
    sampled from (after temperature); ``weight_versions[i]`` the weight version that sampled it.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    engine_logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    reward: float
    advantage: float
    group_id: str = ""
    finish_reason: str = "stop"

    def __post_init__(self):
        if not self.prompt_ids or not self.completion_ids:
            raise ValueError("a Sample needs a non-empty prompt and completion")
        if len(self.engine_logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.engine_logprobs)} engine logprobs for {len(self.completion_ids)} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0
