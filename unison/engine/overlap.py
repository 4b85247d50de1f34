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

import time
from collections import deque
from dataclasses import dataclass

import torch

from .parts import uncut
from .scheduler import Request
from .types import Completion


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


class OverlappedSteps:
    """The engine's side of the overlap (``Engine`` takes these methods): launching the step after the one in
    flight, collecting a step's tokens, draining. They use the engine's scheduler, allocator, runner, sampler and
    counters."""

    def _fused_rows(self, reqs: list[Request]) -> bool:
        """Whether the fused sampler samples every one of ``reqs`` from the logits alone."""
        return all(uncut(r.params) and r.params.repetition_penalty == 1 for r in reqs)

    def _decode_ahead(self, hold: bool) -> bool:
        """Launch the decode step after the newest in-flight one, on its requests that may go on, with its sampled
        tokens as input. False (nothing launched) where the host must see those tokens first, or new prefill work
        is due (not ``hold``)."""
        last = self._overlap.steps[-1]
        if ((self.scheduler.waiting or self.scheduler.resumed) and not hold) or len(self._overlap.steps) > 1:
            return False
        bs, keep, rows = self.config.block_size, [], []
        for i, (req, position) in enumerate(last.rows):
            # Its in-flight token is at position + 1; at the length limit that token is its last. A request that
            # finished meanwhile, or was continued with other tokens (extend), has no next token there.
            if (self._requests.get(req.request_id) is req and req.num_tokens == position + 1
                    and position + 2 < req.max_len):
                keep.append(i)
                rows.append((req, position + 1))
        starting = [req for req, position in rows if position // bs >= len(req.blocks)]
        if not rows or len(starting) > self.allocator.num_free:
            return False
        for req in starting:
            req.blocks += self.allocator.allocate(1)
        reqs = [req for req, _ in rows]
        positions = [position for _, position in rows]
        tokens = self._overlap.tokens_of(last, keep)
        shift = [r.images.rope_delta if r.images is not None else 0 for r in reqs] if self.vision else None
        logits = self.runner(None, positions, [r.blocks[p // bs] * bs + p % bs for r, p in rows],
                             [r.blocks for r in reqs], [None] * len(reqs), rope_shift=shift, device_tokens=tokens)
        # Each row samples output token (position + 1 - prompt length) of its request.
        sampled, logprobs = self._sample(logits, reqs, [p + 1 - len(r.prompt) for r, p in rows])
        self._overlap.launch(rows, sampled, logprobs)
        for counter in ("steps", "graph_steps", "ahead_steps"):
            self._counters[counter] += 1
        self._counters["tokens_computed"] += len(rows)
        return True

    def _collect(self) -> list[Completion]:
        """Wait for the oldest in-flight step's tokens and append them; its completions. A row whose request
        stopped (or was aborted) since its launch was a guess: its token is dropped."""
        t1 = time.perf_counter()
        step, tokens, logprobs = self._overlap.wait()
        self._counters["wait_s"] += time.perf_counter() - t1
        finished = []
        for (req, position), token, logprob in zip(step.rows, tokens, logprobs, strict=True):
            if self._requests.get(req.request_id) is not req or req.num_tokens != position + 1:
                continue
            req.num_computed = position + 1
            self._counters["tokens_generated"] += 1
            reason = self._append(req, token, logprob)
            if reason is not None:
                self.scheduler.finish(req)
                finished.append(self._complete(req, reason))
        return finished

    def _drain(self) -> None:
        """Bring every in-flight step's tokens in; their completions come out of the next ``step()``."""
        while self._overlap is not None and self._overlap.steps:
            self._done.extend(self._collect())

    def _drain_rows_of(self, request_ids: list[str]) -> None:
        """Drain before extending or releasing these requests only where one is not parked yet (its completion may
        be in flight). Otherwise the overlap goes on, a parked request's row in flight too: that row is a guess
        launched before its last token was read, which no launch ahead continues and ``_collect`` drops (the
        request's tokens no longer end at its position), and whose K/V write at the request's last position comes
        before, in stream order, any step that writes there again (the continuation's prefill, another request's
        on a freed block)."""
        if self._overlap is None or not self._overlap.steps:
            return
        if any(self.scheduler.parked.get(request_id) is None for request_id in request_ids):
            self._drain()
