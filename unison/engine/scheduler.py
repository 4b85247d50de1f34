"""Admission, chunked prefill, decode and preemption over the block pool.

Each step spends at most ``max_batch_tokens``: running requests first, oldest first (one token each when
decoding, the next chunk when a prefill is under way), then waiting requests in arrival order while blocks and
budget allow. When a running request needs a block and none is free, the youngest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed (prompt and the
tokens it already generated) when admitted again. Any single request fits the pool (``Engine.submit`` checks),
so the oldest request always progresses: no deadlock, no dropped request.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import torch

from .cache import BlockAllocator, prefix_hashes
from .types import SamplingParams


class Request:
    def __init__(self, request_id: str, group_id: str, prompt: list[int], params: SamplingParams,
                 stop_ids: frozenset[int], max_len: int, arrival: int, seed: int | None = None):
        self.request_id = request_id
        self.group_id = group_id
        self.prompt = prompt
        self.params = params
        self.stop_ids = stop_ids
        self.max_len = max_len  # prompt + completion never exceed this (the context, or max_new_tokens)
        self.arrival = arrival
        self.seed = seed  # a seeded request's noise depends only on it (and, fused, on the token index)
        self.generator: torch.Generator | None = None  # the unfused sampler's, made from the seed on first use
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.blocks: list[int] = []
        self.num_computed = 0  # tokens whose KV is in the pool
        self.prefix_hashes: list[int] | None = None

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        if self.seed is not None and self.generator is None:
            self.generator = torch.Generator(device).manual_seed(self.seed)
        return self.generator

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without concatenating the two."""
        p = len(self.prompt)
        head = self.prompt[start:min(end, p)] if start < p else []
        tail = self.output[max(start - p, 0):end - p] if end > p else []
        return head + tail


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length == self.request.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_tokens: int, max_num_seqs: int,
                 prefix_caching: bool):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # ordered by arrival: running[-1] is the youngest
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which served from it

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        bs = self.block_size
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            length = min(req.num_tokens - req.num_computed, budget)
            if req.num_computed + length > len(req.blocks) * bs and not self._grow(req, length):
                preempted = True
                continue  # req itself was preempted; running[i] is now the next one
            chunks.append(ScheduledChunk(req, req.num_computed, length))
            budget -= length
            i += 1
        if not preempted:
            budget = self._admit(chunks, budget)
        return chunks

    def _grow(self, req: Request, length: int) -> bool:
        """Give ``req`` blocks for ``length`` more tokens, preempting the youngest running requests as needed.
        False if ``req`` had to be preempted itself."""
        need = self._blocks_needed(req, length)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        req.blocks += self.allocator.allocate(need)
        return True

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            hits, pending = self._lookup(req)
            if pending:
                deferred.append(req)  # another request is computing this prompt's blocks: share them next step
                continue
            for block in hits:
                self.allocator.acquire(block)
            req.blocks = list(hits)
            req.num_computed = len(hits) * self.block_size
            length = min(req.num_tokens - req.num_computed, budget)
            need = self._blocks_needed(req, length)
            if need > self.allocator.num_free:
                self.allocator.release(req.blocks)
                req.blocks, req.num_computed = [], 0
                deferred.append(req)
                break
            req.blocks += self.allocator.allocate(need)
            self._register_prefix(req)
            self.prefix_queries += len(req.prompt)
            self.prefix_hits += len(hits) * self.block_size
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            chunks.append(ScheduledChunk(req, req.num_computed, length))
            budget -= length
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _lookup(self, req: Request) -> tuple[list[int], bool]:
        if not self.prefix_caching:
            return [], False
        # Blocks covered by the prompt minus its last token: that token is always computed, for its logits.
        cacheable = (len(req.prompt) - 1) // self.block_size
        if req.prefix_hashes is None:
            req.prefix_hashes = prefix_hashes(req.prompt, self.block_size, len(req.prompt) // self.block_size)
        return self.allocator.lookup(req.prefix_hashes[:cacheable])

    def _register_prefix(self, req: Request) -> None:
        if self.prefix_caching:
            for block, h in zip(req.blocks, req.prefix_hashes, strict=False):
                self.allocator.register(block, h)

    def _blocks_needed(self, req: Request, length: int) -> int:
        return max(-(-(req.num_computed + length) // self.block_size) - len(req.blocks), 0)

    def after_forward(self, chunks: list[ScheduledChunk]) -> None:
        """Account for the KV the forward wrote: full prompt blocks become servable from the prefix cache."""
        for chunk in chunks:
            req = chunk.request
            req.num_computed = chunk.start + chunk.length
            if self.prefix_caching and chunk.start < len(req.prompt):  # decode chunks compute no prompt blocks
                full = min(req.num_computed, len(req.prompt)) // self.block_size
                for block in req.blocks[chunk.start // self.block_size:full]:
                    self.allocator.mark_computed(block)

    def preempt(self, req: Request) -> None:
        """Free ``req``'s KV and queue it first, to be recomputed with whatever weights are current then."""
        self.running.remove(req)
        self._drop_kv(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def preempt_all(self) -> int:
        """Every running request back to the queue, its KV dropped. Returns the tokens whose KV it held (what they
        recompute when next scheduled, less any prefix-cache hits)."""
        dropped = sum(req.num_computed for req in self.running)
        for req in reversed(self.running):
            self._drop_kv(req)
            self.waiting.appendleft(req)
        self.running.clear()
        return dropped

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_kv(req)

    def remove(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._drop_kv(req)
                    return req
        return None

    def _drop_kv(self, req: Request) -> None:
        self.allocator.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
