"""The training forward's q/k RMSNorms and RoPE as one differentiable kernel, for attentions with q/k norms (Qwen3).

transformers normalises q and k per head and then rotates them: with ``unison.train.fused``'s kernels that is two
passes over q and k forward (the norm kernel, then the RoPE kernel) and two backward. ``qk_norm_rope`` reads q and k
once and writes them once each way: in a 0.6B training step of 16384-token rows on the H200 the kernels involved
went from 41.6 to 29.4 ms of GPU time (bench/results/h200/speed/deferred/README.md; its backward, ~1.9 TB/s, walks
its tokens one after another and is the part to speed up).

The forward is the engine's own function (``unison.engine.fused_layer.normed_rope``, which ``qkv_rope_write``
runs: fp32 statistics, the normalised value, its product with the weight, each RoPE product and their sum), so the
trainer's logprobs stay the engine's. The backward computes in fp32 and rounds once, as the trainer's other kernels do.
``training_attentions`` swaps, for a ``with`` block, the forward of the attentions whose forward is Llama-form
with q/k norms (``fused_layer.attention_form``) for one that calls it; anything the kernel does not cover runs
the attention's own forward.

Where q_proj, k_proj and v_proj are laid out as one matrix (``unison.engine.fused_linear.pack_projections``, as
``load_policy`` loads a model), they run as one GEMM each way (``qkv_rope``): the kernel reads q and k as column
blocks of its output and copies v's block out contiguous; its backward writes q's and k's input gradients and v's
gradient side by side, so that the input gradient and the three weights' gradients are one GEMM each (their biases',
Qwen2's, one sum). Llama-form attentions without q/k norms run so too (the kernel without its norms), where their
weights are joined.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager

import torch
import triton
import triton.language as tl

from ..engine.fused_layer import attention_form, normed_rope, rope_tile
from ..engine.fused_linear import joined, swap_forward
from ..engine.fused_norm import fusable
from .fused import _multiprocessors, _sum_parts, joinable, shared_input


@triton.jit
def _rows_of(Q, K, t, head, q_heads, k_heads, stride_q, stride_k, half):
    """Token t's rows of ``head`` (query heads, then key heads; 2 * half wide) in Q and K, and which rows are
    which."""
    is_q = head < q_heads
    is_k = (head >= q_heads) & (head < q_heads + k_heads)
    return Q + t * stride_q + head * (2 * half), K + t * stride_k + (head - q_heads) * (2 * half), is_q, is_k


@triton.jit
def _copy_row(SRC, DST, t, stride_src, stride_dst, width, live, BLOCK: tl.constexpr):
    """Row t's first ``width`` elements of SRC into DST (``live``: a (1, BLOCK) mask, the row exists)."""
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (cols < width) & live
    tl.store(DST + t * stride_dst + cols, tl.load(SRC + t * stride_src + cols, mask=mask, other=0.0), mask=mask)


@triton.jit(do_not_specialize=["n_tokens"])
def _forward_kernel(Q, K, QW, KW, Cos, Sin, QO, KO, V, VO, n_tokens, q_heads, k_heads, stride_q, stride_k, stride_v,
                    stride_c, eps_q, eps_k, HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr,
                    COPY_V: tl.constexpr, V_BLOCK: tl.constexpr, NORM: tl.constexpr = True):
    """One token, HEADS of its heads: rope(norm(x)) (rope(x) unless NORM) with transformers' roundings (the engine's
    own function); with ``COPY_V`` the token's first program also copies its v row (strided, a block of
    [q | k | v]) into VO, contiguous, where attention kernels want it."""
    t = tl.program_id(0).to(tl.int64)
    if COPY_V:
        if tl.program_id(1) == 0:
            _copy_row(V, VO, t, stride_v, k_heads * 2 * HALF, k_heads * 2 * HALF,
                      tl.full([1, V_BLOCK], True, tl.int1), V_BLOCK)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    out, d, dmask, is_q, is_k, kh = normed_rope(Q, K, QW, KW, Cos, Sin, t, heads, q_heads, k_heads, stride_q,
                                                stride_k, stride_c, eps_q, eps_k, HALF, BLOCK, NORM)
    tl.store(QO + t * (q_heads * 2 * HALF) + heads[:, None] * (2 * HALF) + d, out, mask=dmask & is_q)
    tl.store(KO + t * (k_heads * 2 * HALF) + kh * (2 * HALF) + d, out, mask=dmask & is_k)


@triton.jit(do_not_specialize=["n_tokens", "tokens_per_program"])
def _backward_kernel(DQ, DK, Q, K, QW, KW, Cos, Sin, DQX, DKX, DW, DV, DVX, n_tokens, tokens_per_program, q_heads,
                     k_heads, stride_q, stride_k, stride_dq, stride_dk, stride_dqx, stride_dkx, stride_dv,
                     stride_dvx, stride_c, eps_q, eps_k, HALF: tl.constexpr, BLOCK: tl.constexpr,
                     HEADS: tl.constexpr, COPY_V: tl.constexpr, V_BLOCK: tl.constexpr, NORM: tl.constexpr = True):
    """Tokens [pid * tokens_per_program, ...), HEADS of their heads (group program_id(1)): dx of rope(norm(x)) given
    its output's gradient (RoPE's transpose, then RMSNorm's backward, in fp32), and this program's partial sums of
    the two weights' gradients (row pid * groups + group of DW: the q norm's, then the k norm's, side by side, so
    that one launch sums both down the rows). With ``COPY_V`` group 0 also copies each token's dv row into DVX (the
    v block of [dq | dk | dv], beside the q and k input gradients this kernel writes). Unless ``NORM``, of rope(x)
    alone (RoPE's transpose), without weights."""
    pid = tl.program_id(0)
    group = tl.program_id(1)
    head = (group * HEADS + tl.arange(0, HEADS))[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    dmask = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    is_q = head < q_heads
    q_rows = is_q & dmask
    k_rows = (head >= q_heads) & (head < q_heads + k_heads) & dmask
    if NORM:
        w = tl.where(is_q, tl.load(QW + d, mask=dmask, other=0.0),
                     tl.load(KW + d, mask=dmask, other=0.0)).to(tl.float32)
        eps = tl.where(is_q, eps_q, eps_k)
    dw = tl.zeros([HEADS, BLOCK], tl.float32)
    for i in range(0, tokens_per_program):
        t = pid.to(tl.int64) * tokens_per_program + i
        live = (tl.zeros([1, BLOCK], tl.int64) + t) < n_tokens  # (a tensor: the interpreter's masks want one)
        if COPY_V:
            if group == 0:
                _copy_row(DV, DVX, t, stride_dv, stride_dvx, k_heads * 2 * HALF,
                          (tl.zeros([1, V_BLOCK], tl.int64) + t) < n_tokens, V_BLOCK)
        qm, km = q_rows & live, k_rows & live
        q_at, k_at, _, _ = _rows_of(Q, K, t, head, q_heads, k_heads, stride_q, stride_k, HALF)
        dq_at, dk_at, _, _ = _rows_of(DQ, DK, t, head, q_heads, k_heads, stride_dq, stride_dk, HALF)
        dy = tl.where(is_q, tl.load(dq_at + d, mask=qm, other=0.0), tl.load(dk_at + d, mask=km, other=0.0))
        dyp = tl.where(is_q, tl.load(dq_at + partner, mask=qm, other=0.0),
                       tl.load(dk_at + partner, mask=km, other=0.0)).to(tl.float32)
        cos = tl.load(Cos + t * stride_c + d, mask=dmask & live, other=0.0).to(tl.float32)
        sin_p = tl.load(Sin + t * stride_c + partner, mask=dmask & live, other=0.0).to(tl.float32)
        # RoPE's transpose: dn1 = dy1 * cos1 + dy2 * sin2, dn2 = dy2 * cos2 - dy1 * sin1
        dn = dy.to(tl.float32) * cos + tl.where(first, dyp, -dyp) * sin_p
        if NORM:
            x = tl.where(is_q, tl.load(q_at + d, mask=qm, other=0.0), tl.load(k_at + d, mask=km, other=0.0))
            xf = x.to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, 1, keep_dims=True) / (2 * HALF) + eps)
            dw += dn * (xf * r).to(x.dtype).to(tl.float32)  # the forward's weight multiplied the rounded value
            dnw = dn * w
            dx = r * dnw - xf * (r * r * r) * (tl.sum(dnw * xf, 1, keep_dims=True) / (2 * HALF))
        else:
            dx = dn
        dqx_at, dkx_at, _, _ = _rows_of(DQX, DKX, t, head, q_heads, k_heads, stride_dqx, stride_dkx, HALF)
        tl.store(dqx_at + d, dx.to(DQX.dtype.element_ty), mask=qm)
        tl.store(dkx_at + d, dx.to(DKX.dtype.element_ty), mask=km)
    if NORM:
        cols = tl.arange(0, BLOCK)
        part = (pid * tl.num_programs(1) + group) * (4 * HALF) + cols
        tl.store(DW + part, tl.sum(tl.where(is_q, dw, 0.0), 0), mask=cols < 2 * HALF)
        tl.store(DW + 2 * HALF + part, tl.sum(tl.where(is_q, 0.0, dw), 0), mask=cols < 2 * HALF)


def _norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
               eps_q: float, eps_k: float, cos: torch.Tensor, sin: torch.Tensor,
               v: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """rope(norm(q)), rope(norm(k)) as contiguous tensors (the norms left out where their weights are None); q
    (T, H, D), k (T, KVH, D), each with contiguous heads (a token's rows may be strided: q and k may be column blocks
    of one [q | k | v] matrix). With ``v`` (k's shape, rows possibly strided), also a contiguous copy of it, made in
    the same launch."""
    norm = q_weight is not None
    q_weight, k_weight = (q_weight, k_weight) if norm else (q, q)
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if v is not None else None
    per, warps = rope_tile(heads, kv_heads, dim)  # the engine's tile: its sums of squares in the same order
    _forward_kernel[(tokens, triton.cdiv(heads + kv_heads, per))](
        q, k, q_weight, k_weight, cos, sin, q_out, k_out, v if v is not None else q, v_out if v is not None else q,
        tokens, heads, kv_heads, q.stride(0), k.stride(0), v.stride(0) if v is not None else 0, cos.stride(0), eps_q,
        eps_k, HALF=dim // 2, BLOCK=triton.next_power_of_2(dim), HEADS=per, COPY_V=v is not None,
        V_BLOCK=triton.next_power_of_2(kv_heads * dim) if v is not None else 1, NORM=norm, num_warps=warps,
        enable_fp_fusion=False)
    return (q_out, k_out) if v is None else (q_out, k_out, v_out)


def _norm_rope_backward(dq: torch.Tensor | None, dk: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: tuple[float, float],
                        cos: torch.Tensor, sin: torch.Tensor, dq_x: torch.Tensor, dk_x: torch.Tensor,
                        dv: torch.Tensor | None = None, dv_x: torch.Tensor | None = None) -> torch.Tensor | None:
    """The input gradients of ``_norm_rope`` into dq_x and dk_x (q's and k's shapes, rows possibly strided), given
    its outputs' (None: zero); with ``dv`` and ``dv_x``, also dv copied into dv_x (rows possibly strided), in the
    same launch. Returns both norm weights' gradients, [q's | k's] (None without norms)."""
    norm = q_weight is not None
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    dq = dq.contiguous() if dq is not None else q.new_zeros(q.shape)
    dk = dk.contiguous() if dk is not None else k.new_zeros(k.shape)
    per = min(triton.next_power_of_2(heads + kv_heads), 8)
    groups = triton.cdiv(heads + kv_heads, per)
    programs = max(1, min(tokens, 8 * _multiprocessors(q.device) // groups))
    per_program = -(-tokens // programs)
    programs = -(-tokens // per_program)
    parts = torch.empty(programs * groups if norm else 1, 2 * dim, dtype=torch.float32, device=q.device)  # [q|k]
    copy_v = dv is not None
    if copy_v:
        dv = dv.reshape(tokens, -1)
        dv = dv if dv.stride(-1) == 1 else dv.contiguous()
    _backward_kernel[(programs, groups)](
        dq, dk, q, k, q_weight if norm else q, k_weight if norm else q, cos, sin, dq_x, dk_x, parts,
        dv if copy_v else dq, dv_x if copy_v else dq,
        tokens, per_program, heads, kv_heads, q.stride(0), k.stride(0), dq.stride(0), dk.stride(0), dq_x.stride(0),
        dk_x.stride(0), dv.stride(0) if copy_v else 0, dv_x.stride(0) if copy_v else 0, cos.stride(0), *eps,
        HALF=dim // 2, BLOCK=triton.next_power_of_2(dim), HEADS=per, COPY_V=copy_v,
        V_BLOCK=triton.next_power_of_2(kv_heads * dim) if copy_v else 1, NORM=norm,
        num_warps=4 if per * dim > 512 else 1)
    # both weights' gradients, one launch (each column summed alone)
    return _sum_parts(parts, q_weight.dtype) if norm else None


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps_q, eps_k, cos, sin):
        q, k = q.contiguous(), k.contiguous()
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = eps_q, eps_k
        return _norm_rope(q, k, q_weight, k_weight, eps_q, eps_k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dq_x, dk_x = torch.empty_like(q), torch.empty_like(k)
        dw = _norm_rope_backward(dq, dk, q, k, q_weight, k_weight, ctx.eps, cos, sin, dq_x, dk_x)
        dim = q.shape[-1]
        return dq_x, dk_x, dw[:dim], dw[dim:], None, None, None, None


class _QKVRope(torch.autograd.Function):
    """The q/k/v projections over their joined weight (``unison.engine.fused_linear.pack_projections``) as one
    GEMM, then ``_norm_rope`` on q's and k's column blocks of it (their norms where the weights are given), which
    also copies v's block out contiguous (the attention kernels want it so). The backward kernel writes q's and k's
    input gradients and copies v's gradient side by side, so the input gradient and the three weights' gradients
    are a GEMM each."""

    @staticmethod
    def forward(ctx, x, q_proj, k_proj, v_proj, q_bias, k_bias, v_bias, q_weight, k_weight, eps_q, eps_k, cos, sin,
                dim):
        rows = x.reshape(-1, x.shape[-1])
        weight = joined([q_proj, k_proj, v_proj]).t()
        qkv = torch.addmm(joined([q_bias, k_bias, v_bias]), rows, weight) if q_bias is not None else rows.mm(weight)
        ctx.biased = q_bias is not None
        q, k, v = _blocks(qkv, q_proj.shape[0], k_proj.shape[0], dim)
        # the norms' backward reads q and k; RoPE's alone reads neither (then nothing of [q | k | v] is kept)
        ctx.save_for_backward(rows, qkv if q_weight is not None else None, q_proj, k_proj, v_proj, q_weight, k_weight,
                              cos, sin)
        ctx.eps, ctx.dim, ctx.x_shape = (eps_q, eps_k), dim, x.shape
        return _norm_rope(q, k, q_weight, k_weight, eps_q, eps_k, cos, sin, v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        rows, qkv, q_proj, k_proj, v_proj, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dim, nq, nk = ctx.dim, q_proj.shape[0], k_proj.shape[0]
        d_qkv = rows.new_empty(rows.shape[0], nq + nk + v_proj.shape[0])
        dq_x, dk_x, dv_x = _blocks(d_qkv, nq, nk, dim)
        q, k, _ = _blocks(qkv, nq, nk, dim) if qkv is not None else (dq_x, dk_x, None)  # (unread without norms)
        dw = _norm_rope_backward(dq, dk, q, k, q_weight, k_weight, ctx.eps, cos, sin, dq_x, dk_x, dv, dv_x)
        if dv is None:
            dv_x.zero_()
        dx = torch.mm(d_qkv, joined([q_proj, k_proj, v_proj])).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dwp = d_qkv.t().mm(rows) if any(ctx.needs_input_grad[1:4]) else None
        proj = (dwp[:nq], dwp[nq:nq + nk], dwp[nq + nk:]) if dwp is not None else (None, None, None)
        dbp = d_qkv.sum(0) if ctx.biased and any(ctx.needs_input_grad[4:7]) else None
        bias = (dbp[:nq], dbp[nq:nq + nk], dbp[nq + nk:]) if dbp is not None else (None, None, None)
        norms = (dw[:dim], dw[dim:]) if dw is not None else (None, None)
        return dx, *proj, *bias, *norms, None, None, None, None, None


def _blocks(qkv: torch.Tensor, nq: int, nk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v, (T, heads, dim) views of the column blocks of a (T, nq + nk + nv) [q | k | v]."""
    tokens = qkv.shape[0]
    return (qkv[:, :nq].view(tokens, -1, dim), qkv[:, nq:nq + nk].view(tokens, -1, dim),
            qkv[:, nq + nk:].view(tokens, -1, dim))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.nn.Module, k_norm: torch.nn.Module,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope(q_norm(q)), rope(k_norm(k)) as transformers' Qwen3 attention computes them, differentiable w.r.t. q, k
    and the norms' weights. q: (T, H, D), k: (T, KVH, D), contiguous; cos, sin: (T, D) with a contiguous last
    dimension (not trained). Returns tensors of q's and k's shapes."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("qk_norm_rope: the cos/sin tables require grad; the kernel does not differentiate them")
    return _QKNormRope.apply(q, k, q_norm.weight, k_norm.weight, q_norm.variance_epsilon, k_norm.variance_epsilon,
                             cos, sin)


def qkv_rope(x: torch.Tensor, attn: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor,
             norms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """rope(q_norm(q)), rope(k_norm(k)) (without the norms unless ``norms``) of the attention's q and k projections
    of x, and its v projection, (T, heads, head_dim) each, as one GEMM each way (``_QKVRope``) where ``qkv_joinable``;
    else None (the caller projects apart)."""
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not qkv_joinable(attn, x) or cos.requires_grad or sin.requires_grad:
        return None
    weights, eps = ((attn.q_norm.weight, attn.k_norm.weight),
                    (attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon)) if norms else ((None, None), (0, 0))
    return _QKVRope.apply(x, *(m.weight for m in linears), *(m.bias for m in linears), *weights, *eps, cos, sin,
                          attn.head_dim)


def qkv_joinable(attn: torch.nn.Module, x: torch.Tensor | None = None) -> bool:
    """Whether the attention's q/k/v are plain ``nn.Linear`` layers (of x's dtype, given x) without hooks whose
    weights, and biases if any (Qwen2's), are laid out as one matrix (one vector)."""
    return joinable((attn.q_proj, attn.k_proj, attn.v_proj), x if x is not None else attn.q_proj.weight, biased=True)


def _covered(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: torch.nn.Module, norms: bool) -> bool:
    """One sequence of packed rows (batch 1), full-width RoPE tables and norm weights of x's dtype."""
    dim = attn.head_dim
    return (x.ndim == 3 and x.shape[0] == 1 and cos.shape == (1, x.shape[1], dim) and sin.shape == cos.shape
            and cos.stride() == sin.stride() and cos.stride(-1) == 1 and dim % 2 == 0
            and cos.dtype == sin.dtype == x.dtype
            and (not norms or x.dtype == attn.q_norm.weight.dtype == attn.k_norm.weight.dtype))


def _attention_forward(attn: torch.nn.Module, window: str | None, norms: bool):
    original = attn.forward
    modeling = sys.modules[type(attn).__module__]

    def forward(hidden_states, *args, **kwargs):
        cos, sin = kwargs.get("position_embeddings") or (None, None)
        if (args or cos is None or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
                or "paged" in kwargs or not _covered(hidden_states, cos, sin, attn, norms)):
            return original(hidden_states, *args, **kwargs)
        projected = qkv_rope(hidden_states, attn, cos[0], sin[0], norms)
        if projected is None and not norms:  # nothing of this forward's own to run
            return original(hidden_states, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items()
                if k not in ("position_embeddings", "attention_mask", "cache", "past_key_values")}
        if window is not None:
            rest["sliding_window"] = attn.sliding_window if window == "layer" else \
                getattr(attn.config, "sliding_window", None)
        n = hidden_states.shape[1]
        if projected is not None:  # one GEMM each way over the joined weights (pack_projections)
            q, k, v = projected
            v = v[None].transpose(1, 2)
        else:
            q, k, v = shared_input(hidden_states, attn.q_proj, attn.k_proj, attn.v_proj)
            q, k = q.view(n, -1, attn.head_dim), k.view(n, -1, attn.head_dim)
            v = v.view(1, n, -1, attn.head_dim).transpose(1, 2)
            q, k = qk_norm_rope(q, k, attn.q_norm, attn.k_norm, cos[0], sin[0])
        interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                                   modeling.eager_attention_forward)
        out, weights = interface(attn, q[None].transpose(1, 2), k[None].transpose(1, 2), v,
                                 kwargs.get("attention_mask"), dropout=attn.attention_dropout if attn.training else 0.0,
                                 scaling=attn.scaling, **rest)
        return attn.o_proj(out.reshape(1, n, -1).contiguous()), weights
    return forward


@contextmanager
def training_attentions(modules: list[torch.nn.Module]):
    """Within the block, every attention among ``modules`` of a Llama form with q/k norms the norm kernel computes
    runs its norms and RoPE as ``qk_norm_rope``, and its q/k/v projections as one GEMM each way where their weights
    are joined (``qkv_rope``); one without q/k norms runs so where its weights are joined. Yields the number
    switched."""
    with ExitStack() as stack:
        switched = 0
        for module in modules:
            form = attention_form(type(module))
            if form is None:
                continue
            norms = form[0]
            if (fusable(module.q_norm) and fusable(module.k_norm)) if norms else qkv_joinable(module):
                swap_forward(stack, module, _attention_forward(module, form[1], norms))
                switched += 1
        yield switched
