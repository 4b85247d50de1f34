"""Decode ms per step at the Qwen3-0.6B shape x 256 requests with the RoPE kernel at 8 heads per program (the
default) and at 1 (its grid before issue 23), alternating in one process. GPU only:

    python bench/rope_heads.py
"""

from __future__ import annotations

import functools
import json
import time

import torch
from engine import build, prompts_for

import unison.engine.fused_rope as fr
from unison.engine import Engine, EngineConfig, SamplingParams

original = fr.rope
model = build("qwen3-0.6b", "cuda", torch.bfloat16, "unison")
prompts = prompts_for(model.config.vocab_size, 256, 128)
out = {}
for heads in (8, 1, 8, 1):
    fr.rope = functools.partial(original, heads_per_program=heads)
    engine = Engine(model, EngineConfig(num_blocks=256 * 40 + 8, block_size=16, seed=0, max_batch_tokens=8192,
                                        max_num_seqs=256))
    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=200, stop_token_ids=()))
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 10
    out.setdefault(heads, []).append(ms)
    print(f"heads/program {heads}: {ms:.3f} ms per decode step", flush=True)
    del engine
print(json.dumps(out))
