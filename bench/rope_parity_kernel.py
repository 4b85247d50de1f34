"""rope_paged_decode against qkv_rope_write + paged_decode at the engine's decode shapes (0.6B heads: 16 query, 8 KV,
128 wide), with q, k, v contiguous and as views of one packed q|k|v row, 64 sequences of 60-163 keys, twelve draws,
eager, on a GPU: the elements of the output and of each pool that differ (issue 23).

    python3 bench/rope_parity_kernel.py   # from the repo root
"""
import sys

import torch

sys.path.insert(0, "tests")
from test_rope_decode import _case, _norms  # noqa: E402

from unison.engine.fused_layer import qkv_rope_write  # noqa: E402
from unison.engine.rope_decode import rope_paged_decode  # noqa: E402
from unison.engine.triton_attention import paged_decode  # noqa: E402

for packed in (False, True):
    bad = []
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        contexts = torch.randint(60, 164, (64,), generator=g).tolist()
        q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens = (x.cuda() for x in _case(16, 8, 128, 16, contexts,
                                                                                           torch.bfloat16, seed))
        if packed:
            qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
            q, k, v = (qkv[:, a:b].view(64, -1, 128) for a, b in ((0, 2048), (2048, 3072), (3072, 4096)))
        qn, kn = (m.cuda() for m in _norms(128, torch.bfloat16))
        for name, qn_, kn_ in (("norm", qn, kn), ("plain", None, None)):
            kp, vp = k_pool.clone(), v_pool.clone()
            rot = qkv_rope_write(q, k, v, cos, sin, kp, vp, slots, qn_, kn_)
            want = paged_decode(rot, kp, vp, tables, lens, 16, 128**-0.5, splits=1)
            kf, vf = k_pool.clone(), v_pool.clone()
            got = rope_paged_decode(q, k, v, cos, sin, kf, vf, slots, tables, lens, 16, 128**-0.5, None, qn_, kn_, 1)
            n = ((got != want).sum().item(), (kf != kp).sum().item(), (vf != vp).sum().item())
            if any(n):
                bad.append((seed, name, n))
    print("packed" if packed else "contiguous", "mismatches (seed, norms, (out, k pool, v pool) elements):", bad)
