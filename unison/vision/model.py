"""The vision-language model classes unison runs, and what differs between their families.

A VLM here is a language model whose prompt holds image placeholder tokens: the vision tower turns each image into
rows of the language model's embedding width, which replace the placeholders' embeddings (``get_image_features``,
transformers' own). What differs by family (``VisionFamily``):

- **positions**: Qwen2-VL / Qwen2.5-VL / Qwen3-VL rotate by three-row multimodal RoPE (time, height, width of each
  image patch; text advances all three), from the model's own ``get_rope_index``. After the prompt every row is the
  token's position plus the prompt's ``rope_delta``. SmolVLM / Idefics3 use plain positions.
- **deepstack** (Qwen3-VL): the vision tower's intermediate features are added to the hidden states at the image
  positions after the first decoder layers (``visual_pos_masks`` / ``deepstack_visual_embeds``, the text model's
  own arguments).

Classes outside ``FAMILIES`` are refused when a prompt holds images: a family whose image tokens attend
bidirectionally (Gemma-3, PaliGemma) would otherwise run causally, silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unison.config import InvalidInputError


@dataclass(frozen=True)
class VisionFamily:
    name: str
    mrope: bool
    """Three-row multimodal RoPE from ``model.model.get_rope_index``."""
    deepstack: bool = False
    """The tower's intermediate features join the first decoder layers' hidden states (Qwen3-VL)."""


_QWEN2_VL = VisionFamily("qwen2-vl", mrope=True)
_QWEN3_VL = VisionFamily("qwen3-vl", mrope=True, deepstack=True)
_IDEFICS3 = VisionFamily("idefics3", mrope=False)

FAMILIES: dict[str, VisionFamily] = {
    "Qwen2VLForConditionalGeneration": _QWEN2_VL,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL,
    "Qwen3VLForConditionalGeneration": _QWEN3_VL,
    "SmolVLMForConditionalGeneration": _IDEFICS3,
    "Idefics3ForConditionalGeneration": _IDEFICS3,
}

# Families whose image tokens attend to each other both ways: causal paged attention would be silently wrong.
_BIDIRECTIONAL = ("Gemma3ForConditionalGeneration", "Gemma3nForConditionalGeneration",
                  "PaliGemmaForConditionalGeneration")


def is_vision_model(model: torch.nn.Module) -> bool:
    """The model has a vision tower (its config a ``vision_config``)."""
    return getattr(model.config, "vision_config", None) is not None


def family_of(model: torch.nn.Module) -> VisionFamily:
    """The model's family, or InvalidInputError naming the class and the ones unison runs with images."""
    name = type(model).__name__
    family = FAMILIES.get(name)
    if family is not None:
        return family
    why = ("its image tokens attend to each other bidirectionally, which unison's causal engine and packed trainer "
           "do not do" if name in _BIDIRECTIONAL else "unison has not checked its image inputs")
    raise InvalidInputError(f"{name}: prompts with images are not supported ({why}); the vision-language classes "
                            f"unison runs: {', '.join(sorted(FAMILIES))}")


def image_token_id(model: torch.nn.Module) -> int:
    token = getattr(model.config, "image_token_id", None)
    if token is None:
        token = getattr(model.config, "image_token_index", None)
    if token is None:
        raise InvalidInputError(f"{type(model).__name__}: its config names no image_token_id")
    return int(token)


def vision_tower(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that turn pixels into placeholder embeddings: the vision encoder and its projector (what
    ``ModelConfig.train_vision`` freezes or trains)."""
    base = model.model
    names = ("visual", "vision_tower", "vision_model", "connector", "multi_modal_projector")
    return [getattr(base, n) for n in names if isinstance(getattr(base, n, None), torch.nn.Module)]


def freeze_vision(model: torch.nn.Module, train: bool) -> int:
    """Freeze the vision tower (``train=False``) or leave it trainable; returns its parameter count."""
    count = 0
    for module in vision_tower(model):
        for p in module.parameters():
            p.requires_grad_(train)
            count += p.numel()
    return count


def vision_trains(model: torch.nn.Module) -> bool:
    return any(p.requires_grad for m in vision_tower(model) for p in m.parameters())


def image_features(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """The vision tower on one prompt's images: (N, D) rows for its N placeholders, in order, and the deepstack
    features (per layer, (N, D); empty for other families). In the tower's grad mode: the caller decides."""
    out = model.model.get_image_features(**pixels, return_dict=True)
    rows = _rows(out.pooler_output)
    deep = tuple(_rows(f) for f in getattr(out, "deepstack_features", None) or ())
    return rows, deep


def _rows(features) -> torch.Tensor:
    if isinstance(features, list | tuple):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def rope_index(model: torch.nn.Module, input_ids: torch.Tensor, pixels: dict[str, torch.Tensor],
               mm_token_type_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A prompt's (3, P) multimodal RoPE positions and its ``rope_delta`` (the shift of every later position), from
    the model's own ``get_rope_index``."""
    ids = input_ids.view(1, -1)
    positions, delta = model.model.get_rope_index(ids, mm_token_type_ids=mm_token_type_ids.view(1, -1),
                                                  image_grid_thw=pixels.get("image_grid_thw"))
    return positions[:, 0].cpu(), int(delta.view(-1)[0])


def scored_tokens(model: torch.nn.Module, completion) -> int:
    """How many of a completion's tokens the model's own forward can score after a prompt with images: up to and
    including the first image placeholder the policy sampled (the forward would take the next ones' inputs for an
    image's rows; unison's engine and trainer embed a sampled placeholder as the plain token it is)."""
    token = image_token_id(model)
    return next((i + 1 for i, t in enumerate(completion) if t == token), len(completion))
