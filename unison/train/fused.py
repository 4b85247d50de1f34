"""The training forward's RMSNorm, RoPE and SwiGLU as single Triton kernels, forward and backward.

transformers computes each of them as a chain of small elementwise operations, and autograd runs another chain
for each backward: on the H200 the packed training step of the Qwen3-0.6B shape spent more of its GPU time in
those (multiplications, dtype casts, sums: bench/results/h200/speed) than in its matmuls. ``fused_training(model)``
switches, for the ``with`` block, the modules the engine's decode graphs already fuse (``unison.engine.fused_norm``,
``unison.engine.fused_rope``) and the SwiGLU MLPs of the same families to differentiable kernels that compute the
same function in the same precision as transformers' modules (fp32 statistics, each rounding where transformers
rounds), so the trainer's logprobs stay the engine's. The backward kernels compute in fp32 and round once.
As the engine's layers do, each residual add runs in the kernel of the norm after it (``add_rms_norm``), and
fewer launches a row matter here too: the 0.6B step is bound by the host's launches (bench/train_launches.py), so
the projections that share an input sum their input gradients inside the GEMMs (``shared_input``).

The block must span the backward too when activation checkpointing is on: the recomputed forward then runs the
same kernels. Blocks nest (an inner one changes nothing). ``unison.train.logprobs.training_kernels`` enters it on
the GPU (the CPU tests run the kernels in Triton's interpreter).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.modules.module as module_hooks
import triton
import triton.language as tl

from ..engine import fused_norm, fused_rope
from ..engine.fused_linear import joined, plain_weight
from ..engine.fused_linear import swiglu_mlps as fused_mlps

_ACTIVE = "_unison_fused_training"


# Row and element counts change with every packed row: Triton would compile a variant for each divisibility of them.
@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _rms_norm_backward_kernel(DY, X, W, DX, DW, DS, n_rows, rows_per_program, stride_dy, stride_x, stride_dx,
                              stride_ds, eps, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                              WEIGHT_GRAD: tl.constexpr, ADD: tl.constexpr):
    """Rows [pid * rows_per_program, ...), ROWS at a time (rows_per_program a multiple of ROWS): dx of
    y = w * (x * r).to(dtype), r = rsqrt(mean(x^2) + eps), and this program's partial sum of dw into DW[pid]. With
    ``ADD``, dx rounded to DX's dtype plus DS (the gradient x's other consumer gave it), rounded again: autograd's
    sum of the two, in the same kernel (``add_rms_norm``)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program, ROWS):
        row = first + i + tl.arange(0, ROWS)[:, None]
        mask = (cols < N) & (row < n_rows)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 1, keep_dims=True) / N + eps)
        if WEIGHT_GRAD:  # the forward multiplied w by the normalised value rounded to x's dtype
            dw += dy * (x * r).to(X.dtype.element_ty).to(tl.float32)
        dn = dy * w
        dx = (r * dn - x * (r * r * r) * (tl.sum(dn * x, 1, keep_dims=True) / N)).to(DX.dtype.element_ty)
        if ADD:
            ds = tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0)
            dx = (dx.to(tl.float32) + ds.to(tl.float32)).to(DX.dtype.element_ty)
        tl.store(DX + row * stride_dx + cols, dx, mask=mask)
    if WEIGHT_GRAD:
        flat = tl.arange(0, BLOCK)
        tl.store(DW + pid * N + flat, tl.sum(dw, 0), mask=flat < N)


@triton.jit(do_not_specialize=["n_parts"])
def _sum_parts_kernel(PARTS, OUT, n_parts, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[c] = the sum over the n_parts rows of PARTS (fp32, (n_parts, N)) of column c, rounded once to OUT's dtype:
    the weight gradient from the backward kernel's per-program partial sums, in one launch (torch's sum then cast
    took two or three: the reduction, its output's memset, the cast)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        part = tl.load(PARTS + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < n_parts) & (cols[None, :] < N),
                       other=0.0)
        acc += tl.sum(part, 0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=cols < N)


def _sum_parts(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``parts.sum(0).to(dtype)`` for a contiguous fp32 ``parts`` of (P, N), in one launch (same order every call)."""
    n = parts.shape[1]
    out = torch.empty(n, dtype=dtype, device=parts.device)
    # Narrow column blocks and tall tiles: a few iterations over ~1000 parts in several programs (one program
    # walking them 32 at a time took 37 us a call on the H200).
    block_n = min(32, triton.next_power_of_2(n))
    _sum_parts_kernel[(triton.cdiv(n, block_n),)](parts, out, parts.shape[0], N=n, BLOCK_P=256, BLOCK_N=block_n,
                                                  num_warps=8)
    return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return fused_norm.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return (*_norm_backward(x, weight, ctx.eps, dy, None, ctx.needs_input_grad[1]), None)


def _norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor | None,
                   ds: torch.Tensor | None, weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, dweight or None) of ``rms_norm(x, weight, eps)`` given its output's gradient ``dy`` (None: zero), with
    ``ds`` (x's shape, or None) added to dx as autograd adds the gradients of a tensor's two consumers."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).contiguous()
    grads = dy.reshape(-1, n).contiguous() if dy is not None else torch.zeros_like(rows)
    add = ds is not None
    sums = ds.reshape(-1, n).contiguous() if add else rows
    dx = torch.empty_like(rows)
    per = fused_norm.rows_per_program(n)  # as many rows at a time as the forward
    programs = max(1, min(-(-rows.shape[0] // per), 8 * _multiprocessors(x.device)))
    per_program = -(-rows.shape[0] // (programs * per)) * per
    programs = -(-rows.shape[0] // per_program)
    dw = torch.empty(programs if weight_grad else 1, n, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_backward_kernel[(programs,)](grads, rows, weight, dx, dw, sums, rows.shape[0], per_program,
                                           grads.stride(0), rows.stride(0), dx.stride(0), sums.stride(0), eps, N=n,
                                           BLOCK=block, ROWS=per, WEIGHT_GRAD=weight_grad, ADD=add,
                                           num_warps=4 if block <= 2048 else 8)
    return dx.view(x.shape), (_sum_parts(dw, weight.dtype) if weight_grad else None)


class _AddRMSNorm(torch.autograd.Function):
    """(s, rms_norm(s)) for s = x + residual: the decoder layer's residual add and the norm after it, one kernel each
    way (``fused_norm.add_rms_norm`` forward). s's two consumers' gradients (the next residual add's and the norm's
    own backward) are summed inside the norm's backward kernel, and x and the residual both receive that sum, as
    autograd's add, norm and accumulation give them, bit for bit."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        total, normed = fused_norm.add_rms_norm(x, residual, weight, eps)
        ctx.save_for_backward(total, weight)
        ctx.eps = eps
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a tensor of zeros to add
        return total, normed

    @staticmethod
    def backward(ctx, d_total, d_normed):
        total, weight = ctx.saved_tensors
        if d_normed is None:
            return d_total, d_total, None, None
        dx, dw = _norm_backward(total, weight, ctx.eps, d_normed, d_total, ctx.needs_input_grad[2])
        return dx, dx, dw, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_norm.add_rms_norm`` (x and residual plain tensors of one shape and dtype), differentiable w.r.t. x,
    residual and weight."""
    return _AddRMSNorm.apply(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``fused_norm.rms_norm``, differentiable w.r.t. x and weight."""
    return _RMSNorm.apply(x, weight, eps)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.q_shape, ctx.k_shape = q.shape, k.shape
        return fused_rope.rope(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        q_shape, k_shape = ctx.q_shape, ctx.k_shape
        dq = _last_dim_contiguous(dq) if dq is not None else cos.new_zeros(q_shape)
        dk = _last_dim_contiguous(dk) if dk is not None else cos.new_zeros(k_shape)
        dq, dk = fused_rope.rope(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_rope.rope``, differentiable w.r.t. q and k (the rotary tables are buffers, never trained)."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("fused RoPE: the cos/sin tables require grad; unison's kernel does not differentiate them")
    return _Rope.apply(q, k, cos, sin)


# n (= rows x intermediate size) stays specialised: its divisibility by 16 is the intermediate size's, the same for
# every row, and without it the masked loads and stores run one element at a time (33 against 12 ms of a 0.6B
# training step on the H200, bench/results/h200/speed/host).
@triton.jit
def _silu_mul_kernel(G, U, Y, DY, DG, DU, n, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """Forward: y = silu(g).to(dtype) * u, rounded as transformers' two operations round. Backward: du and dg."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0)
    if BACKWARD:
        dg, du = swiglu_backward(g, u, tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32))
        tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    else:
        tl.store(Y + offs, swiglu(g, u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu(g, u):
    """silu(g) * u in fp32, g in fp32 and u as loaded: silu rounded to u's dtype first, as transformers' two
    operations round."""
    return (g * tl.sigmoid(g)).to(u.dtype).to(tl.float32) * u.to(tl.float32)


@triton.jit
def swiglu_backward(g, u, dy):
    """(dg, du) in fp32 of ``swiglu(g, u)`` given dy (fp32), with the forward's rounding of silu and autograd's of
    the product's gradient."""
    sig = tl.sigmoid(g)
    du = dy * (g * sig).to(u.dtype).to(tl.float32)
    da = (dy * u.to(tl.float32)).to(u.dtype).to(tl.float32)
    return da * sig * (1.0 + g * (1.0 - sig)), du


_ELEMENTWISE_BLOCK = 1024


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        out = torch.empty_like(gate)
        grid = (triton.cdiv(gate.numel(), _ELEMENTWISE_BLOCK),)
        _silu_mul_kernel[grid](gate, up, out, out, out, out, gate.numel(), BLOCK=_ELEMENTWISE_BLOCK,
                               BACKWARD=False, num_warps=4)
        return out

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        grid = (triton.cdiv(gate.numel(), _ELEMENTWISE_BLOCK),)
        _silu_mul_kernel[grid](gate, up, dy, dy, dg, du, gate.numel(), BLOCK=_ELEMENTWISE_BLOCK, BACKWARD=True,
                               num_warps=4)
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as transformers' SwiGLU MLPs compute it; differentiable. gate, up: the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype}")
    return _SiluMul.apply(gate, up)


class _SharedInput(torch.autograd.Function):
    """``x @ w.T`` for each of several weights: the separate projections of one input (q, k and v; gate and up). The
    backward sums their input gradients inside the GEMMs (``addmm``, accumulating in fp32 and rounding once) where
    autograd added the rounded products in separate launches (two for q/k/v, one for gate/up, a layer); each weight's
    gradient is one GEMM, as autograd's."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)
        return tuple(torch.nn.functional.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        dx, dws = None, []
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if g is None:
                dws.append(None)
                continue
            g = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = torch.mm(g, w) if dx is None else torch.addmm(dx, g, w)
            dws.append(g.t().mm(rows) if ctx.needs_input_grad[1 + i] else None)
        return (dx.view(x.shape) if dx is not None else None), *dws


def shared_input(x: torch.Tensor, *linears: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in linears)``; through ``_SharedInput`` where each is a plain bias-free ``nn.Linear`` of
    x's dtype running its own forward without hooks (a LoRA layer, a tensor-parallel shard's swapped forward or a
    hooked module runs as itself)."""
    if _plain_group(linears, x):
        return _SharedInput.apply(x, *(m.weight for m in linears))
    return tuple(m(x) for m in linears)


def _plain_group(linears, x: torch.Tensor, biased: bool = False) -> bool:
    """Each a ``_plain_linear`` and no global module hook set: their forwards may be computed together."""
    return all(_plain_linear(m, x, biased) for m in linears) and not (module_hooks._global_forward_hooks
                                                                      or module_hooks._global_forward_pre_hooks)


def joinable(linears, x: torch.Tensor, biased: bool = False) -> bool:
    """A ``_plain_group`` whose weights, and biases if any (``biased``), are laid out as one matrix (one vector:
    ``unison.engine.fused_linear.pack_projections``), and x's rows contiguous: one GEMM computes them all."""
    biases = [m.bias for m in linears]
    return (_plain_group(linears, x, biased) and x.stride(-1) == 1 and joined([m.weight for m in linears]) is not None
            and (all(b is None for b in biases) or (None not in biases and joined(biases) is not None)))


def _plain_linear(m: torch.nn.Module, x: torch.Tensor, biased: bool = False) -> bool:
    """An ``nn.Linear`` of x's dtype and device running its own forward without hooks; bias-free unless ``biased``
    (then a bias of x's dtype, if any)."""
    return (type(m) is torch.nn.Linear and (m.bias is None or (biased and m.bias.dtype == x.dtype))
            and plain_weight(m) is not None
            and m.weight.dtype == x.dtype and m.weight.device == x.device and "forward" not in m.__dict__
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks))


@contextmanager
def fused_training(model: torch.nn.Module, adds: bool = True):
    """Within the block, ``model``'s known RMSNorms, RoPE and SwiGLU MLPs run as the differentiable kernels above, the
    q/k norms and RoPE of attentions that have q/k norms as one (``unison.train.fused_qk``), and (``adds``) each
    Llama-form layer's residual adds in the norm after them (``add_rms_norm``, ``unison.engine.fused_layer.
    fused_adds``). Yields True."""
    if getattr(model, _ACTIVE, False):
        yield True
        return
    from ..engine.fused_layer import fused_adds
    from .fused_qk import training_attentions

    modules = list(model.modules())  # one walk for the swaps (the block is entered for every packed row)
    mlps = fused_mlps(model, modules)
    with ExitStack() as stack:
        stack.enter_context(fused_norm.fused_norms(model, norm=rms_norm, modules=modules))
        stack.enter_context(fused_rope.fused_rope(model, apply=rope, modules=modules))
        stack.enter_context(training_attentions(modules))
        for mlp in mlps:
            own = mlp.__dict__.get("forward")
            mlp.forward = _mlp_forward(mlp)
            stack.callback(_restore, mlp, own)
        decoder = _decoder(model) if adds else None
        if decoder is not None:  # inside the norms' swap: the final norm's own forward is then the kernel
            fused_adds(stack, decoder, add_norm=add_rms_norm, call=_call)
        setattr(model, _ACTIVE, True)
        stack.callback(delattr, model, _ACTIVE)
        yield True


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model``'s decoder stack, or None for a module that is no causal LM (its norms and MLPs are still fused)."""
    from ..engine.lm_head import decoder_of
    try:
        return decoder_of(model)
    except ValueError:
        return None


def _call(module: torch.nn.Module, *args, **kwargs):
    return module(*args, **kwargs)


def _mlp_forward(mlp: torch.nn.Module):
    from .joined import gated_up

    def forward(x: torch.Tensor) -> torch.Tensor:
        hidden = gated_up(x, mlp)  # one GEMM each way over joined weights (pack_projections)
        return mlp.down_proj(hidden if hidden is not None else silu_mul(*shared_input(x, mlp.gate_proj, mlp.up_proj)))
    return forward


def _restore(module: torch.nn.Module, own) -> None:
    if own is None:
        del module.forward
    else:
        module.forward = own


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _multiprocessors(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 2


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
