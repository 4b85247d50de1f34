# ruff: noqa: B023, E501  (each timed lambda runs inside its loop iteration; a probe kept as it ran)
"""cuDNN's fused attention built directly with its frontend (ragged THD graphs, GQA) against flash varlen at a packed
training row's shapes, and what a larger graph costs: the row's own sequence count and longest sequence, then 32 x
1024 and 64 x 2048 (empty sequences padding the count), forward and backward (deterministic or not), each graph's
build time and the backward's workspace.

    python bench/cudnn_graph_buckets.py     # writes $OUT/cudnn_probe.json (OUT: the current directory by default)

The probe behind unison.engine.cudnn_attention's graph shapes (powers of two: 32 x 1024 cost nothing over 28 x 576).
"""
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
from packed_attention import lengths_of  # noqa: E402

torch.manual_seed(0)
dev = "cuda"
H, KVH, D = 16, 8, 128
res = {"torch": torch.__version__, "cudnn_backend": torch.backends.cudnn.version(), "cases": {}}
import cudnn  # noqa: E402

res["frontend"] = getattr(cudnn, "__version__", "?")
res["backend_version"] = cudnn.backend_version()
print("frontend", res["frontend"], "backend", res["backend_version"], flush=True)
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
BF16, F32, I32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT, cudnn.data_type.INT32


def timeit(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters, host


def ragged(g, name, B, heads, S):
    t = g.tensor(name=name, dim=[B, heads, S, D], stride=[S * heads * D, D, heads * D, 1], data_type=BF16)
    off = g.tensor(name=name + "_off", dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    t.set_ragged_offset(off)
    return t, off


def out_ragged(g, t, name, B, heads, S):
    off = g.tensor(name=name + "_off", dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    t.set_output(True).set_dim([B, heads, S, D]).set_stride([S * heads * D, D, heads * D, 1]).set_ragged_offset(off)
    return off


def build(g):
    t0 = time.perf_counter()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return time.perf_counter() - t0


def fwd_graph(B, S, scale):
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    q, qo = ragged(g, "q", B, H, S)
    k, ko = ragged(g, "k", B, KVH, S)
    v, vo = ragged(g, "v", B, KVH, S)
    sq = g.tensor(name="sq", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    sk = g.tensor(name="sk", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_padding_mask=True,
                      seq_len_q=sq, seq_len_kv=sk, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                      diagonal_band_right_bound=0)
    oo = out_ragged(g, o, "o", B, H, S)
    stats.set_output(True).set_data_type(F32).set_dim([B, H, S, 1]).set_stride([H * S, S, 1, 1])
    secs = build(g)
    return g, dict(q=q, qo=qo, k=k, ko=ko, v=v, vo=vo, sq=sq, sk=sk, o=o, oo=oo, stats=stats), secs


def bwd_graph(B, S, scale, T, deterministic):
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    q, qo = ragged(g, "q", B, H, S)
    k, ko = ragged(g, "k", B, KVH, S)
    v, vo = ragged(g, "v", B, KVH, S)
    o, oo = ragged(g, "o", B, H, S)
    do, doo = ragged(g, "do", B, H, S)
    stats = g.tensor(name="stats", dim=[B, H, S, 1], stride=[H * S, S, 1, 1], data_type=F32)
    sq = g.tensor(name="sq", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    sk = g.tensor(name="sk", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
    dq, dk, dv = g.sdpa_backward(name="bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=scale,
                                 use_padding_mask=True, seq_len_q=sq, seq_len_kv=sk,
                                 diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0,
                                 max_total_seq_len_q=T, max_total_seq_len_kv=T,
                                 use_deterministic_algorithm=deterministic)
    dqo = out_ragged(g, dq, "dq", B, H, S)
    dko = out_ragged(g, dk, "dk", B, KVH, S)
    dvo = out_ragged(g, dv, "dv", B, KVH, S)
    secs = build(g)
    return g, dict(q=q, qo=qo, k=k, ko=ko, v=v, vo=vo, o=o, oo=oo, do=do, doo=doo, stats=stats, sq=sq, sk=sk,
                   dq=dq, dqo=dqo, dk=dk, dko=dko, dv=dv, dvo=dvo), secs


def lens_of(kind):
    return lengths_of(kind, 16384)


for kind in ("equal576", "random"):
    lens = lens_of(kind)
    T, n, mx = sum(lens), len(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    scale = D ** -0.5
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    g_out = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    o_f, lse_f, rng, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=scale)
    dq_f, dk_f, dv_f = torch.ops.aten._flash_attention_backward(g_out, q, k, v, o_f, lse_f, cu, cu, mx, mx, 0.0, True,
                                                               rng, torch.empty(0, device=dev), scale=scale)
    case = {"T": T, "samples": n, "max": mx, "lse_f_shape": list(lse_f.shape)}
    case["flash_fwd_ms"], case["flash_fwd_host_ms"] = timeit(lambda: torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=scale))
    case["flash_bwd_ms"], case["flash_bwd_host_ms"] = timeit(lambda: torch.ops.aten._flash_attention_backward(
        g_out, q, k, v, o_f, lse_f, cu, cu, mx, mx, 0.0, True, rng, torch.empty(0, device=dev), scale=scale))
    for B, S in ((n, mx), (32, 1024), (64, 2048)):
        tag = f"B{B}_S{S}"
        try:
            lens_p = lens + [0] * (B - n)
            sl = torch.tensor(lens_p, dtype=torch.int32, device=dev).view(B, 1, 1, 1)
            cum = torch.tensor([0] + torch.tensor(lens_p).cumsum(0).tolist(), dtype=torch.int32, device=dev).view(B + 1, 1, 1, 1)
            off_q, off_kv = cum * (H * D), cum * (KVH * D)
            gf, t, secs = fwd_graph(B, S, scale)
            case[tag + "_fwd_build_s"] = secs
            ws = torch.empty(max(gf.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
            o_c = torch.empty_like(q)
            st = torch.empty(B, H, S, 1, dtype=torch.float32, device=dev)
            pack = {t["q"]: q, t["qo"]: off_q, t["k"]: k, t["ko"]: off_kv, t["v"]: v, t["vo"]: off_kv, t["sq"]: sl,
                    t["sk"]: sl, t["o"]: o_c, t["oo"]: off_q, t["stats"]: st}
            gf.execute(pack, ws, handle=handle)
            torch.cuda.synchronize()
            case[tag + "_out_diff"] = (o_c.float() - o_f.float()).abs().max().item()
            # stats vs flash lse (flash varlen lse: (H, T))
            lse_c = torch.cat([st[i, :, :lens[i], 0] for i in range(n)], dim=1)
            lf = lse_f if lse_f.shape == lse_c.shape else lse_f.T
            case[tag + "_lse_diff"] = (lse_c - lf.float()).abs().max().item()
            case[tag + "_fwd_ms"], case[tag + "_fwd_host_ms"] = timeit(lambda: gf.execute(pack, ws, handle=handle))
            for det in (False, True):
                gb, tb, secs = bwd_graph(B, S, scale, T, det)
                case[tag + f"_bwd_build_s_det{int(det)}"] = secs
                wsb = torch.empty(max(gb.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                packb = {tb["q"]: q, tb["qo"]: off_q, tb["k"]: k, tb["ko"]: off_kv, tb["v"]: v, tb["vo"]: off_kv,
                         tb["o"]: o_c, tb["oo"]: off_q, tb["do"]: g_out, tb["doo"]: off_q, tb["stats"]: st,
                         tb["sq"]: sl, tb["sk"]: sl, tb["dq"]: dq, tb["dqo"]: off_q, tb["dk"]: dk, tb["dko"]: off_kv,
                         tb["dv"]: dv, tb["dvo"]: off_kv}
                gb.execute(packb, wsb, handle=handle)
                torch.cuda.synchronize()
                case[tag + f"_grad_diff_det{int(det)}"] = [(a.float() - b.float()).abs().max().item()
                                                          for a, b in ((dq, dq_f), (dk, dk_f), (dv, dv_f))]
                case[tag + f"_bwd_ms_det{int(det)}"], case[tag + f"_bwd_host_ms_det{int(det)}"] = timeit(
                    lambda: gb.execute(packb, wsb, handle=handle))
                case[tag + f"_bwd_ws_mb_det{int(det)}"] = wsb.numel() / 2**20
        except Exception:
            case[tag + "_error"] = traceback.format_exc()[-1500:]
    case["grad_scale"] = [t.float().abs().max().item() for t in (dq_f, dk_f, dv_f)]
    res["cases"][kind] = case
    print(kind, json.dumps(case, indent=1), flush=True)

json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "cudnn_probe.json"), "w"), indent=1)
for kind, c in res["cases"].items():
    print(kind, "flash fwd/bwd", round(c["flash_fwd_ms"], 3), round(c["flash_bwd_ms"], 3))
    for key in sorted(c):
        if key.endswith("_ms") or "_ms_det" in key:
            print("  ", key, round(c[key], 3))
