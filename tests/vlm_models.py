"""Tiny random vision-language models of two families, with real processors (PIL image processors, a word-level
tokenizer with the family's special tokens and a chat template), for CPU tests: Qwen2.5-VL (multimodal RoPE) and
SmolVLM (Idefics3's layout: plain positions, a pixel-shuffle connector)."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import unison.engine.attention  # noqa: F401  (registers attn_implementation="unison")
from unison.vision.processors import allow_missing_video_processor

VOCAB = 320
FAMILIES = ("qwen2_5_vl", "smolvlm", "qwen3_vl")

_QWEN = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_SPECIALS = {
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "smolvlm": ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>",
                "<video>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
}
# Image parts become the family's placeholder; the processor expands it into the image's tokens.
_TEMPLATE = ("{% for m in messages %}<|im_start|> {% if m['content'] is string %}{{ m['content'] }}{% else %}"
             "{% for p in m['content'] %}{% if p['type'] == 'image' %}IMAGE {% else %}{{ p['text'] }}{% endif %}"
             "{% endfor %}{% endif %} END {% endfor %}{% if add_generation_prompt %}<|im_start|> {% endif %}")
_IMAGE = {"qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "smolvlm": "<image>",
          "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
_END = {"qwen2_5_vl": "<|im_end|>", "smolvlm": "<end_of_utterance>", "qwen3_vl": "<|im_end|>"}


def tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    specials = _SPECIALS[family]
    words = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB - len(specials))}}
    words.update({s: VOCAB - len(specials) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   extra_special_tokens=specials)
    fast.chat_template = _TEMPLATE.replace("IMAGE", _IMAGE[family]).replace("END", _END[family])
    return fast


def tiny_vlm(family: str, seed: int = 0, dtype=torch.float32):
    """(model, processor) of ``family`` with random weights, on unison's attention."""
    allow_missing_video_processor()
    tok = tiny_tokenizer(family)
    ids = tok.get_vocab()
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                    "rope_theta": 10000.0}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], eos_token_id=2, pad_token_id=0)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
        images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
        processor = transformers.Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok,
                                                     chat_template=tok.chat_template)
    elif family == "qwen3_vl":  # interleaved multimodal RoPE, deepstack features into the first two layers
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        cfg = transformers.Qwen3VLConfig(
            text_config=dict(text, head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                 "mrope_interleaved": True, "rope_theta": 10000.0}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[0, 1]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
        cls = transformers.Qwen3VLForConditionalGeneration
        images = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=64 * 64, max_pixels=128 * 128)
        processor = transformers.Qwen3VLProcessor(image_processor=images, tokenizer=tok,
                                                  chat_template=tok.chat_template)
    elif family == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
        cfg = transformers.SmolVLMConfig(
            text_config=dict(text, model_type="llama"),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=56, patch_size=14),
            scale_factor=2, image_token_id=ids["<image>"], pad_token_id=0)
        cls = transformers.SmolVLMForConditionalGeneration
        images = SmolVLMImageProcessorPil(do_image_splitting=False, size={"longest_edge": 56},
                                          max_image_size={"longest_edge": 56})
        processor = transformers.SmolVLMProcessor(image_processor=images, tokenizer=tok, video_processor=None,
                                                  image_seq_len=4, chat_template=tok.chat_template)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="unison", dtype=dtype).eval()
    return model, processor


def random_image(seed: int, size: tuple[int, int] = (56, 84)):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size[0], size[1], 3) * 255).astype("uint8"))


def user_turn(text: str, images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]
