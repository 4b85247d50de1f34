"""Eager steps through CUDA graphs captured in pieces: every layer's work replays from a graph but its attention,
which runs eagerly between two pieces.

A step that prefills more than the row graphs take (``unison.engine.row_graphs``: more than 2048 tokens at 0.6B, or
rows that would read too many keys) ran eagerly: ~18 launches a layer, each dispatched by the host, and the host was
slower than the device. At the Qwen3-0.6B shape a step of 8192 prompt tokens took 24-49 ms on an H200's host clock
against ~16-18 ms of kernels (bench/results/h200/speed/prefill, goals4): the five such steps of 256 prompts were a
tenth of the decode benchmark's time, and the part that varied from run to run. What the host cannot replace by a
graph is the attention over the chunks (flash varlen over their gathered context): its launches depend on the
step's chunks (their number, their longest query and context). Everything else depends only on the step's token
count. So a step of n tokens is padded to the next size of a ladder (``PIECE_LADDER``, up to the engine's
``max_batch_tokens``), and its forward is captured once per size as L + 1 graphs cut at the L attentions: each cut
copies the layer's queries into a static buffer, the attention (``AttentionBackend.attend``, the step's own state)
runs eagerly over the first n of them into a second buffer, and the next piece reads that. Padding tokens embed token
0 at position 0 and write their K/V into the scratch block (as the decode graphs' padding rows do); no real token
attends to them and no layer mixes rows, so they change nothing but the work. The sampled rows' logits come out in
the decode runner's one buffer.

For the row graphs' models; on by default (``EngineConfig.piece_graphs``; ``UNISON_PIECE_GRAPHS=0`` or ``=1``
decides where set). Without CUDA (the CPU tests, ``UNISON_PIECE_GRAPHS=1``) the same forward runs eagerly
through the same buffers, each cut attending at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .backend import PagedBatch, StepLayout
from .graphs import DecodeRunner, no_collection


def ladder(max_tokens: int) -> list[int]:
    """Token counts a step is padded to: 64 and 96, then powers of two and the halfway sizes between (at most a third
    of a step is padding), up to ``max_tokens``, which is the last."""
    sizes, b = [], 64
    while b < max_tokens:
        sizes.append(b)
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return sizes + [max_tokens]


def enabled(configured: bool, use_graphs: bool) -> bool:
    """``EngineConfig.piece_graphs`` where the engine captures graphs; ``UNISON_PIECE_GRAPHS=1`` turns it on (eagerly
    without graphs: the CPU tests) and ``=0`` off, whatever the config says."""
    env = os.environ.get("UNISON_PIECE_GRAPHS")
    return configured and use_graphs if env is None else env == "1"


@dataclass
class _Cut:
    """One layer's attention between two pieces: its arguments, and the static buffers it reads and writes."""
    layer: int
    scale: float
    window: int | None
    sinks: torch.Tensor | None
    softcap: float | None
    query: torch.Tensor  # (max_tokens, H, Dk)
    out: torch.Tensor  # (max_tokens, H, Dv)


class _CutBatch(PagedBatch):
    """The pieces' paged batch: each layer's K/V written in its piece, its attention a cut (``PieceRunner._cut``)."""

    def __init__(self, runner: PieceRunner, slot_mapping: torch.Tensor):
        super().__init__(runner.runner.pool, runner.runner.backend, slot_mapping, None)
        self.pieces = runner

    def attend_rope(self, *args, **kwargs) -> None:
        return None  # the one-launch decode kernel is for decode steps: the caller writes, then attends (a cut)

    def attend_written(self, layer: int, q: torch.Tensor, scale: float, window: int | None,
                       sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        return self.pieces._cut(layer, q, scale, window, sinks, softcap)


class PieceRunner:
    """``pieces(host, sample_rows, layout)``: an eager step's forward through the graphs of its padded size (``takes``
    first). Shares the decode runner's model, pool, kernel swaps, graph memory pool, warm-up stream and logits
    buffer."""

    def __init__(self, runner: DecodeRunner, max_tokens: int):
        self.runner = runner
        self.sizes = ladder(max_tokens)
        self.max_tokens = max_tokens
        self.max_sampled = runner.max_batch
        dev = runner.pool.storage.device
        self.meta = torch.zeros(3, max_tokens, dtype=torch.int64, device=dev)  # token, position, slot
        self.sample = torch.zeros(self.max_sampled, dtype=torch.int64, device=dev)
        self.logits = runner.logits
        self.buffers: dict[tuple, torch.Tensor] = {}  # the cuts' query and output buffers, by shape and dtype
        self.graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_Cut]]] = {}
        self._pieces: list | None = None  # while capturing: the pieces so far, the last the one being captured
        self._cuts: list[_Cut] = []  # ... and the cuts between them
        self._n = 0  # the step's real tokens
        self._state = None  # the step's attention state (``AttentionBackend.prepare``)

    def reset(self) -> None:
        """Forget every captured graph (the pool moved)."""
        self.graphs.clear()

    def takes(self, tokens: int, sampled: int) -> bool:
        return 0 < tokens <= self.max_tokens and sampled <= self.max_sampled

    def __call__(self, host: np.ndarray, sample_rows: list[int], layout: StepLayout) -> torch.Tensor:
        """host: (3, n) int64, the step's tokens, positions and pool slots; ``sample_rows`` the rows whose logits are
        sampled; ``layout`` the step's chunks (``Engine._forward``'s). Returns (S, V) fp32 logits of those rows, a view
        of the decode runner's buffer, which the next graph step overwrites."""
        r = self.runner
        n, s = host.shape[1], len(sample_rows)
        b = next(size for size in self.sizes if size >= n)
        staged = np.empty(3 * b + self.max_sampled, dtype=np.int64)
        meta = staged[:3 * b].reshape(3, b)
        meta[:, :n] = host
        meta[:, n:] = ((0,), (0,), (r.scratch_block * r.block_size,))
        staged[3 * b:] = 0
        staged[3 * b:3 * b + s] = sample_rows
        device = torch.from_numpy(staged).to(self.meta.device, non_blocking=True)
        self.meta[:, :b].copy_(device[:3 * b].view(3, b))
        self.sample.copy_(device[3 * b:])
        self._n, self._state = n, r.backend.prepare(layout)
        try:
            if b not in self.graphs:
                self.graphs[b], first = self._captured(b)
                if first is not None:  # this step ran as the capture's warm-up
                    return first[:s]
            pieces, cuts = self.graphs[b]
            with torch.inference_mode():
                for piece, cut in zip(pieces, cuts, strict=False):
                    piece.replay()
                    self._attend(cut)
                pieces[-1].replay()
            return self.logits[:s]
        finally:
            self._state = None

    def _captured(self, b: int):
        """((pieces, cuts), this step's logits): eagerly where there are no graphs (``pieces`` is then the forward
        itself, run at every step); else the step runs once on the warm-up stream (its output is the step's), then
        the forward is captured piece by piece into the decode runner's memory pool."""
        r = self.runner
        forward = r.sampled_forward(self.meta[:, :b], _CutBatch(self, self.meta[2, :b]), self.sample)
        if not r.use_graphs:
            return ([_Eager(forward)], []), None
        first = r.warm_up(forward)
        torch.cuda.synchronize()
        with no_collection(), torch.cuda.stream(r.warm_stream):
            pieces, cuts = self._pieces, self._cuts = [self._begin()], []
            try:
                forward()
                pieces[-1].capture_end()
            except BaseException:
                try:
                    pieces[-1].capture_end()
                except RuntimeError:
                    pass  # (already ended, or the capture itself failed)
                raise
            finally:
                self._pieces, self._cuts = None, []
        torch.cuda.current_stream().wait_stream(r.warm_stream)
        r.num_captured += 1
        return (pieces, cuts), first

    def _begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.runner.mempool)
        return graph

    def _cut(self, layer: int, q: torch.Tensor, scale: float, window: int | None, sinks: torch.Tensor | None,
             softcap: float | None) -> torch.Tensor:
        """A layer's attention, called inside the forward with its (T, H, Dk) queries: they go to the static buffer
        (in the piece being captured), the piece ends and the next begins; eagerly, the attention runs at once.
        Returns the (T, H, Dv) buffer the attention writes, which the rest of the layer reads."""
        t = q.shape[0]
        width = self.runner.pool.v[layer].shape[-1]
        cut = _Cut(layer, scale, window, sinks, softcap, self._buffer(q.shape[1:], q.dtype),
                   self._buffer((q.shape[1], width), q.dtype, "out"))
        cut.query[:t].copy_(q)
        if self._pieces is None:
            self._attend(cut)
        else:
            self._pieces[-1].capture_end()
            self._cuts.append(cut)
            self._pieces.append(self._begin())
        return cut.out[:t]

    def _attend(self, cut: _Cut) -> None:
        """The cut's attention over the step's real tokens, eagerly (its launches follow the step's chunks)."""
        n, pool = self._n, self.runner.pool
        out = self.runner.backend.attend(self._state, pool.k[cut.layer], pool.v[cut.layer], cut.query[:n], cut.scale,
                                         cut.window, sinks=cut.sinks, softcap=cut.softcap)
        cut.out[:n].copy_(out)

    def _buffer(self, shape: tuple, dtype: torch.dtype, kind: str = "query") -> torch.Tensor:
        key = (kind, tuple(shape), dtype)
        if key not in self.buffers:  # zeros: padding rows never read anything but finite values
            self.buffers[key] = torch.zeros(self.max_tokens, *shape, dtype=dtype, device=self.meta.device)
        return self.buffers[key]


class _Eager:
    """A forward standing in for a captured piece (no CUDA): ``replay`` runs it."""

    def __init__(self, forward):
        self.replay = forward
