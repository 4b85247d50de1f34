"""Vision-language models on the GPU (bf16, the Triton kernels and CUDA graphs): the engine's logprobs with images in
the prompt at the bf16 floor of the model's own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from test_vlm import TEXT, own_logprobs
from vlm_models import FAMILIES, random_image, tiny_vlm, user_turn

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.vision.prompt import ImagePrompter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_images_at_the_bf16_floor(family):
    """Chunked prefill through the image tokens (32 a step), decode through CUDA graphs (multimodal RoPE's shift
    in the graph's positions): no further from an fp32 forward of the same weights than a bf16 forward is."""
    model32, processor = tiny_vlm(family)
    ref32 = model32.to("cuda")
    model = copy.deepcopy(ref32).to(torch.bfloat16)
    prompter = ImagePrompter(model, processor)
    cases = [(user_turn(TEXT), [random_image(0, (112, 140))]),
             (user_turn("w9 w3", 2), [random_image(1), random_image(2)])]
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=16, max_batch_tokens=32, seed=0))
    ids = []
    for messages, images in cases:
        prompt_ids, prompt = prompter(messages, images)
        ids += [(rid, messages, images) for rid in engine.submit(prompt_ids, SamplingParams(
            max_new_tokens=24, n=2, stop_token_ids=()), images=prompt)]
    done = {}
    while engine.num_unfinished:
        done.update((c.request_id, c) for c in engine.step())
    assert engine.stats()["graph_steps"] > 0
    gap, floor = [], []
    for rid, messages, images in ids:
        c = done[rid]
        ref = own_logprobs(ref32, processor, messages, images, c.prompt_ids, c.token_ids)
        gap.append((torch.tensor(c.logprobs[:len(ref)]) - ref).abs())
        floor.append((own_logprobs(model, processor, messages, images, c.prompt_ids, c.token_ids) - ref).abs())
    gap, floor = torch.cat(gap), torch.cat(floor)
    print(f"{family} engine vs fp32: mean {gap.mean():.2e} max {gap.max():.2e}; bf16 own forward: mean "
          f"{floor.mean():.2e} max {floor.max():.2e}")
    assert gap.mean() <= 2 * floor.mean() + 1e-3
