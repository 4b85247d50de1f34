"""Steps with prompt chunks as rows of a captured graph: every token a query row, attended by the decode kernel.

A step that prefills anything runs eagerly: ~450 launches whose host dispatch is most of its time (a 0.6B step of
4096 prompt tokens: 40-43 ms on an H100, 9.4 ms of it kernels; ~50 ms an eager step of a multi-turn rollout,
`bench/results/h100/speed/goals3/`). Yet a chunk's token is a query like a decode token, only with its chunk's
earlier tokens among its keys: row ``p`` of a chunk attends to its request's positions ``0..p``, which the paged
decode kernel computes from the request's block table and a context length of ``p + 1``. So a step of short chunks
(a GRPO rollout's prompts, a tool reply appended to a conversation, decode rows beside them) runs as the decode
graphs run, one row per token, in graphs captured per row count (``ROW_LADDER``): the step's host work is filling
the rows' metadata and one replay.

Each row's keys are read from the pool by the decode kernel, so the attention reads ``sum over rows of (p + 1)``
keys a layer where flash over the chunk reads each once: a step takes this path only while those bytes stay under
``ROW_KV_BYTES`` a layer. The K/V of every row are written (``qkv_rope_write``) before any row attends (the decode
kernel, the launch after it), never in one launch (``unison.engine.rope_decode``: a program would read keys that
another program of the same launch writes).

On wherever the engine captures graphs (``EngineConfig.row_graphs=False`` or ``UNISON_ROW_GRAPHS=0`` turns it off;
``bench/row_steps.py`` measures it against the eager step, ``bench/results/h100/speed/rows/``). Not for
vision-language prompts, hybrid layer states, latent (MLA) caches, experts modules or tensor parallelism (not yet
run on two GPUs): those keep the eager step.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .backend import PagedBatch, slots_of
from .graphs import DecodeRunner
from .scheduler import ScheduledChunk

ROW_LADDER = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
"""Row counts a graph is captured for; a step's rows are padded up to the next (each padding row one key of the
scratch block)."""
ROW_KV_BYTES = 6 * 2**30
"""Key and value bytes a layer the rows may read; more, and the step runs eagerly with flash, which reads each key
once. On an H100 (bench/results/h100/speed/rows/row_steps_*.json, 0.6B and 1.7B) every measured step within this
and ``ROW_TOKEN_PARAMS`` ran 1.15-14x faster as rows than eagerly; past 8-11 GiB the eager step won (its host
dispatch and the rows' key reads both grow with the layers, so the budget is a layer's)."""
ROW_TOKEN_PARAMS = 1024 * 1.75e9
"""Rows times the decoder's parameters (its embedding aside) a step may take: 2048 rows at 0.6B, 1024 at 1.7B (where
2048 rows lost to the eager step), 384 at 4B (unmeasured), 256 at 8B, where the GEMMs rather than the eager step's
host dispatch set the step's time: there every measured step of 128 or 256 rows ran 1.35-2.7x faster as rows, and
512 rows won at 1.4 GB of keys a layer, broke even at 3 GB and lost at 5 GB (``rows/crossover_8b``, an H100)."""


def enabled(use_graphs: bool) -> bool:
    """On where the engine captures graphs, unless ``UNISON_ROW_GRAPHS=0``; ``=1`` takes it eagerly too (the CPU's
    tests, in Triton's interpreter)."""
    env = os.environ.get("UNISON_ROW_GRAPHS")
    return use_graphs if env is None else env == "1"


class RowRunner:
    """``rows(chunks)``: a step's chunks one row per token, through a graph captured for the padded row count
    (``takes(chunks)`` first). Shares the decode runner's model, pool, kernel swaps, graph memory pool and logits
    buffer."""

    def __init__(self, runner: DecodeRunner):
        self.runner = runner
        embed = runner.decoder.get_input_embeddings().weight
        params = sum(p.numel() for p in runner.decoder.parameters()) - embed.numel()
        self.max_rows = n = max([b for b in ROW_LADDER if b * params <= ROW_TOKEN_PARAMS], default=0)
        self.max_sampled = max_sampled = runner.max_batch  # (the engine's max_num_seqs)
        dev = runner.pool.storage.device
        self.meta = torch.zeros(4, n, dtype=torch.int64, device=dev)  # token, position, slot, context length
        self.tables = torch.full((n, runner.max_blocks), runner.scratch_block, dtype=torch.int64, device=dev)
        self.sample = torch.zeros(max_sampled, dtype=torch.int64, device=dev)
        # The sampled rows' logits, written by every graph into the decode graphs' buffer (a step's logits are read
        # before the next step writes any).
        self.logits = runner.logits
        widest = max(runner.pool.layers, key=lambda kv: kv.kv_heads * kv.width)
        self.key_bytes = widest.kv_heads * widest.width * runner.pool.storage.element_size()  # a key a layer, at most
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, object]] = {}

    def reset(self) -> None:
        """Forget every captured graph (the pool moved)."""
        self.graphs.clear()

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step of these chunks fits: its rows, its sampled rows, and the keys its rows read a layer (row
        ``p`` reads ``p + 1``) within ``ROW_KV_BYTES``."""
        rows = sum(c.length for c in chunks)
        keys = sum(c.length * (2 * c.start + c.length + 1) // 2 for c in chunks)
        return (0 < rows <= self.max_rows and sum(c.samples for c in chunks) <= self.max_sampled
                and 2 * keys * self.key_bytes <= ROW_KV_BYTES)

    def __call__(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The step's forward, one row per token: (S_sampling, V) fp32 logits of the chunks that sample, in order
        (``Engine._forward``'s contract), a view of a static buffer that the next call overwrites."""
        r = self.runner
        bs = r.block_size
        tokens, positions, slots, spans, sample_rows = [], [], [], [], []
        for chunk in chunks:
            req, start, end = chunk.request, chunk.start, chunk.start + chunk.length
            spans.append((len(tokens), req.blocks))  # the chunk's first row; its rows share the request's table
            tokens += req.token_slice(start, end)
            positions.append(np.arange(start, end))
            slots.append(slots_of(req.blocks, start, end, bs))
            if chunk.samples:
                sample_rows.append(len(tokens) - 1)
        n, s = len(tokens), len(sample_rows)
        b = next(size for size in ROW_LADDER if size >= n)
        w = max(len(blocks) for _, blocks in spans)
        meta = np.empty((4, b), dtype=np.int64)  # token, position, slot, context length; padding rows at the end
        meta[0, :n], meta[1, :n], meta[2, :n] = tokens, np.concatenate(positions), np.concatenate(slots)
        meta[3, :n] = meta[1, :n] + 1
        meta[:, n:] = ((0,), (0,), (r.scratch_block * bs,), (1,))
        table = np.full((b, w), r.scratch_block, dtype=np.int64)
        for (first, blocks), chunk in zip(spans, chunks, strict=True):
            table[first:first + chunk.length, :len(blocks)] = blocks
        sample = np.zeros(self.max_sampled, dtype=np.int64)
        sample[:s] = sample_rows
        host = torch.from_numpy(np.concatenate([meta.ravel(), table.ravel(), sample]))
        device = host.to(self.meta.device, non_blocking=True)
        self.meta[:, :b].copy_(device[:4 * b].view(4, b))
        self.tables[:b, :w].copy_(device[4 * b:4 * b + b * w].view(b, w))
        self.sample.copy_(device[4 * b + b * w:])
        if b not in self.graphs:
            self.graphs[b], first = self._capture(b)
            if first is not None:  # this step ran as the capture's warm-up
                return first[:s]
        graph, forward = self.graphs[b]
        if graph is None:
            return forward()[:s]  # eager (the CPU)
        graph.replay()
        return self.logits[:s]

    def _capture(self, b: int):
        r = self.runner
        # One split: a row's context is at most its chunk's end, and rows are many.
        state = r.backend.decode_state(self.tables[:b], self.meta[3, :b], 1)
        state.rows_share_context = True  # K/V written before any row attends: never the one launch
        forward = r.sampled_forward(self.meta[:, :b], PagedBatch(r.pool, r.backend, self.meta[2, :b], state),
                                    self.sample)
        if not r.use_graphs:
            return (None, forward), None
        graph, first = r.capture(forward)
        return (graph, None), first
