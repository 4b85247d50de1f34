"""The fast attention backend: decode queries through the Triton paged kernel, multi-token chunks (prefill,
recompute, chunked prefill after a prefix-cache hit) through varlen attention over their gathered context.

Where varlen attention is missing (the CPU, torch < 2.9) chunks fall back to the reference's per-request SDPA;
the decode kernel then runs in Triton's interpreter, which is how the CPU tests exercise it. Layers that flash
cannot run (attention logit softcapping) take the reference for their chunks on the GPU too; attention sinks
and different key and value widths (MLA) run in both kernels; an MLA latent cache decodes through its own kernel
(``triton_mla``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .attention_ops import torch_varlen_attn, varlen_attention, varlen_supported
from .backend import StepLayout, context_slots, prefill_reference
from .rope_decode import equals_two_launches, rope_paged_decode
from .triton_attention import num_splits, paged_decode
from .triton_mla import is_latent, mla_decode

INTERPRETED_ATTENTION_MULTIPROCESSORS = 1
"""The multiprocessors the decode splits plan for off the GPU (Triton's interpreter: the CPU tests). The interpreter
runs a grid's programs one after another, ~10 ms each at the tests' shapes, so a split doubles a step's attention and
adds the combine's launch, and buys nothing. With eight (as before), the runner's steps split in two (it plans for
the longest context, 512 keys in the tests) and the engine tests' seven slowest files spent 681 s in the
interpreter, 470 of them in the attention and the combine; with one, 398 s (a step splits only where it has fewer
than three (sequence, KV head) programs). The engine's split path keeps its CPU test (tests/test_triton_engine.py
plans one run for eight), the kernels theirs. (The projections' shares plan for an H200's 132 in the interpreter,
``fused_linear.INTERPRETED_MULTIPROCESSORS``: they cost the CPU tests ~12 s in all.)"""


@triton.jit
def _write_kv_kernel(K, V, KP, VP, Slots, sk_t, sk_h, sv_t, sv_h, skp, svp, K_DIM: tl.constexpr,
                     V_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HEADS: tl.constexpr):
    """One token: its keys and values (every KV head) into the pools' rows at its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    i = tl.arange(0, BLOCK_K)
    head, d = i // K_DIM, i % K_DIM
    mask = i < HEADS * K_DIM
    tl.store(KP + slot * skp + i, tl.load(K + t * sk_t + head * sk_h + d, mask=mask), mask=mask)
    j = tl.arange(0, BLOCK_V)
    head, d = j // V_DIM, j % V_DIM
    mask = j < HEADS * V_DIM
    tl.store(VP + slot * svp + j, tl.load(V + t * sv_t + head * sv_h + d, mask=mask), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """``k_pool[slots] = k; v_pool[slots] = v`` in one launch (two index copies otherwise). k: (N, KVH, Dk), v:
    (N, KVH, Dv), each head's row contiguous, of the pools' dtype; the pools' rows contiguous. False (nothing
    written) where that does not hold."""
    if (k.dtype != k_pool.dtype or v.dtype != v_pool.dtype or k.stride(-1) != 1 or v.stride(-1) != 1
            or not k_pool.is_contiguous() or not v_pool.is_contiguous() or 0 in (k.shape[0], k.shape[-1], v.shape[-1])):
        return False
    heads, k_dim, v_dim = k.shape[1], k.shape[2], v.shape[2]
    _write_kv_kernel[(k.shape[0],)](k, v, k_pool, v_pool, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                    k_pool.stride(0), v_pool.stride(0), K_DIM=k_dim, V_DIM=v_dim,
                                    BLOCK_K=triton.next_power_of_2(heads * k_dim),
                                    BLOCK_V=triton.next_power_of_2(heads * v_dim), HEADS=heads, num_warps=4)
    return True


@dataclass
class TritonState:
    decode_rows: torch.Tensor | None  # (Sd,) token index of each decode query; None: the step is all decode
    block_tables: torch.Tensor | None  # (Sd, W) int32
    context_lens: torch.Tensor | None  # (Sd,) int32
    splits: int
    chunk_rows: torch.Tensor | None = None  # (Nc,) token indices of the multi-token chunks
    chunks_only: bool = False  # every token is a chunk's (chunk_rows is then 0..N-1)
    chunk_slots: torch.Tensor | None = None  # (Lc,) their contexts' pool slots, concatenated
    cu_q: torch.Tensor | None = None  # (C+1,) int32
    cu_k: torch.Tensor | None = None  # (C+1,) int32
    max_q: int = 0
    max_k: int = 0
    prefills: list | None = None  # reference fallback: (token start, token end, context slots)
    spans: list | None = None  # the chunks as (token start, token end, host context slots), for per-layer fallback
    rows_share_context: bool = False  # decode rows that attend to each other's new keys (unison.engine.row_graphs)


class TritonPagedBackend:
    static_decode = True  # decode_state: the CUDA-graph runner's step

    def __init__(self, block_size: int, kv_heads: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 block_n: int = 64, num_warps: int = 4, num_stages: int | None = None, rope_decode: bool | None = None):
        self.block_size = block_size
        # decode_rope's one launch: bit for bit the two launches, ~10 ms less a 0.6B GRPO step on an H100
        # (bench/results/h100/speed/rope2/README.md); UNISON_ROPE_DECODE=0 turns it off for the benchmarks' A/B
        self.rope_decode = os.environ.get("UNISON_ROPE_DECODE", "1") != "0" if rope_decode is None else rope_decode
        self.dtype = dtype
        self.kv_heads = kv_heads
        self.device = torch.device(device)
        self.kernel_args = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        cuda = self.device.type == "cuda"
        self.multiprocessors = (torch.cuda.get_device_properties(self.device).multi_processor_count if cuda
                                else INTERPRETED_ATTENTION_MULTIPROCESSORS)
        self.varlen = cuda and torch_varlen_attn is not None  # flash varlen: bf16 and fp16 only (checked per step)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """PagedBatch.attend's K/V write as one kernel for both, on the GPU (in Triton's interpreter a program per
        token costs more than the two index copies it replaces)."""
        return k.is_cuda and write_kv(k, v, k_pool, v_pool, slots)

    def splits_for(self, batch: int, max_context: int) -> int:
        return num_splits(batch, self.kv_heads, max_context, self.multiprocessors, self.kernel_args["block_n"])

    def decode_state(self, block_tables: torch.Tensor, context_lens: torch.Tensor, splits: int) -> TritonState:
        """Every token a decode query, row i of the tables its sequence (the CUDA-graph step)."""
        return TritonState(None, block_tables, context_lens, splits)

    def prepare(self, layout: StepLayout) -> TritonState:
        bs, dev = self.block_size, self.device
        qs, ctx = layout.query_start, layout.context_len
        decode = [s for s in range(len(ctx)) if qs[s + 1] - qs[s] == 1]
        chunks = [s for s in range(len(ctx)) if qs[s + 1] - qs[s] > 1]
        state = TritonState(None, None, None, 1)
        if decode:
            width = max(-(-ctx[s] // bs) for s in decode)
            tables = np.zeros((len(decode), width), dtype=np.int32)
            for i, s in enumerate(decode):
                n = -(-ctx[s] // bs)
                tables[i, :n] = layout.block_tables[s][:n]
            state.block_tables = torch.from_numpy(tables).to(dev)
            state.context_lens = torch.tensor([ctx[s] for s in decode], dtype=torch.int32, device=dev)
            if len(decode) < len(ctx):
                state.decode_rows = torch.tensor([qs[s] for s in decode], dtype=torch.int64, device=dev)
            state.splits = self.splits_for(len(decode), max(ctx[s] for s in decode))
        if chunks:
            spans = [(qs[s], qs[s + 1], context_slots(layout.block_tables[s], ctx[s], bs)) for s in chunks]
            if not self.varlen or self.dtype not in (torch.bfloat16, torch.float16):
                state.prefills = [(a, b, slots.to(dev)) for a, b, slots in spans]
                return state
            state.spans = spans
            q_lens = [b - a for a, b, _ in spans]
            k_lens = [ctx[s] for s in chunks]
            state.chunks_only = not decode
            # One host-to-device copy: the chunks' context slots, their query rows, the cumulative query and key
            # lengths (a copy each, and a tensor built per chunk, were a prefill step's host time).
            host = np.concatenate([slots.numpy() for _, _, slots in spans] + [np.arange(a, b) for a, b, _ in spans]
                                  + [np.cumsum([0] + q_lens), np.cumsum([0] + k_lens)])
            device = torch.from_numpy(host).to(dev, non_blocking=True)
            n_slots, n_rows, c = sum(k_lens), sum(q_lens), len(chunks) + 1
            state.chunk_slots = device[:n_slots]
            state.chunk_rows = device[n_slots:n_slots + n_rows]
            cu = device[n_slots + n_rows:].to(torch.int32)
            state.cu_q, state.cu_k = cu[:c], cu[c:]
            state.max_q, state.max_k = max(q_lens), max(k_lens)
        return state

    def attend(self, state: TritonState, k_pool: torch.Tensor, v_pool: torch.Tensor, q: torch.Tensor,
               scale: float, window: int | None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        layer = dict(sinks=sinks, softcap=softcap)
        if state.decode_rows is None and state.chunk_rows is None and not state.prefills:
            return self.decode(state, k_pool, v_pool, q, scale, window, **layer)
        if state.chunks_only and varlen_supported(q, k_pool, v_pool, softcap):
            # A prefill step: its queries are every token, in order, so no gather of them and no scatter back.
            slots = state.chunk_slots
            return varlen_attention(q, k_pool.index_select(0, slots), v_pool.index_select(0, slots), state.cu_q,
                                    state.cu_k, state.max_q, state.max_k, scale, window, sinks)
        out = q.new_empty(*q.shape[:-1], v_pool.shape[-1])
        if state.block_tables is not None:
            rows = state.decode_rows
            out.index_copy_(0, rows, self.decode(state, k_pool, v_pool, q.index_select(0, rows), scale, window,
                                                  **layer))
        if state.prefills:
            prefill_reference(state.prefills, k_pool, v_pool, q, out, scale, window, **layer)
        if state.chunk_rows is not None:
            rows, slots = state.chunk_rows, state.chunk_slots
            if varlen_supported(q, k_pool, v_pool, softcap):
                o = varlen_attention(q.index_select(0, rows), k_pool.index_select(0, slots),
                                     v_pool.index_select(0, slots), state.cu_q, state.cu_k, state.max_q, state.max_k,
                                     scale, window, sinks)
                out.index_copy_(0, rows, o)
            else:
                spans = [(a, b, slots.to(q.device)) for a, b, slots in state.spans]
                prefill_reference(spans, k_pool, v_pool, q, out, scale, window, **layer)
        return out

    def decode_rope(self, state: TritonState, k_pool, v_pool, slots, q, k, v, cos, sin, q_norm, k_norm, scale,
                    window) -> torch.Tensor | None:
        """``PagedBatch.attend_rope`` in one launch (``rope_paged_decode``) where it is on (``rope_decode``) and
        every token is a decode query of its own request; else None."""
        decode_only = state.block_tables is not None and state.decode_rows is None and state.chunk_rows is None
        if (not self.rope_decode or not decode_only or state.rows_share_context or state.prefills
                or is_latent(k_pool, v_pool)
                or not q.dtype == k.dtype == v.dtype == k_pool.dtype == v_pool.dtype == cos.dtype
                or not equals_two_launches(q.shape[1], k.shape[1], q.shape[2], self.kernel_args["num_warps"])):
            return None
        return rope_paged_decode(q, k, v, cos, sin, k_pool, v_pool, slots, state.block_tables, state.context_lens,
                                 self.block_size, scale, window, q_norm, k_norm, state.splits, **self.kernel_args)

    def decode(self, state: TritonState, k_pool, v_pool, q, scale, window, sinks=None, softcap=None) -> torch.Tensor:
        """The step's decode queries alone (``q``: (Sd, H, Dk), the rows of ``state.decode_rows`` or every row)."""
        if window is None and sinks is None and softcap is None and is_latent(k_pool, v_pool):
            return mla_decode(q, k_pool, v_pool.shape[-1], state.block_tables, state.context_lens, self.block_size,
                              scale, splits=state.splits)
        return paged_decode(q, k_pool, v_pool, state.block_tables, state.context_lens, self.block_size, scale,
                            window, splits=state.splits, sinks=sinks, softcap=softcap, **self.kernel_args)
