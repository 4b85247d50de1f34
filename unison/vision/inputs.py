"""A flat token batch with images in it, as the language model takes it: the placeholders' embeddings replaced by the
vision tower's rows, multimodal RoPE positions, and Qwen3-VL's deepstack features. One function for the engine's
step (a chunk of each scheduled request) and the trainer's packed row (each sample from its start)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from unison.vision.prompt import ImagePrompt


@dataclass(frozen=True)
class Segment:
    """Tokens ``[offset, offset + length)`` of the batch are positions ``[start, start + length)`` of one sequence,
    whose prompt's images are ``images`` (None: a text-only sequence)."""

    offset: int
    start: int
    length: int
    images: ImagePrompt | None


def language_inputs(decoder: torch.nn.Module, input_ids: torch.Tensor, segments: list[Segment], mrope: bool,
                    rows_of: Callable[[ImagePrompt], tuple[torch.Tensor, tuple]] | None = None) -> dict:
    """The decoder's keyword arguments for ``input_ids`` (1, T): ``inputs_embeds`` and, where the family needs them,
    ``position_ids`` (3, 1, T), ``visual_pos_masks`` and ``deepstack_visual_embeds``. ``rows_of``: each prompt's
    tower rows (default: the frozen ones the prompt holds; a trained tower passes its own forward)."""
    rows_of = rows_of or (lambda p: (p.embeds, p.deepstack))
    embeds = decoder.get_input_embeddings()(input_ids)[0]  # (T, D)
    where, rows, deep = [], [], []
    for seg in segments:
        if seg.images is None:
            continue
        local, taken = seg.images.rows_in(seg.start, seg.start + seg.length)
        if not len(local):
            continue
        prompt_rows, prompt_deep = rows_of(seg.images)
        where.append(local + seg.offset)
        rows.append(prompt_rows[taken])
        deep.append([d[taken] for d in prompt_deep])
    out = {}
    if where:
        index = torch.cat(where).to(embeds.device)
        embeds = embeds.index_copy(0, index, torch.cat(rows).to(embeds.dtype))
        if deep and deep[0]:
            mask = torch.zeros(1, embeds.shape[0], dtype=torch.bool, device=embeds.device)
            mask[0, index] = True
            out["visual_pos_masks"] = mask
            out["deepstack_visual_embeds"] = [torch.cat([d[layer] for d in deep]) for layer in range(len(deep[0]))]
    out["inputs_embeds"] = embeds.unsqueeze(0)
    out["position_ids"] = positions(segments, input_ids.shape[1], mrope).to(embeds.device)
    return out


def positions(segments: list[Segment], total: int, mrope: bool) -> torch.Tensor:
    """Each token's position in its sequence, (1, total); with ``mrope`` (3, 1, total) multimodal RoPE positions: each
    image prompt's own, plain positions in all three rows elsewhere. Tokens outside the segments count from 0."""
    pos = torch.arange(total, dtype=torch.int64).expand(3 if mrope else 1, -1).clone()
    for seg in segments:
        span = slice(seg.offset, seg.offset + seg.length)
        if mrope and seg.images is not None:
            pos[:, span] = seg.images.rope_positions(seg.start, seg.start + seg.length)
        else:
            pos[:, span] = torch.arange(seg.start, seg.start + seg.length)
    return pos.unsqueeze(1) if mrope else pos
