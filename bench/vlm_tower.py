"""Where a vision-language prompt's admission time goes: the processor, the vision tower, the RoPE index and the
pixel digest per prompt, and the tower over 16 images at once (a Qwen2.5-VL-3B shape, random bf16 weights).

    python bench/vlm_tower.py          # one GPU; numbers, not a test (bench/results/h200/vlm/README.md)
"""

from __future__ import annotations

import tempfile
import time

import torch
from vlm_step import make_checkpoint

from unison.models import load_policy, load_processor
from unison.tasks import DataConfig, load_task
from unison.vision import model as vlm
from unison.vision.messages import chat_messages
from unison.vision.prompt import ImagePrompter, pixel_digest, render


def now() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def main():
    folder = tempfile.mkdtemp()
    make_checkpoint("qwen2.5-vl-3b", folder, "cuda", 224)
    model, _ = load_policy(folder, dtype=torch.bfloat16, device="cuda")
    processor = load_processor(folder)
    prompter = ImagePrompter(model, processor)
    rows = load_task(DataConfig(source="count_shapes", size=16, gym={"image_size": 224})).rows
    for rep in range(2):  # the first compiles
        ms = dict.fromkeys(("processor", "tower", "rope", "digest", "prompter"), 0.0)
        for row in rows:
            messages = chat_messages(row["prompt"], row["images"])
            t0 = now()
            out = processor(text=[render(processor, messages)], images=row["images"], return_tensors="pt")
            t1 = now()
            pixels = {k: out[k].cuda() for k in ("pixel_values", "image_grid_thw")}
            with torch.no_grad():
                vlm.image_features(model, pixels)
            t2 = now()
            vlm.rope_index(model, out["input_ids"][0].cuda(), pixels, out["mm_token_type_ids"].cuda())
            t3 = now()
            pixel_digest(pixels)
            t4 = now()
            prompter(messages, row["images"])
            t5 = now()
            for key, dt in zip(ms, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                ms[key] += dt * 1000 / len(rows)
        print(f"pass {rep}: ms per prompt " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    parts = [processor.image_processor(images=r["images"], return_tensors="pt") for r in rows]
    joined = {k: torch.cat([p[k] for p in parts]).cuda() for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        for _ in range(2):
            t0 = now()
            vlm.image_features(model, joined)
            t1 = now()
    print(f"the tower over {len(rows)} images at once: {(t1 - t0) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
