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

import numpy as np
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
    """Pack ``samples`` into as few rows of at most ``max_tokens_per_row`` tokens as first-fit-decreasing
    finds, the first one full and the others balanced (``balanced_rows``).

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
    rows = balanced_rows([s.num_tokens for s in samples], max_tokens_per_row)
    return [_build_row([samples[i] for i in members], members, pad_id, pad_to) for members in rows]


def balanced_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """As many bins as ``first_fit_decreasing`` needs; the first one as it fills it, the others balanced: their
    items placed longest first into the emptiest bin with room (first-fit-decreasing's bins where that does not
    place every item).

    Every packed row costs the host the same launches whatever its length: ~45 ms of forward and ~55 ms of backward
    launches for Qwen3-0.6B on the H200 host, against ~9.4 ms of GPU work per 1000 tokens. The first row's forward
    starts on an idle GPU, so it is kept full (its GPU work outlasts its launches); after it the host runs ahead,
    and a short last row's launches would outlast the GPU's lead: 64 x 576 tokens in rows of 16384 made rows of
    16128, 16128 and 4608 tokens (``bench/results/h200/speed/host_gaps``); now 16128, 10368 and 10368.
    """
    bins = first_fit_decreasing(lengths, capacity)
    if len(bins) < 3:
        return bins
    rest = sorted((i for b in bins[1:] for i in b), key=lambda i: -lengths[i])  # ties keep input order
    balanced: list[list[int]] = [[] for _ in bins[1:]]
    loads = [0] * len(balanced)
    for i in rest:
        fits = [b for b in range(len(balanced)) if loads[b] + lengths[i] <= capacity]
        if not fits:
            return bins
        b = min(fits, key=lambda b: loads[b])  # the emptiest; ties: the first
        balanced[b].append(i)
        loads[b] += lengths[i]
    return [bins[0], *balanced]


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
    # Filled in numpy and handed to torch without a copy: torch.tensor over Python lists of a 64 x 576-token step
    # took ~15 ms of the ~20 ms this took, with the GPU idle until the first forward.
    seg_lens = [s.num_tokens for s in samples]
    pad = -sum(seg_lens) % pad_to
    if pad:
        seg_lens.append(pad)
    total = sum(seg_lens)
    input_ids = np.full(total, pad_id, dtype=np.int64)
    targets = np.full(total, pad_id, dtype=np.int64)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seg_lens])
    mask = np.zeros(total, dtype=bool)
    advantages = np.zeros(total, dtype=np.float32)
    engine_lp = np.zeros(total, dtype=np.float32)
    o = 0
    for s in samples:
        p, n = len(s.prompt_ids), s.num_tokens
        input_ids[o:o + p] = s.prompt_ids
        input_ids[o + p:o + n] = s.completion_ids
        targets[o:o + n - 1] = input_ids[o + 1:o + n]  # the segment's last position keeps pad_id
        # Position t predicts token t + 1, a completion token iff t >= p - 1 (and t < n - 1).
        at = slice(o + p - 1, o + n - 1)
        trained = True if s.completion_mask is None else np.asarray(s.completion_mask, dtype=bool)
        mask[at] = trained
        advantages[at] = np.where(trained, np.float32(s.advantage), np.float32(0.0))
        engine_lp[at] = s.engine_logprobs
        o += n
    images = tuple(s.images for s in samples) + (None,) * (len(seg_lens) - len(samples))
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg_lens, dtype=torch.int32), 0)
    return PackedRow(
        input_ids=torch.from_numpy(input_ids).unsqueeze(0),
        position_ids=torch.from_numpy(positions).unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=max(seg_lens),
        targets=torch.from_numpy(targets),
        loss_mask=torch.from_numpy(mask),
        loss_positions=torch.from_numpy(np.flatnonzero(mask).astype(np.int64)),
        advantages=torch.from_numpy(advantages),
        engine_logprobs=torch.from_numpy(engine_lp),
        sample_index=tuple(index),
        images=images if any(i is not None for i in images) else (),
    )
