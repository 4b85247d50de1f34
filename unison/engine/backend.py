"""Paged attention backends: the seam where fast kernels plug in.

A backend turns one step's layout (which query tokens belong to which request, where each request's context
lives in the pool) into whatever it needs once per step (``prepare``), then serves every layer from it
(``attend``). ``TorchPagedBackend`` is the pure-PyTorch reference: it runs everywhere and is what faster
backends are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .attention_ops import causal_mask, dense_attention, key_visible
from .cache import KVPool


@dataclass
class StepLayout:
    """Host-side description of one engine step's tokens, S requests, N tokens in all.

    ``query_start[s]:query_start[s+1]`` are request s's tokens in the flat batch; they sit at positions
    ``context_len[s] - q_len .. context_len[s] - 1`` of its sequence. ``block_tables[s]`` lists its blocks.
    """

    query_start: list[int]  # (S+1,)
    context_len: list[int]  # (S,) context after this step, new tokens included
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # (N,) int64: pool slot of each new token's K/V


class AttentionBackend(Protocol):
    static_decode: bool
    """Serves an all-decode step from fixed-address tensors (``decode_state``): the engine then runs such steps
    through CUDA graphs (``unison.engine.graphs``)."""

    def prepare(self, layout: StepLayout) -> object:
        """Per-step state shared by all layers (indices, masks, kernel metadata)."""

    def attend(self, state: object, k_pool: torch.Tensor, v_pool: torch.Tensor, q: torch.Tensor, scale: float,
               window: int | None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """q: (N, H, Dk); k_pool: (slots, KVH, Dk), v_pool: (slots, KVH, Dv), this step's K/V already written;
        sinks: (H,) attention sinks or None; softcap: attention logit softcapping or None. Returns (N, H, Dv)."""


class PagedBatch:
    """Engine metadata passed as ``model(..., paged=batch)``; the attention function calls ``attend``."""

    def __init__(self, pool: KVPool, backend: AttentionBackend, slot_mapping: torch.Tensor, state: object,
                 states=None):
        self.pool = pool
        self.backend = backend
        self.slot_mapping = slot_mapping
        self.state = state
        self.states = states  # a hybrid model's per-request layer states this step (unison.engine.state.StepStates)

    @classmethod
    def for_layout(cls, pool: KVPool, backend: AttentionBackend, layout: StepLayout, states=None) -> PagedBatch:
        return cls(pool, backend, layout.slot_mapping, backend.prepare(layout), states)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """q: (N, H, Dk); k: (N, KVH, Dk), v: (N, KVH, Dv) of the new tokens. Writes K/V to the pool, returns
        (N, H, Dv)."""
        k_pool, v_pool = self.pools(layer, k, v)
        write = getattr(self.backend, "write_kv", None)  # a backend's one-kernel write (k, v, pools, slots)
        if write is None or not write(k, v, k_pool, v_pool, self.slot_mapping):
            k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
            v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        return self.attend_written(layer, q, scale, window, sinks=sinks, softcap=softcap)

    def pools(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pools, checked against the widths of the new tokens' keys and values."""
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        if k.shape[1:] != k_pool.shape[1:] or v.shape[1:] != v_pool.shape[1:]:
            raise ValueError(f"layer {layer}: keys {tuple(k.shape[1:])} and values {tuple(v.shape[1:])} per token, "
                             f"but the KV pool holds {tuple(k_pool.shape[1:])} and {tuple(v_pool.shape[1:])} "
                             f"(unison.engine.cache.kv_widths does not know this layer's shapes)")
        return k_pool, v_pool

    def attend_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, q_norm, k_norm, scale: float, window: int | None) -> torch.Tensor | None:
        """q/k norms (modules or None), RoPE (cos, sin: (N, D)), the K/V write and ``attend`` in the backend's one
        launch (``decode_rope``: the Triton backend's, for decode-only steps), or None where the backend has none for
        this step: the caller then writes and attends in two (``unison.engine.fused_layer``)."""
        fused = getattr(self.backend, "decode_rope", None)
        if fused is None:
            return None
        return fused(self.state, self.pool.k[layer], self.pool.v[layer], self.slot_mapping, q, k, v, cos, sin,
                     q_norm, k_norm, scale, window)

    def attend_written(self, layer: int, q: torch.Tensor, scale: float, window: int | None,
                       sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """``attend`` once this step's K/V are in the layer's pools (``unison.engine.fused_layer`` writes them)."""
        return self.backend.attend(self.state, self.pool.k[layer], self.pool.v[layer], q, scale, window, sinks=sinks,
                                   softcap=softcap)


@dataclass
class _TorchState:
    decode_tokens: torch.Tensor | None  # (Sd,) flat index of each single-token query
    decode_slots: torch.Tensor | None  # (Sd, Lmax) pool slots of each decode request's context
    decode_pos: torch.Tensor | None  # (Sd, Lmax) key positions, -1 past the context
    decode_qpos: torch.Tensor | None  # (Sd,) the query's position
    prefills: list[tuple[int, int, torch.Tensor]]  # (token start, token end, context slots (L,))


class TorchPagedBackend:
    """Reference paged attention: gathers each request's context from the pool and runs SDPA.

    Single-token queries (decode) are batched into one padded SDPA; multi-token chunks (prefill, recompute)
    run one request at a time. Attention math in the pool's dtype, as in transformers' SDPA path.
    """

    static_decode = False

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def prepare(self, layout: StepLayout) -> _TorchState:
        bs, dev = self.block_size, self.device
        decode, prefills = [], []
        for s, (start, end) in enumerate(zip(layout.query_start[:-1], layout.query_start[1:], strict=True)):
            length = layout.context_len[s]
            slots = context_slots(layout.block_tables[s], length, bs)
            if end - start == 1:
                decode.append((start, slots, length))
            else:
                prefills.append((start, end, slots.to(dev)))
        if not decode:
            return _TorchState(None, None, None, None, prefills)
        lmax = max(length for _, _, length in decode)
        slots = torch.zeros(len(decode), lmax, dtype=torch.int64)
        pos = torch.full((len(decode), lmax), -1, dtype=torch.int64)
        for i, (_, s, length) in enumerate(decode):
            slots[i, :length] = s
            pos[i, :length] = torch.arange(length)
        qpos = torch.tensor([length - 1 for _, _, length in decode])
        tokens = torch.tensor([start for start, _, _ in decode])
        return _TorchState(tokens.to(dev), slots.to(dev), pos.to(dev), qpos.to(dev), prefills)

    def attend(self, state: _TorchState, k_pool: torch.Tensor, v_pool: torch.Tensor, q: torch.Tensor,
               scale: float, window: int | None, sinks: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        out = q.new_empty(*q.shape[:-1], v_pool.shape[-1])
        if state.decode_tokens is not None:
            qd = q[state.decode_tokens].unsqueeze(2)  # (Sd, H, 1, Dk)
            kd = k_pool[state.decode_slots].transpose(1, 2)  # (Sd, KVH, Lmax, Dk)
            vd = v_pool[state.decode_slots].transpose(1, 2)
            mask = key_visible(state.decode_pos, state.decode_qpos[:, None], window)  # (Sd, Lmax)
            o = dense_attention(qd, kd, vd, scale, mask[:, None, None, :], softcap=softcap, sinks=sinks)
            out[state.decode_tokens] = o.squeeze(2)
        prefill_reference(state.prefills, k_pool, v_pool, q, out, scale, window, sinks=sinks, softcap=softcap)
        return out


def context_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """(length,) int64 pool slots of a sequence's first ``length`` positions."""
    return torch.from_numpy(slots_of(block_table, 0, length, block_size))


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """(end - start,) int64 pool slots of a sequence's positions ``start .. end - 1``."""
    first, last = start // block_size, -(-end // block_size)
    blocks = np.asarray(block_table[first:last], dtype=np.int64)
    slots = (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).ravel()
    return slots[start - first * block_size:end - first * block_size]


def prefill_reference(prefills: list[tuple[int, int, torch.Tensor]], k_pool: torch.Tensor, v_pool: torch.Tensor,
                      q: torch.Tensor, out: torch.Tensor, scale: float, window: int | None,
                      sinks: torch.Tensor | None = None, softcap: float | None = None) -> None:
    """Multi-token chunks one request at a time: (token start, token end, context slots) each; writes ``out``."""
    for start, end, slots in prefills:
        qp = q[start:end].transpose(0, 1)  # (H, T, Dk)
        kp, vp = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # (KVH, L, Dk), (KVH, L, Dv)
        length, t = slots.shape[0], end - start
        if t == length and window is None:
            o = dense_attention(qp, kp, vp, scale, causal=True, softcap=softcap, sinks=sinks)
        else:
            mask = causal_mask(length, t, window, q.device)  # (T, L)
            o = dense_attention(qp, kp, vp, scale, mask, softcap=softcap, sinks=sinks)
        out[start:end] = o.transpose(0, 1)
