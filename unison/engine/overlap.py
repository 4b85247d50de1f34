"""Decode steps whose host work overlaps the device's (``EngineConfig.async_scheduling``).

A synchronous step waits for its sampled tokens, then does its bookkeeping (appending, stop checks, the next
schedule, the next step's inputs) while the device idles: 1-2.5 ms of a 3-6 ms decode step of a 0.6B model on an
H200 (bench/results/h200/speed/decode). Overlapped, a decode-only step is launched and left in flight; the next
``Engine.step()`` first launches the step after it, feeding it the in-flight step's sampled tokens on the device,
and only then waits for the in-flight step's tokens and does their bookkeeping, while the device runs the new step.

The launched-ahead step guesses that each of its requests goes on: one that the awaited token stops computes a
token that is thrown away (its logprob never reported, its KV position left uncomputed for a continuable request).
A request that reaches its length limit is known to stop and is left out. Launching ahead needs nothing the host
only learns from the tokens: no waiting request (admission would change the batch), the fused sampler (noise keyed
by the token index, no generator state), no repetition penalty (it reads the tokens so far), no hybrid layer states
(a state advanced by a thrown-away token cannot be taken back), and a free block for every request that starts one.
Otherwise the step waits and the engine runs a synchronous step, as it does for every prefill.

Device-to-host copies of the tokens go to two pinned buffers that take turns: a step's buffer is read before the
step after next is launched, as the runner's and the sampler's input buffers are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .scheduler import Request


@dataclass
class InFlight:
    """A launched decode step: row i fed ``rows[i]``'s token at position ``rows[i][1]`` and sampled the next."""

    rows: list[tuple[Request, int]]
    tokens: torch.Tensor  # (n,) int64 on the device: the next step's input
    host_tokens: torch.Tensor  # (n,) pinned copies, complete once ``event`` has
    host_logprobs: torch.Tensor
    event: torch.cuda.Event | None


class Overlap:
    """The engine's in-flight decode steps, oldest first (at most two: the awaited one and the one launched ahead)."""

    def __init__(self, device: torch.device, max_rows: int):
        self.device = device
        pinned = device.type == "cuda"
        self._tokens = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._logprobs = [torch.empty(max_rows, dtype=torch.float32, pin_memory=pinned) for _ in range(2)]
        self._index = [torch.empty(max_rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self.steps: deque[InFlight] = deque()

    def tokens_of(self, step: InFlight, keep: list[int]) -> torch.Tensor:
        """The sampled tokens of ``step``'s rows ``keep`` (ascending), on the device, without a host sync."""
        if len(keep) == len(step.rows):
            return step.tokens
        index = self._index[self._turn][:len(keep)]  # taking turns with the launches' buffers
        index.numpy()[:] = keep
        return step.tokens.index_select(0, index.to(step.tokens.device, non_blocking=True))

    def launch(self, rows: list[tuple[Request, int]], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Start the copies of a launched step's sampled ``tokens`` and ``logprobs`` to the host."""
        n = len(rows)
        host_tokens, host_logprobs = self._tokens[self._turn][:n], self._logprobs[self._turn][:n]
        self._turn = (self._turn + 1) % len(self._tokens)
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.steps.append(InFlight(rows, tokens, host_tokens, host_logprobs, event))

    def wait(self) -> tuple[InFlight, list[int], list[float]]:
        """The oldest in-flight step, out of flight, with its tokens and logprobs on the host."""
        step = self.steps.popleft()
        if step.event is not None:
            step.event.synchronize()
        return step, step.host_tokens.tolist(), step.host_logprobs.tolist()
