"""Paged attention backends: the seam where fast kernels plug in.

A backend turns one step's layout (which query tokens belong to which request, where each request's context
lives in the pool) into whatever it needs once per step (``prepare``), then serves every layer from it
(``attend``). ``TorchPagedBackend`` is the pure-PyTorch reference: it runs everywhere and is what faster
backends are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

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
    def prepare(self, layout: StepLayout) -> object:
        """Per-step state shared by all layers (indices, masks, kernel metadata)."""

    def attend(self, state: object, k_pool: torch.Tensor, v_pool: torch.Tensor, q: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """q: (N, H, D); k_pool, v_pool: (slots, KVH, D), this step's K/V already written. Returns (N, H, D)."""


class PagedBatch:
    """Engine metadata passed as ``model(..., paged=batch)``; the attention function calls ``attend``."""

    def __init__(self, pool: KVPool, backend: AttentionBackend, slot_mapping: torch.Tensor, state: object):
        self.pool = pool
        self.backend = backend
        self.slot_mapping = slot_mapping
        self.state = state

    @classmethod
    def for_layout(cls, pool: KVPool, backend: AttentionBackend, layout: StepLayout) -> PagedBatch:
        return cls(pool, backend, layout.slot_mapping, backend.prepare(layout))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """q: (N, H, D); k, v: (N, KVH, D) of the new tokens. Writes K/V to the pool, returns (N, H, D)."""
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        k_pool.index_copy_(0, self.slot_mapping, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.slot_mapping, v.to(v_pool.dtype))
        return self.backend.attend(self.state, k_pool, v_pool, q, scale, window)


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
               scale: float, window: int | None) -> torch.Tensor:
        out = torch.empty_like(q)
        gqa = q.shape[1] != k_pool.shape[1]
        if state.decode_tokens is not None:
            qd = q[state.decode_tokens].unsqueeze(2)  # (Sd, H, 1, D)
            kd = k_pool[state.decode_slots].transpose(1, 2)  # (Sd, KVH, Lmax, D)
            vd = v_pool[state.decode_slots].transpose(1, 2)
            mask = _key_mask(state.decode_pos, state.decode_qpos[:, None], window)  # (Sd, Lmax)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask[:, None, None, :], scale=scale,
                                               enable_gqa=gqa)
            out[state.decode_tokens] = o.squeeze(2)
        prefill_reference(state.prefills, k_pool, v_pool, q, out, scale, window)
        return out


def context_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """(length,) int64 pool slots of a sequence's first ``length`` positions."""
    positions = torch.arange(length)
    blocks = torch.tensor(block_table[: -(-length // block_size)], dtype=torch.int64)
    return blocks.repeat_interleave(block_size)[:length] * block_size + positions % block_size


def prefill_reference(prefills: list[tuple[int, int, torch.Tensor]], k_pool: torch.Tensor, v_pool: torch.Tensor,
                      q: torch.Tensor, out: torch.Tensor, scale: float, window: int | None) -> None:
    """Multi-token chunks one request at a time: (token start, token end, context slots) each; writes ``out``."""
    gqa = q.shape[1] != k_pool.shape[1]
    for start, end, slots in prefills:
        qp = q[start:end].transpose(0, 1)  # (H, T, D)
        kp, vp = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # (KVH, L, D)
        length, t = slots.shape[0], end - start
        if t == length and window is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            keys = torch.arange(length, device=q.device)
            queries = torch.arange(length - t, length, device=q.device)
            mask = _key_mask(keys[None, :], queries[:, None], window)  # (T, L)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)


def _key_mask(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility; padded keys carry position -1 and are never visible."""
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask
