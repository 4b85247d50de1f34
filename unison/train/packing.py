"""Packing scored samples into rows for varlen training forwards.

Samples are placed first-fit-decreasing (by token count) into rows of at most ``max_tokens_per_row``
tokens. Position ids restart at 0 for every sample and ``cu_seqlens`` carries the boundaries to the
attention function and, through ``unison.train.boundaries``, to hybrid models' conv, recurrent and
state-space layers, so no token reaches across samples (``tests/test_packing.py`` and
``tests/test_hybrid_packing.py`` check packed logprobs against per-sample forwards).

Conventions for one sample of prompt length P and completion length C placed at row offset o:
position o + P - 1 + j predicts completion token j (j = 0 .. C-1), so exactly C positions are in the
loss mask and each carries the sample's advantage and the engine's logprob of that token. A multi-turn sample's
``completion_mask`` leaves its tool and environment tokens out of the mask: context only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from unison.rollout.sample import Sample


@dataclass(frozen=True)
class PackedRow:
    """One packed row (batch 1) of T tokens holding ``num_samples`` samples and maybe a padding segment.

    input_ids: (1, T) int64. position_ids: (1, T) int64, restarting at 0 per segment.
    cu_seqlens: (S+1,) int32, ``[0, cumsum(segment lengths)]``; S = num_samples (+1 if padded).
    max_seqlen: the longest segment. targets: (T,) int64, the next token of the same sample (``pad_id``
    at segment ends and in padding). loss_mask: (T,) bool, true where ``targets`` is a completion token;
    loss_positions: (M,) int64, those positions in order (computed on the host: on the GPU finding them waits on it).
    advantages, engine_logprobs: (T,) float32, the sample's advantage and the engine's logprob of the
    target token on masked positions, 0 elsewhere.
    sample_index: for each sample segment in row order, its index in the list given to ``pack_samples``.
    images: per segment (padding included), the sample's images (``unison.vision.prompt.ImagePrompt``) or None;
    empty for a row without images.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    targets: torch.Tensor
    loss_mask: torch.Tensor
    loss_positions: torch.Tensor
    advantages: torch.Tensor
    engine_logprobs: torch.Tensor
    sample_index: tuple[int, ...]
    images: tuple = ()

    @property
    def num_samples(self) -> int:
        return len(self.sample_index)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_loss_tokens(self) -> int:
        return self.loss_positions.numel()  # (the mask's sum would read a device row back)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        """The same row with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def pack_samples(samples: list[Sample], max_tokens_per_row: int, pad_id: int,
                 pad_to: int = 1) -> list[PackedRow]:
    """Pack ``samples`` first-fit-decreasing into rows of at most ``max_tokens_per_row`` tokens.

    Each row is padded with ``pad_id`` to a multiple of ``pad_to`` (1: no padding); the padding is a
    segment of its own so it never extends a sample's attention span. Raises ValueError for a sample
    longer than ``max_tokens_per_row`` or a ``max_tokens_per_row`` that is not a multiple of ``pad_to``.
    """
    if max_tokens_per_row < 1 or pad_to < 1:
        raise ValueError(f"max_tokens_per_row ({max_tokens_per_row}) and pad_to ({pad_to}) must be >= 1")
    if max_tokens_per_row % pad_to:
        raise ValueError(f"max_tokens_per_row ({max_tokens_per_row}) must be a multiple of pad_to ({pad_to})")
    for i, s in enumerate(samples):
        if s.num_tokens > max_tokens_per_row:
            raise ValueError(f"sample {i} has {s.num_tokens} tokens, more than max_tokens_per_row "
                             f"({max_tokens_per_row})")
    rows = first_fit_decreasing([s.num_tokens for s in samples], max_tokens_per_row)
    return [_build_row([samples[i] for i in members], members, pad_id, pad_to) for members in rows]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin indices of ``lengths`` into bins of ``capacity``: longest first, each into the first bin it fits.

    Ties keep input order, so packing is deterministic. Returns, per bin, the indices in placement order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def _build_row(samples: list[Sample], index: list[int], pad_id: int, pad_to: int) -> PackedRow:
    input_ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    mask: list[bool] = []
    advantages: list[float] = []
    engine_lp: list[float] = []
    seg_lens: list[int] = []
    for s in samples:
        tokens = list(s.prompt_ids) + list(s.completion_ids)
        n, p = len(tokens), len(s.prompt_ids)
        input_ids += tokens
        positions += range(n)
        targets += tokens[1:] + [pad_id]
        # Position t predicts tokens[t + 1], a completion token iff t >= p - 1 (and t < n - 1).
        trained = [True] * len(s.completion_ids) if s.completion_mask is None else list(s.completion_mask)
        mask += [False] * (p - 1) + trained + [False]
        advantages += [0.0] * (p - 1) + [float(s.advantage) if t else 0.0 for t in trained] + [0.0]
        engine_lp += [0.0] * (p - 1) + [float(x) for x in s.engine_logprobs] + [0.0]
        seg_lens.append(n)
    pad = -len(input_ids) % pad_to
    if pad:
        input_ids += [pad_id] * pad
        positions += range(pad)
        targets += [pad_id] * pad
        mask += [False] * pad
        advantages += [0.0] * pad
        engine_lp += [0.0] * pad
        seg_lens.append(pad)
    images = tuple(s.images for s in samples) + (None,) * (len(seg_lens) - len(samples))
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int32), 0)
    return PackedRow(
        input_ids=torch.tensor([input_ids], dtype=torch.int64),
        position_ids=torch.tensor([positions], dtype=torch.int64),
        cu_seqlens=cu,
        max_seqlen=max(seg_lens),
        targets=torch.tensor(targets, dtype=torch.int64),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        loss_positions=torch.tensor([t for t, m in enumerate(mask) if m], dtype=torch.int64),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        engine_logprobs=torch.tensor(engine_lp, dtype=torch.float32),
        sample_index=tuple(index),
        images=images if any(i is not None for i in images) else (),
    )
