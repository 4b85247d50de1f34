# ruff: noqa: B023  (each timed lambda runs inside its loop iteration)
"""torch's own attention operators at a packed training row's shapes (16 query and 8 KV heads of 128, ~16k tokens):
flash varlen, torch's cuDNN varlen operator (``aten::_cudnn_attention_forward`` with cumulative lengths, KV heads
as they are and repeated), and dense SDPA with the cuDNN and flash backends over 28 equal samples.

    python bench/torch_attention_backends.py     # writes $OUT/attn_probe.json (OUT: the current directory by default)

The probe behind unison.engine.cudnn_attention: torch 2.11's cuDNN varlen operator took 54-76 ms a forward (it
rebuilds its cuDNN graph on every call) and its backward failed, while dense cuDNN SDPA ran 2.3x flash's forward.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from packed_attention import lengths_of  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
H, KVH, D = 16, 8, 128
out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cases": {}}
print("cudnn", torch.backends.cudnn.version(), flush=True)


def timeit(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def lens_of(kind):
    return lengths_of(kind, 16384)


def flash(q, k, v, cu, mx, scale):
    o, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=scale)
    return o, lse, rng


def flash_bwd(g, q, k, v, o, lse, cu, mx, rng, scale):
    return torch.ops.aten._flash_attention_backward(
        g, q, k, v, o, lse, cu, cu, mx, mx, 0.0, True, rng, torch.empty(0, device=dev), scale=scale
    )


def cudnn(q, k, v, cu, mx, scale):
    r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=scale)
    return r


def cudnn_bwd(g, q, k, v, o, lse, seed, off, cu, mx, scale):
    return torch.ops.aten._cudnn_attention_backward(
        g, q, k, v, o, lse, seed, off, torch.empty(0, device=dev), cu, cu, mx, mx, 0.0, True, scale=scale
    )


for kind in ("equal576", "random"):
    lens = lens_of(kind)
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    mx = max(lens)
    scale = D**-0.5
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    g = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    flops_fwd = sum(4 * n * (n + 1) / 2 * H * D for n in lens)
    case = {"T": T, "samples": len(lens), "flops_fwd": flops_fwd}
    o_f, lse_f, rng_f = flash(q, k, v, cu, mx, scale)
    dq_f, dk_f, dv_f = flash_bwd(g, q, k, v, o_f, lse_f, cu, mx, rng_f, scale)
    case["flash_fwd_ms"] = timeit(lambda: flash(q, k, v, cu, mx, scale))
    case["flash_bwd_ms"] = timeit(lambda: flash_bwd(g, q, k, v, o_f, lse_f, cu, mx, rng_f, scale))
    for name, (kk, vv) in {
        "cudnn_gqa": (k, v),
        "cudnn_expanded": (k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)),
    }.items():
        try:
            r = cudnn(q, kk, vv, cu, mx, scale)
            o_c, lse_c = r[0], r[1]
            torch.cuda.synchronize()
            case[name + "_out_diff"] = (o_c.float() - o_f.float()).abs().max().item()
            case[name + "_lse_shape"] = list(lse_c.shape)
            case[name + "_fwd_ms"] = timeit(lambda: cudnn(q, kk, vv, cu, mx, scale))
            try:
                dq, dk, dv = cudnn_bwd(g, q, kk, vv, o_c, lse_c, r[6], r[7], cu, mx, scale)
                torch.cuda.synchronize()
                if dk.shape[1] != KVH:
                    dk = dk.view(T, KVH, H // KVH, D).sum(2)
                    dv = dv.view(T, KVH, H // KVH, D).sum(2)
                case[name + "_grad_diff"] = [
                    (a.float() - b.float()).abs().max().item() for a, b in ((dq, dq_f), (dk, dk_f), (dv, dv_f))
                ]
                case[name + "_grad_scale"] = [b.float().abs().max().item() for b in (dq_f, dk_f, dv_f)]
                case[name + "_bwd_ms"] = timeit(lambda: cudnn_bwd(g, q, kk, vv, o_c, lse_c, r[6], r[7], cu, mx, scale))
            except Exception as e:
                case[name + "_bwd_error"] = repr(e)[-600:]
        except Exception as e:
            case[name + "_error"] = repr(e)[-600:]
    if kind == "equal576":  # dense batched SDPA with the cuDNN backend, and flash, as ceilings
        from torch.nn.attention import SDPBackend, sdpa_kernel

        B, S = len(lens), 576
        qd = q.view(B, S, H, D).transpose(1, 2)
        kd = k.view(B, S, KVH, D).transpose(1, 2).repeat_interleave(H // KVH, 1)
        vd = v.view(B, S, KVH, D).transpose(1, 2).repeat_interleave(H // KVH, 1)
        for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            try:
                qq, kk2, vv2 = (t.detach().requires_grad_() for t in (qd, kd, vd))
                with sdpa_kernel(getattr(SDPBackend, be)):
                    case[f"dense_{be}_fwd_ms"] = timeit(
                        lambda: F.scaled_dot_product_attention(qq, kk2, vv2, is_causal=True)
                    )
                    oo = F.scaled_dot_product_attention(qq, kk2, vv2, is_causal=True)
                    gg = torch.randn_like(oo)
                    case[f"dense_{be}_fwdbwd_ms"] = timeit(
                        lambda: torch.autograd.grad(
                            F.scaled_dot_product_attention(qq, kk2, vv2, is_causal=True), (qq, kk2, vv2), gg
                        )
                    )
            except Exception as e:
                case[f"dense_{be}_error"] = repr(e)[-600:]
    out["cases"][kind] = case
    print(kind, json.dumps(case, indent=1), flush=True)

os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "attn_probe.json"), "w"), indent=1)
for kind, c in out["cases"].items():
    print(
        f"{kind}: flash fwd {c['flash_fwd_ms']:.3f} bwd {c['flash_bwd_ms']:.3f} | cudnn gqa fwd "
        f"{c.get('cudnn_gqa_fwd_ms', float('nan')):.3f} bwd {c.get('cudnn_gqa_bwd_ms', float('nan')):.3f} | "
        f"expanded fwd {c.get('cudnn_expanded_fwd_ms', float('nan')):.3f} "
        f"bwd {c.get('cudnn_expanded_bwd_ms', float('nan')):.3f}"
    )
