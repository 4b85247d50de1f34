"""Two engines stepped in lockstep on a GPU, one with the one-launch decode attention (``rope_paged_decode``) and one
without: the first step and slots where their K/V pools part, and the requests whose logprobs differ (the case of
tests/test_fused_layer_gpu.py's engine test: 2 layers of the 0.6B heads, 64 requests of 60-123 tokens, 40 new).

    python3 bench/rope_parity_engine.py   # from the repo root
"""
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, "tests")
from conftest import random_prompts  # noqa: E402

from unison.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                  eos_token_id=2)
model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.bfloat16).cuda().eval()
prompts = random_prompts([60 + i for i in range(64)], vocab=4096)
for asyn in (False, True):
    engines = {}
    for one in (False, True):
        e = Engine(model, EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=64, seed=0,
                                       async_scheduling=asyn))
        e.backend.rope_decode = one
        for p in prompts:
            e.submit(p, SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, stop_token_ids=()))
        engines[one] = e
    done = {False: {}, True: {}}
    reported = False
    for step in range(200):
        outs = {one: e.step() for one, e in engines.items()}
        torch.cuda.synchronize()
        for one, o in outs.items():
            for c in o:
                done[one][c.request_id] = c
        a, b = engines[False], engines[True]
        for layer in range(2):
            for name, pa, pb in (("k", a.pool.k[layer], b.pool.k[layer]), ("v", a.pool.v[layer], b.pool.v[layer])):
                diff = (pa != pb).flatten(1).any(1)
                if diff.any() and not reported:
                    slots = diff.nonzero().flatten().tolist()
                    print(f"async={asyn} step {step} layer {layer} {name}: {len(slots)} slots differ,"
                          f" first {slots[:12]}"
                          f" blocks {sorted(set(s // 16 for s in slots))[:12]} offsets {[s % 16 for s in slots[:12]]}"
                          f" max {(pa.float() - pb.float()).abs().max().item():.3g}", flush=True)
                    heads = (pa[slots] != pb[slots]).any(-1)
                    print("   heads differing per slot:", heads.sum(1).tolist()[:12], flush=True)
                    reported = layer == 0 or reported
        if not any(e.num_unfinished for e in engines.values()):
            break
    st = {one: e.stats() for one, e in engines.items()}
    print("graph steps", st[False].get("graph_steps"), st[True].get("graph_steps"), "steps", step)
    first, worst = [], 0.0
    for rid, ca in done[False].items():
        cb = done[True][rid]
        d = [i for i, (x, y) in enumerate(zip(ca.logprobs, cb.logprobs, strict=False)) if x != y]
        if d or ca.token_ids != cb.token_ids:
            first.append((rid, d[:1], len(ca.prompt_ids)))
            worst = max([worst] + [abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs, strict=False)])
    print(f"async={asyn}: {len(first)} requests differ, max {worst:.3g}: {first[:10]}", flush=True)
    del engines
