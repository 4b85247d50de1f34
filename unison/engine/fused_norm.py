"""RMSNorm in one kernel for the engine's captured decode step.

transformers' RMSNorm (Llama, Qwen2, Qwen3, Mistral) runs as eight small kernels (upcast, square, mean, add,
rsqrt, scale, downcast, weight); a decode step of a 28-layer model has 112 norms (q_norm and k_norm included),
about 900 launches of a few microseconds each on a few hundred kilobytes. ``fused_norms(model)`` swaps those
modules' forward for one Triton kernel that computes the same function in the same precision (fp32 statistics,
the normalised value rounded to the input dtype, then multiplied by the weight), for the duration of a
``with`` block: the engine captures its decode graphs inside it, every other forward (training, prefill) runs
the modules unchanged. Besides the named classes, any norm whose forward is Llama's, statement for statement
(``llama_norm``: GLM-4-MoE's, DeepSeek-V3's, SmolLM3's, ...), computes the same function and is fused too.

``add_rms_norm`` is the residual add in front of a norm in the same kernel (``unison.engine.fused_layer``).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager

import torch
import triton
import triton.language as tl

from . import gdc
from .fused_linear import swap_forward
from .source import body
from .triton_linear import Partials

# Qwen3-MoE's norm is Qwen3's, source for source (transformers 5.24); its decode spent ~0.85 ms per step of 11.6 in
# unfused norms and RoPE on the H200 (bench/results/h200/moe_decode).
NORM_CLASSES = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm"}
_LLAMA_NORM = ("input_dtype = hidden_states.dtype",
               "hidden_states = hidden_states.to(torch.float32)",
               "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
               "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
               "return self.weight * hidden_states.to(input_dtype)")


@functools.cache
def llama_norm(cls: type) -> bool:
    """Whether ``cls`` is an RMSNorm that the kernel computes: a named class, or Llama's forward, line for line."""
    return cls.__name__ in NORM_CLASSES or body(cls.forward) == _LLAMA_NORM


def fusable(module: torch.nn.Module) -> bool:
    return llama_norm(type(module)) and hasattr(module, "variance_epsilon") and hasattr(module, "weight")


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(X, W, Y, R, S, B, n_rows, stride_x, stride_y, stride_r, stride_s, stride_p, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, RESIDUAL: tl.constexpr,
                     PDL: tl.constexpr, SPLITS: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False):
    """Rows [pid * ROWS, ...) of Y = norm(X) (with ``RESIDUAL``: S = X + R rounded to R's dtype as PyTorch's add
    rounds, then Y = norm(S)). With SPLITS > 0, X is a projection's fp32 partials (``triton_linear.Partials``, share
    s at X + s * stride_p): summed in order, plus the bias B, rounded to R's dtype, as ``split_linear`` would."""
    gdc.wait(PDL)
    row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (cols < N) & (row < n_rows)
    if SPLITS > 0:
        x = tl.zeros([ROWS, BLOCK], tl.float32)
        for s in tl.static_range(SPLITS):
            x += tl.load(X + s * stride_p + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            x += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
        x = x.to(R.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(R.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, 1, keep_dims=True) / N
    normed = (x * tl.rsqrt(variance + eps)).to(R.dtype.element_ty if SPLITS > 0 else X.dtype.element_ty)
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Y + row * stride_y + cols, out.to(Y.dtype.element_ty), mask=mask)


def rows_per_program(n: int) -> int:
    """Rows of width ``n`` a program normalises: one row of a hidden state (1024 wide or more), several of a head
    (a q/k norm's 128: eight), so that a program holds ~1024 elements. One program per 128-wide row (its 4 warps
    one element a thread) took 32.8 ms of the 0.6B training step's GPU time where eight take 6.8
    (bench/results/h200/speed/host)."""
    return max(1, min(16, 1024 // triton.next_power_of_2(n)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) over the last dimension, statistics in fp32."""
    n = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    per = rows_per_program(n)
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], per),)](
        rows, weight, out, rows, rows, rows, rows.shape[0], rows.stride(0), out.stride(0), 0, 0, 0, eps, N=n,
        BLOCK=triton.next_power_of_2(n), ROWS=per, RESIDUAL=False, num_warps=4 if n <= 2048 else 8,
        **gdc.launch(x))
    return out.view(*x.shape[:-1], n)


def add_rms_norm(x: torch.Tensor | Partials, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s, weight, eps)) with s = x + residual in x's dtype (``residual`` of x's shape and dtype): the
    decoder layer's residual add and the norm after it, one kernel. ``x`` may be a projection's unsummed shares
    (``triton_linear.Partials``, rows as ``residual``'s): summed here, with its bias, to the same bits."""
    n = x.shape[-1]
    res = _rows(residual)
    total = torch.empty_like(res)
    out = torch.empty(res.shape, dtype=torch.promote_types(weight.dtype, res.dtype), device=res.device)
    per = rows_per_program(n)
    if isinstance(x, Partials):
        if x.shape != res.shape or x.dtype != res.dtype:
            raise ValueError(f"add_rms_norm: partials of {x.shape} {x.dtype}, residual {tuple(res.shape)} {res.dtype}")
        rows, splits, bias = x.parts, x.parts.shape[0], x.bias
        strides = rows.stride(1), rows.stride(0)
    else:
        rows, splits, bias = _rows(x), 0, None
        strides = rows.stride(0), 0
    _rms_norm_kernel[(triton.cdiv(res.shape[0], per),)](
        rows, weight, out, res, total, res if bias is None else bias, res.shape[0], strides[0], out.stride(0),
        res.stride(0), total.stride(0), strides[1], eps, N=n, BLOCK=triton.next_power_of_2(n), ROWS=per,
        RESIDUAL=True, num_warps=4 if n <= 2048 else 8, SPLITS=splits, HAS_BIAS=bias is not None,
        **gdc.launch(residual))
    return total.view(residual.shape), out.view(*residual.shape[:-1], n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@contextmanager
def fused_norms(model: torch.nn.Module, norm=None, modules: list[torch.nn.Module] | None = None):
    """Within the block, every RMSNorm of a known class in ``model`` (``modules``: its modules, listed once by the
    caller) runs as one kernel: ``norm(x, weight, eps)``, this module's ``rms_norm`` unless given (the trainer
    passes its differentiable one, ``unison.train.fused.rms_norm``)."""
    norm = norm or rms_norm
    with ExitStack() as stack:
        switched = 0
        for module in model.modules() if modules is None else modules:
            if fusable(module):
                swap_forward(stack, module, _fused_forward(module, norm))
                switched += 1
        yield switched


def _fused_forward(module: torch.nn.Module, norm):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return norm(hidden_states, module.weight, module.variance_epsilon)
    return forward
