"""Each layer's q/k/v projections in one kernel, and its SwiGLU MLP's gate and up projections with the SiLU and the
product in one, for the engine's captured decode step.

At decode's few rows a projection reads its weight once and does little else: a 0.6B model's layer reads 30 MB
of weights in seven cuBLAS calls of ~5 us each on an H200 (bench/results/h200/speed/decode/base), about four times
what its bytes take, plus a SiLU and a product of two more launches. The weights are the trainer's own tensors, so
they cannot be concatenated into one matrix without a copy; the kernels here read them where they are instead:
one launch covers the tiles of the three projections' outputs side by side (``project``), another computes a tile
of gate and of up for the same columns and writes silu(gate) * up (``gated``).

``fused_projections(model)`` swaps them in for the duration of a ``with`` block (the engine captures its decode
graphs inside it) in the attention and MLP classes whose forward is transformers' (checked from its source), for
plain ``nn.Linear`` projections of one dtype: a LoRA layer, a tensor-parallel shard or any
other module keeps its own forward. Rounding as transformers': fp32 accumulation, the bias added in fp32, one
rounding to the weights' dtype; silu(gate) and the product each rounded as PyTorch rounds them. The summation order
is not cuBLAS's, so results agree to the dtype's rounding (tests/test_fused_linear.py, tests/test_triton_gpu.py).
"""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import ExitStack, contextmanager

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
_MLP_SOURCE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"  # checked at switch time
ATTENTION_CLASSES = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "Qwen3MoeAttention"}
_QKV_SOURCE = ("self.q_proj(hidden_states)", "self.k_proj(hidden_states)", "self.v_proj(hidden_states)")
MAX_ROWS = 128
"""Rows (decode requests) up to which the kernels run; more rows take cuBLAS's, whose tiles then pay off."""
DEVICES = {"cuda"}
"""Where the swapped-in forwards run the kernels: in Triton's interpreter (the CPU tests) they cost more than they
save, so the CPU keeps PyTorch's projections unless a test adds "cpu"."""


@triton.jit
def _tile(X, W, M, N, K, stride_x, stride_w, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """X[:M] @ W[tile * BLOCK_N : ...].T in fp32: (BLOCK_M, BLOCK_N)."""
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(X + rows[:, None] * stride_x + (k + ks)[None, :],
                    mask=(rows < M)[:, None] & (k + ks < K)[None, :], other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_w + (k + ks)[None, :],
                    mask=(cols < N)[:, None] & (k + ks < K)[None, :], other=0.0)
        if PRECISION == "ieee":
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _store(Y, B, acc, M, N, stride_y, tile, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _project_kernel(X, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, M, K, N0, N1, N2, T0, T1, stride_x,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Program p: output tile p of the three projections' tiles side by side (T0 of the first, T1 of the second)."""
    p = tl.program_id(0)
    if p < T0:
        acc = _tile(X, W0, M, N0, K, stride_x, K, p, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        _store(Y0, B0, acc, M, N0, N0, p, HAS_BIAS, BLOCK_M, BLOCK_N)
    elif p < T0 + T1:
        acc = _tile(X, W1, M, N1, K, stride_x, K, p - T0, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        _store(Y1, B1, acc, M, N1, N1, p - T0, HAS_BIAS, BLOCK_M, BLOCK_N)
    else:
        acc = _tile(X, W2, M, N2, K, stride_x, K, p - T0 - T1, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        _store(Y2, B2, acc, M, N2, N2, p - T0 - T1, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _gated_kernel(X, G, U, Y, M, K, N, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program p: columns tile p of silu(X @ G.T) * (X @ U.T), each product rounded to Y's dtype first."""
    p = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = p * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(X + rows[:, None] * stride_x + (k + ks)[None, :],
                    mask=(rows < M)[:, None] & (k + ks < K)[None, :], other=0.0)
        w_mask = (cols < N)[:, None] & (k + ks < K)[None, :]
        w_at = cols[:, None].to(tl.int64) * K + (k + ks)[None, :]
        g = tl.load(G + w_at, mask=w_mask, other=0.0)
        u = tl.load(U + w_at, mask=w_mask, other=0.0)
        if PRECISION == "ieee":
            x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        gate = tl.dot(x, tl.trans(g), gate, input_precision=PRECISION)
        up = tl.dot(x, tl.trans(u), up, input_precision=PRECISION)
    gate = gate.to(Y.dtype.element_ty).to(tl.float32)
    up = up.to(Y.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)  # PyTorch's silu, then rounded
    tl.store(Y + rows[:, None] * N + cols[None, :], (act * up).to(Y.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def tiles(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows: every row in one tile, narrow column tiles (a
    1024-wide output spreads over 32-64 programs), a shorter K step at more rows. The fastest in the sweep of
    bench/decode_linear.py on an H200 (bench/results/h200/speed/decode/run3/decode_linear.json); beyond 128 rows
    cuBLAS's are."""
    block_m = max(16, triton.next_power_of_2(m))
    if block_m <= 16:
        return block_m, 16, 128, 2, 4
    return (block_m, 32, 128, 4, 3) if block_m <= 64 else (block_m, 32, 64, 4, 4)


def _precision(x: torch.Tensor) -> str:
    """fp32 products in full precision, as PyTorch's matmuls (Triton's default for fp32 dots would be tf32); the
    interpreter (the CPU tests) multiplies 16-bit floats as fp32, exactly as the GPU's fp32-accumulating dots do (it
    has no bf16 matmul of its own)."""
    return "ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32"


def project(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
            config: tuple[int, int, int, int, int] | None = None) -> list[torch.Tensor]:
    """[x @ w.T (+ b) for each of three weights], x: (M, K) with M <= MAX_ROWS, in one launch; ``config``: the
    ``tiles`` to use (the benchmark's sweep)."""
    m, k = x.shape
    block_m, block_n, block_k, warps, stages = config or tiles(m)
    outs = [x.new_empty(m, w.shape[0]) for w in weights]
    counts = [triton.cdiv(w.shape[0], block_n) for w in weights]
    b = biases or weights
    _project_kernel[(sum(counts),)](x, *weights, *b, *outs, m, k, *(w.shape[0] for w in weights), counts[0], counts[1],
                                   x.stride(0), HAS_BIAS=biases is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                   BLOCK_K=block_k, PRECISION=_precision(x), num_warps=warps, num_stages=stages)
    return outs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the same kernel, x: (M, K) with M <= MAX_ROWS. Not swapped in for o_proj and
    down_proj: one weight alone gains nothing from the shared launch, and cuBLAS's tiles were faster for those on
    the H200 (5.8 against 9.3 us for the 0.6B shape's o_proj at 64 rows: bench/decode_linear.py)."""
    m, k = x.shape
    block_m, block_n, block_k, warps, stages = config or tiles(m)
    out = x.new_empty(m, weight.shape[0])
    b = bias if bias is not None else weight
    _project_kernel[(triton.cdiv(weight.shape[0], block_n),)](
        x, weight, weight, weight, b, b, b, out, out, out, m, k, weight.shape[0], 0, 0, triton.cdiv(weight.shape[0],
        block_n), 0, x.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=_precision(x), num_warps=warps, num_stages=stages)
    return out


def gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
          config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), x: (M, K) with M <= MAX_ROWS, in one launch."""
    m, k = x.shape
    block_m, block_n, block_k, warps, stages = config or tiles(m)
    out = x.new_empty(m, gate.shape[0])
    _gated_kernel[(triton.cdiv(gate.shape[0], block_n),)](x, gate, up, out, m, k, gate.shape[0], x.stride(0),
                                                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                          PRECISION=_precision(x), num_warps=warps,
                                                          num_stages=stages)
    return out


def _plain(linears: list[torch.nn.Module]) -> bool:
    """Plain ``nn.Linear`` layers with contiguous plain-tensor weights of one dtype and input width, biased alike."""
    if not all(type(m) is torch.nn.Linear and type(m.weight.data) is torch.Tensor and m.weight.is_contiguous()
               for m in linears):
        return False
    w0 = linears[0].weight
    return all(m.weight.dtype == w0.dtype and m.weight.shape[1] == w0.shape[1] and m.weight.device == w0.device
               and (m.bias is None) == (linears[0].bias is None) for m in linears)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x`` as (M, K) rows the kernels take, or None (too many rows, another dtype or device, a strided last dim)."""
    rows = x.reshape(-1, x.shape[-1])
    if (rows.shape[0] > MAX_ROWS or rows.stride(-1) != 1 or x.dtype != weight.dtype or x.device != weight.device
            or x.device.type not in DEVICES):
        return None
    return rows



class _QKV:
    """q_proj, k_proj and v_proj of one attention: the first of them called on an input computes all three; the other
    two return their share (transformers calls all three on the same ``hidden_states``)."""

    def __init__(self, attn: torch.nn.Module):
        self.linears = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.input, self.outputs = None, {}

    def forward_of(self, index: int):
        linear = self.linears[index]
        plain = torch.nn.Linear.forward.__get__(linear)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x is not self.input:
                rows = _rows(x, linear.weight)
                if rows is None:
                    return plain(x)
                biases = [m.bias for m in self.linears] if linear.bias is not None else None
                outs = project(rows, [m.weight for m in self.linears], biases)
                self.input, self.outputs = x, {i: o.view(*x.shape[:-1], -1) for i, o in enumerate(outs)}
            out = self.outputs.pop(index)
            if not self.outputs:
                self.input = None
            return out
        return forward


def swiglu_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The SwiGLU MLPs of known classes in ``model`` whose forward is transformers' (checked from its source) and
    whose activation is SiLU (the trainer's fused MLPs too: ``unison.train.fused``)."""
    return [m for m in model.modules() if _swiglu_class(type(m))
            and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")]


@functools.cache
def _swiglu_class(cls: type) -> bool:
    return cls.__name__ in MLP_CLASSES and _MLP_SOURCE in inspect.getsource(cls.forward)


@functools.cache
def _qkv_class(cls: type) -> bool:
    return cls.__name__ in ATTENTION_CLASSES and all(s in inspect.getsource(cls.forward) for s in _QKV_SOURCE)


def _gated_forward(mlp: torch.nn.Module, original):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, mlp.gate_proj.weight)
        if rows is None:
            return original(x)
        return mlp.down_proj(gated(rows, mlp.gate_proj.weight, mlp.up_proj.weight).view(*x.shape[:-1], -1))
    return forward


@contextmanager
def fused_projections(model: torch.nn.Module):
    """Within the block, the q/k/v projections of every known attention class in ``model`` run as one kernel, and
    the gate/up projections and SwiGLU of every known MLP as another, where they are plain ``nn.Linear`` layers.
    Yields the number of modules switched."""
    with ExitStack() as stack:
        switched = 0
        for module in model.modules():
            if _qkv_class(type(module)) and _plain([module.q_proj, module.k_proj, module.v_proj]):
                qkv = _QKV(module)
                for i, proj in enumerate(qkv.linears):
                    swap_forward(stack, proj, qkv.forward_of(i))
                switched += 1
        for mlp in swiglu_mlps(model):
            if _plain([mlp.gate_proj, mlp.up_proj]) and mlp.gate_proj.bias is None:
                swap_forward(stack, mlp, _gated_forward(mlp, mlp.forward))
                switched += 1
        yield switched


def swap_forward(stack: ExitStack, module: torch.nn.Module, forward) -> None:
    """``module.forward = forward`` until ``stack`` closes, then the module's own forward again."""
    own = module.__dict__.get("forward")
    module.forward = forward

    def restore():
        if own is None:
            del module.forward
        else:
            module.forward = own
    stack.callback(restore)
