"""The decode step through static buffers, captured as CUDA graphs at a ladder of batch sizes.

A decode step of n requests runs at the smallest ladder size b >= n; rows n..b-1 are padding that attends to,
and writes into, a scratch block of the pool that no request owns. Each size is captured the first time it is
needed (decoder forward and the fp32 lm_head of every row, head transform included; sampling stays outside, so
per-request generators and sampling parameters need no graph) and replayed after that. The capture runs with
``fused_norms``, ``fused_rope``, ``fused_projections`` and ``fused_layers``: each RMSNorm is one kernel instead of
eight, RoPE of q and k one instead of ten, and on the GPU the q/k/v projections one instead of three, gate/up with
the SwiGLU one instead of four, o_proj and down_proj with K in shares up to 64 rows, each residual add joined to
the norm after it, q/k norms, RoPE and the K/V write one kernel; on Hopper each of these kernels starts before the
one in front of it has finished (``gdc``: programmatic dependent launch, kept in the graph). The graphs read the
parameters and the KV pool at their addresses: in-place optimizer updates need nothing, and they stay valid as
long as neither tensor is reallocated. Without CUDA (the CPU tests) the same
forward runs eagerly through the same buffers.

Per step the host fills one pinned buffer (token, position, slot and context length of each row, then the
block tables), which reaches the device in one copy; two device copies spread it into the static inputs. Two such
buffers take turns, so the host can fill the next step's while the device has yet to copy the last one (the
engine's overlapped decode, ``EngineConfig.async_scheduling``); that step's input tokens can come from the device
(the tokens the last step sampled) instead of the host.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from itertools import chain

import numpy as np
import torch

from . import mla
from . import state as layer_state
from .attention import NO_MASK
from .backend import PagedBatch
from .cache import KVPool
from .fused_layer import fused_layers
from .fused_linear import fused_projections
from .fused_norm import fused_norms
from .fused_rope import fused_rope
from .lm_head import LMHead
from .swaps import KernelSwaps
from .triton_backend import TritonPagedBackend


@contextmanager
def fused_kernels(decoder: torch.nn.Module):
    """The engine's forwards run inside this: every RMSNorm one kernel, RoPE of q and k one, (on the GPU, up to
    ``fused_linear``'s row limits) the q/k/v and gate/up projections one each, and (on the GPU) each residual add
    in its norm's kernel, q/k norms, RoPE and the K/V write in one (``fused_layer``)."""
    modules = list(decoder.modules())  # one walk for the four (the engine plans them once: unison.engine.swaps)
    with (fused_norms(decoder, modules=modules), fused_rope(decoder, modules=modules),
          fused_projections(decoder, modules), fused_layers(decoder)):
        yield


@contextmanager
def no_collection():
    """Python's cyclic garbage collector off until the block ends: a CUDA graph captures inside it.

    A finalizer that runs during a capture may call what capturing forbids, and the capture ends invalidated
    (cudaErrorStreamCaptureInvalidated): Triton's ``CompiledKernel.__del__`` unloads its CUDA module, and cyclic
    garbage is collected whenever allocations pass the collector's threshold. A GRPO run's first decode capture
    ended so once, on a fresh H200 machine (issue 23's notes; not reproduced: a finalizer is the cause found, not
    one seen). Triton's own ``cuda_graph_without_gc`` does the same. (Not collecting first: a full collection takes
    ~0.15 s with transformers loaded, and garbage left waiting is not collected inside either.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 128, of 32 beyond: at most ~1/8 of a step is padding."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 128 else 32)
    sizes.append(max_batch)
    return sizes


class DecodeRunner:
    def __init__(self, decoder: torch.nn.Module, lm_head: LMHead, pool: KVPool,
                 backend: TritonPagedBackend, max_batch: int, max_context: int, scratch_block: int,
                 local_forward: Callable[[], ContextManager] = nullcontext,
                 states: layer_state.StatePool | None = None):
        self.decoder = decoder
        self.lm_head = lm_head
        self.pool = pool
        self.backend = backend
        self.block_size = bs = backend.block_size
        self.max_context = max_context
        self.scratch_block = scratch_block
        self.swaps = KernelSwaps(decoder, fused_kernels)  # fused_kernels, planned once (the engine's eager steps too)
        self.local_forward = local_forward  # tensor parallelism: the local shards (unison.dist.tensor_parallel)
        self.heartbeat = getattr(local_forward, "heartbeat", None)  # ... and a collective NCCL's watchdog sees
        self.states = states  # a hybrid model's per-request layer states: each row's slot is a fifth meta row
        self.sizes = batch_ladder(max_batch)
        self.max_batch = n = self.sizes[-1]
        self.max_blocks = w = -(-max_context // bs)
        dev = pool.storage.device
        self.use_graphs = dev.type == "cuda"
        self.rows = m = 5 if states is not None else 4
        self.meta = torch.zeros(m, n, dtype=torch.int64, device=dev)  # token, position, slot, context length[, state]
        self.tables = torch.full((n, w), scratch_block, dtype=torch.int64, device=dev)
        self.stage = torch.empty(m * n + n * w, dtype=torch.int64, device=dev)
        # Two pinned buffers, alternating: a step's copy is enqueued behind the last step's work, and the engine
        # waits for the step before last (its sampled tokens) before filling that step's buffer again.
        self.hosts = [torch.empty(m * n + n * w, dtype=torch.int64, pin_memory=self.use_graphs) for _ in range(2)]
        self._turn = 0
        # Every batch size's logits, and the row graphs': one buffer outside the graphs' memory pool, which each step
        # overwrites (its sampling reads it before the next step's graph, in stream order). A graph's own output
        # would stay allocated in the pool, one per captured size: rows summed over the ladder (1,543 at 256).
        self.logits = torch.empty(n, lm_head.weight.shape[0], dtype=torch.float32, device=dev)
        self.mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Every capture's warm-up on this one stream: PyTorch keeps a cuBLAS workspace for each stream a GEMM ran on
        # (32 MiB on Hopper), and a new stream a capture took one more, for good (pytorch/pytorch#99196).
        self.warm_stream = torch.cuda.Stream(dev) if self.use_graphs else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, object, object]] = {}
        self.num_captured = 0

    def reset(self) -> None:
        """Forget every captured graph (the pool moved); each batch size is captured again on its next use."""
        self.graphs.clear()

    def __call__(self, tokens: list[int], positions: list[int], slots: list[int],
                 block_tables: list[list[int]], state_slots: list[int | None] | None = None,
                 rope_shift: list[int] | None = None, device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token per request, at ``positions`` (its KV goes to ``slots``, a hybrid layer's state is in
        ``state_slots``; ``rope_shift``: a vision-language prompt's multimodal RoPE rotates the token by its position
        plus the shift). ``device_tokens``: the (n,) input tokens as a device tensor, ``tokens`` then None. Returns
        (n, V) fp32 logits, a view of ``self.logits``, which the next call overwrites."""
        n, m = len(positions), self.rows
        b = next(size for size in self.sizes if size >= n)
        w = max(len(t) for t in block_tables)
        buffer = self.hosts[self._turn]
        self._turn ^= 1
        host = buffer.numpy()
        meta = host[:m * b].reshape(m, b)
        meta[0, :n] = tokens if device_tokens is None else 0
        meta[1, :n], meta[2, :n] = positions, slots
        meta[3, :n] = meta[1, :n] + 1
        if rope_shift is not None:
            meta[1, :n] += rope_shift
        meta[:4, n:] = ((0,), (0,), (self.scratch_block * self.block_size,), (1,))
        if self.states is not None:
            meta[4, :n], meta[4, n:] = state_slots, self.states.scratch
        tables = host[m * b:m * b + b * w]
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
        starts = np.cumsum(lengths) - lengths
        # Row i's blocks at i * w onwards, in one scatter instead of a slice assignment per row.
        at = np.repeat(np.arange(n) * w - starts, lengths) + np.arange(starts[-1] + lengths[-1])
        tables[at] = np.fromiter(chain.from_iterable(block_tables), dtype=np.int64, count=len(at))
        tables[n * w::w] = self.scratch_block
        stage = self.stage[:m * b + b * w]
        stage.copy_(buffer[:m * b + b * w], non_blocking=True)
        self.meta[:, :b].copy_(stage[:m * b].view(m, b))
        self.tables[:b, :w].copy_(stage[m * b:].view(b, w))
        if device_tokens is not None:
            self.meta[0, :n].copy_(device_tokens)
        if b not in self.graphs:
            self.graphs[b], first = self._capture(b)
            if first is not None:  # this step ran as the capture's warm-up: its logits, no replay
                return first[:n]
        graph, out, _ = self.graphs[b]
        if graph is None:
            return out()[:n]  # eager: ``out`` is the forward itself
        graph.replay()
        if self.heartbeat is not None:
            self.heartbeat()
        return out[:n]

    def _capture(self, b: int):
        splits = self.backend.splits_for(b, self.max_context)
        state = self.backend.decode_state(self.tables[:b], self.meta[3, :b], splits)
        states = None
        if self.states is not None:  # a row starting at position 0 (a one-token prompt) starts from zeros
            states = layer_state.StepStates(self.states, self.meta[4, :b], self.meta[1, :b] == 0, [1] * b)
            states.prepare_static()
        batch = PagedBatch(self.pool, self.backend, self.meta[2, :b], state, states)
        ids, positions = self.meta[0:1, :b], self.meta[1:2, :b]

        def forward() -> torch.Tensor:
            with torch.inference_mode(), self.swaps(), self.local_forward():
                if states is not None:
                    torch.eq(positions[0], 0, out=states.fresh)
                hidden = self.decoder(input_ids=ids, position_ids=positions, attention_mask=NO_MASK, paged=batch,
                                      use_cache=False, **mla.forward_kwargs(batch)).last_hidden_state[0]
                if states is not None:
                    layer_state.check_visited(states)
                return self.lm_head(hidden, out=self.logits[:b])

        # Kept with the graph: the tensors its kernels read that nothing else holds (a hybrid's state indices).
        if not self.use_graphs:
            return (None, forward, states), None
        # The warm-up is this step itself: a hybrid layer's state must advance once per step, where rewriting the
        # same KV twice would have been harmless.
        graph, first = self.capture(forward)
        return (graph, self.logits[:b], states), first

    def sampled_forward(self, meta: torch.Tensor, batch: PagedBatch,
                        sample: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The forward of a step of prompt tokens (the row graphs', the pieces'): the decoder over the tokens
        ``meta[0]`` at positions ``meta[1]`` through ``batch``, then the lm_head of the rows ``sample`` into the logits
        buffer, which it returns."""
        ids, positions = meta[0:1], meta[1:2]

        def forward() -> torch.Tensor:
            with torch.inference_mode(), self.swaps(), self.local_forward():
                hidden = self.decoder(input_ids=ids, position_ids=positions, attention_mask=NO_MASK, paged=batch,
                                      use_cache=False).last_hidden_state[0]
                return self.lm_head(hidden.index_select(0, sample), out=self.logits)
        return forward

    def warm_up(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``forward`` run once on the side stream before its capture (kernel compilation, library handles), the
        streams joined after: its output is the step's, and the graph first replays at the next step."""
        side = self.warm_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = forward()
        torch.cuda.current_stream().wait_stream(side)
        return first

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, this step's output): ``forward`` warmed up (``warm_up``), then captured into the runner's memory
        pool. The row graphs capture through this too; the graph pieces warm up alike."""
        first = self.warm_up(forward)
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph, pool=self.mempool):
            forward()
        self.num_captured += 1
        return graph, first
