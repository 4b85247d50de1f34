"""Hybrid-model decode: a Qwen3.5 shape (gated delta-nets and full attention, 3:1) beside the dense Qwen3-1.7B shape.

    python bench/hybrid_decode.py --device cpu --shapes tiny-hybrid --runs 4x16 --new 8      # checks the script
    python bench/hybrid_decode.py --device cuda --json bench/results/h200/hybrid/hybrid_decode.json

Random bf16 weights, no download. For each shape and concurrency x prompt: generated tok/s (prefill included), ms
per decode step (decode-only steps through the CUDA graphs, ``engine.py``'s measure), the KV and state pools, and
a roofline that counts what a decode step must move: every weight once, the live KV of the full-attention layers,
and each request's recurrent and conv state read and written once (fp32). Then, at the first workload, the engine's
logprobs against an fp32 forward of the same weights beside a plain bf16 forward's (the bf16 floor). Not a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from engine import SHAPES as DENSE
from engine import build as build_dense
from engine import commit, machine_ceilings, prompts_for, run_unison, sync
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

from unison.engine.state import state_layers

HYBRID = {
    "tiny-hybrid": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512),
    # A Qwen3.5 text model of the 2B size: 24 layers (every 4th full attention, 8 query / 2 KV heads of 256), gated
    # delta-nets of 16 key and 16 value heads of 128, conv kernel 4, a 248k vocabulary, tied embeddings.
    "qwen3.5-2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                       linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
}


def build(shape: str, device: str, dtype: torch.dtype, attn: str = "unison") -> torch.nn.Module:
    if shape in DENSE:
        return build_dense(shape, device, dtype, attn)
    s = HYBRID[shape]
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s["num_hidden_layers"])]
    cfg = Qwen3_5TextConfig(**s, layer_types=types, linear_conv_kernel_dim=4, max_position_embeddings=32768,
                            tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    return model.eval()


def state_bytes(model) -> int:
    """A request's layer states in the engine (fp32 conv inputs and recurrent states of every hybrid layer)."""
    return 4 * sum(s.numel for s in state_layers(model))


def step_bytes(model, concurrency: int, context: int) -> int:
    """Bytes one decode step must move: the weights (the embedding table once, tied or not), the live KV of the
    attention layers at ``context`` tokens, every request's layer states read and written."""
    text = model.config.get_text_config()
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    attention_layers = sum(t == "full_attention" for t in types)
    kv_per_token = 2 * attention_layers * text.num_key_value_heads * text.head_dim * 2
    return weights + concurrency * (context * kv_per_token + 2 * state_bytes(model))


def bf16_floor(model, done, count: int = 8) -> dict:
    """The engine's sampled logprobs and a plain bf16 forward's, each against an fp32 forward of the same weights."""
    ref32 = copy.deepcopy(model).float()
    gap, floor = [], []
    with torch.no_grad():
        for c in done[:count]:
            ids = torch.tensor([c.prompt_ids + c.token_ids], device=ref32.device)
            n = len(c.prompt_ids)
            target = torch.tensor(c.token_ids, device=ids.device)[:, None]
            for m, out in ((ref32, None), (model, floor)):
                logp = torch.log_softmax(m(ids).logits[0, n - 1:-1].float(), -1).gather(1, target)[:, 0].cpu()
                if out is None:
                    ref = logp
                else:
                    out.append((logp - ref).abs())
            gap.append((torch.tensor(c.logprobs) - ref).abs())
    del ref32
    gap, floor = torch.cat(gap), torch.cat(floor)
    return {"tokens": len(gap), "engine_vs_fp32_mean": gap.mean().item(), "engine_vs_fp32_max": gap.max().item(),
            "bf16_forward_vs_fp32_mean": floor.mean().item(), "bf16_forward_vs_fp32_max": floor.max().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", default="qwen3.5-2b,qwen3-1.7b")
    ap.add_argument("--runs", default="64x128,256x128", help="concurrency x prompt length, comma separated")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    ceilings = machine_ceilings(args.device)
    results = []
    for shape in args.shapes.split(","):
        model = build(shape, args.device, dtype)
        params = sum(p.numel() for p in model.parameters())
        for run in args.runs.split(","):
            conc, prompt = (int(x) for x in run.split("x"))
            prompts = prompts_for(model.config.vocab_size, conc, prompt)
            t0 = time.perf_counter()
            result, done = run_unison(model, prompts, args.new, args)
            entry = {"name": f"{shape}/{conc}x({prompt}+{args.new})", "shape": shape, "params": params,
                     "concurrency": conc, "prompt": prompt, "new": args.new, "unison": result,
                     "state_bytes_per_request": state_bytes(model)}
            if ceilings["copy_bytes_per_s"]:
                mid = prompt + args.new // 2
                entry["roofline_ms_per_decode_step"] = 1e3 * step_bytes(model, conc, mid) / \
                    ceilings["copy_bytes_per_s"]
                entry["roofline_decode_tokens_per_s"] = conc / entry["roofline_ms_per_decode_step"] * 1e3
            if not results or results[-1]["shape"] != shape:
                entry["bf16_floor"] = bf16_floor(model, done) if args.device == "cuda" else None
            results.append(entry)
            sync(args.device)
            print(f"{entry['name']}: {result['tokens_per_s']:.0f} tok/s, "
                  f"{result['ms_per_decode_step'] or 0:.2f} ms/decode step (roofline "
                  f"{entry.get('roofline_ms_per_decode_step', 0):.2f}), peak {result['peak_gib']:.1f} GiB, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "torch": torch.__version__, "commit": commit(), "ceilings": ceilings,
                               "sampling": "T=1, logprobs, no stop tokens, random bf16 weights",
                               "workloads": results}, f, indent=2)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"{'workload':34s} {'tok/s':>8s} {'ms/decode':>9s} {'roofline ms':>11s} {'state KiB/req':>13s}")
    for e in results:
        print(f"{e['name']:34s} {e['unison']['tokens_per_s']:8.0f} {e['unison']['ms_per_decode_step'] or 0:9.2f} "
              f"{e.get('roofline_ms_per_decode_step', 0):11.2f} {e['state_bytes_per_request'] / 1024:13.0f}")
    for e in results:
        if e.get("bf16_floor"):
            print(e["shape"], "bf16 floor:", json.dumps(e["bf16_floor"]))


if __name__ == "__main__":
    main()
