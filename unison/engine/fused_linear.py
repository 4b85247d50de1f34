"""Each layer's q/k/v projections in one kernel, and its SwiGLU MLP's gate and up projections with the SiLU and the
product in one, o_proj and down_proj split over K, for the engine's captured decode step.

At decode's few rows a projection reads its weight once and does little else: a 0.6B model's layer reads 30 MB
of weights in seven cuBLAS calls of ~5 us each on an H200 (bench/results/h200/speed/decode/base), about four times
what its bytes take, plus a SiLU and a product of two more launches. The weights are the trainer's own tensors, so
they cannot be concatenated into one matrix without a copy; the kernels here read them where they are instead:
one launch covers the tiles of the three projections' outputs side by side (``project``), another computes a tile
of gate and of up for the same columns and writes silu(gate) * up (``gated``). o_proj and down_proj have a 1024-wide
output at the 0.6B shape, too few column tiles to keep every multiprocessor reading: their K is split over several
programs (``linear`` with ``output_tiles``), each storing an fp32 partial; the last of a tile's programs to arrive
(an atomic counter) sums the partials in split order, so the result does not depend on which arrives last.

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

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch: PDL stays off
    gdc_launch_dependents = gdc_wait = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
_MLP_SOURCE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"  # checked at switch time
ATTENTION_CLASSES = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "Qwen3MoeAttention"}
_QKV_SOURCE = ("self.q_proj(hidden_states)", "self.k_proj(hidden_states)", "self.v_proj(hidden_states)")
MAX_ROWS = 128
"""Rows (decode requests) up to which the kernels run; more rows take cuBLAS's, whose tiles then pay off."""
OUTPUT_MAX_ROWS = 128
"""Rows up to which o_proj and down_proj run the split-K kernel (``linear``); 0 leaves them to cuBLAS."""
DEVICES = {"cuda"}
"""Where the swapped-in forwards run the kernels: in Triton's interpreter (the CPU tests) they cost more than they
save, so the CPU keeps PyTorch's projections unless a test adds "cpu"."""


@triton.jit
def _sync(PDL: tl.constexpr):
    """Under programmatic dependent launch, let the next kernel launch and wait here for the previous one's writes."""
    if PDL > 0:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _w_tile(W, N, stride_w, tile, k, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = k + tl.arange(0, BLOCK_K)
    return tl.load(W + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                   mask=(cols < N)[:, None] & (ks < k_end)[None, :], other=0.0)


@triton.jit
def _x_tile(X, M, stride_x, k, k_end, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    ks = k + tl.arange(0, BLOCK_K)
    return tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=(rows < M)[:, None] & (ks < k_end)[None, :],
                   other=0.0)


@triton.jit
def _dot(x, w, acc, PRECISION: tl.constexpr):
    if PRECISION == "ieee":
        x, w = x.to(tl.float32), w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _tile(X, W, M, N, K, stride_x, stride_w, tile, split, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """X[:M, ks] @ W[tile * BLOCK_N : ..., ks].T in fp32: (BLOCK_M, BLOCK_N), ks the K_SPLIT-wide share of ``split``.
    PDL 2 (a share of one K step): the weights are loaded before waiting for the previous kernel, which wrote X."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    if PDL == 2:
        w = _w_tile(W, N, stride_w, tile, k_start, k_end, BLOCK_N, BLOCK_K)
        _sync(PDL)
        return _dot(_x_tile(X, M, stride_x, k_start, k_end, BLOCK_M, BLOCK_K), w, acc, PRECISION)
    _sync(PDL)
    for k in range(k_start, k_end, BLOCK_K):
        acc = _dot(_x_tile(X, M, stride_x, k, k_end, BLOCK_M, BLOCK_K),
                   _w_tile(W, N, stride_w, tile, k, k_end, BLOCK_N, BLOCK_K), acc, PRECISION)
    return acc


@triton.jit
def _store(Y, B, acc, M, N, stride_y, tile, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _partials(P, M, N, tile, column, stride_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K: where a tile's fp32 partials lie in P (split s's at ``+ s * M * stride_p``), and their mask."""
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return P + rows[:, None] * stride_p + (column + cols)[None, :], (rows < M)[:, None] & (cols < N)[None, :]


@triton.jit
def _arrive(C, counter, SPLITS: tl.constexpr):
    """After a split stored its partials: whether it is the last of the tile's splits to arrive (the one that sums
    them). C[counter] counts the arrivals; the last resets it to 0 for the next launch."""
    tl.debug_barrier()  # every thread's partials stored before the release
    last = tl.atomic_add(C + counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        tl.atomic_xchg(C + counter, 0)
    return last


@triton.jit
def _sum(at, mask, M, stride_p, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Every split's partial summed in split order (the same sum whichever split arrived last)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(at + s * M * stride_p, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _finish(Y, B, P, C, acc, M, N, stride_y, tile, split, counter, column, stride_p, HAS_BIAS: tl.constexpr,
            SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores the output tile: at once without a split, else by the split that arrives last, from every split's."""
    if SPLITS == 1:
        _store(Y, B, acc, M, N, stride_y, tile, HAS_BIAS, BLOCK_M, BLOCK_N)
    else:
        at, mask = _partials(P, M, N, tile, column, stride_p, BLOCK_M, BLOCK_N)
        tl.store(at + split * M * stride_p, acc, mask=mask)
        if _arrive(C, counter, SPLITS):
            _store(Y, B, _sum(at, mask, M, stride_p, SPLITS, BLOCK_M, BLOCK_N), M, N, stride_y, tile, HAS_BIAS,
                   BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _project_kernel(X, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, P, C, M, K, N0, N1, N2, T0, T1, stride_x, K_SPLIT,
                    HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (p, s): split s of output tile p of the three projections' tiles side by side (T0 of the first, T1
    of the second); their partials side by side in P's rows."""
    p = tl.program_id(0)
    s = tl.program_id(1)
    width = N0 + N1 + N2
    if p < T0:
        acc = _tile(X, W0, M, N0, K, stride_x, K, p, s, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PDL)
        _finish(Y0, B0, P, C, acc, M, N0, N0, p, s, p, 0, width, HAS_BIAS, SPLITS, BLOCK_M, BLOCK_N)
    elif p < T0 + T1:
        acc = _tile(X, W1, M, N1, K, stride_x, K, p - T0, s, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PDL)
        _finish(Y1, B1, P, C, acc, M, N1, N1, p - T0, s, p, N0, width, HAS_BIAS, SPLITS, BLOCK_M, BLOCK_N)
    else:
        acc = _tile(X, W2, M, N2, K, stride_x, K, p - T0 - T1, s, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PDL)
        _finish(Y2, B2, P, C, acc, M, N2, N2, p - T0 - T1, s, p, N0 + N1, width, HAS_BIAS, SPLITS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _gated_kernel(X, G, U, Y, P, C, M, K, N, stride_x, K_SPLIT, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (p, s): split s of columns tile p of silu(X @ G.T) * (X @ U.T), each product rounded to Y's dtype
    first; gate's partials in P's first N columns, up's in the next N."""
    p = tl.program_id(0)
    s = tl.program_id(1)
    if PDL == 2:  # both weights' tiles loaded before the wait
        k_start = s * K_SPLIT
        k_end = tl.minimum(K, k_start + K_SPLIT)
        g = _w_tile(G, N, K, p, k_start, k_end, BLOCK_N, BLOCK_K)
        u = _w_tile(U, N, K, p, k_start, k_end, BLOCK_N, BLOCK_K)
        _sync(PDL)
        x = _x_tile(X, M, stride_x, k_start, k_end, BLOCK_M, BLOCK_K)
        gate = _dot(x, g, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION)
        up = _dot(x, u, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION)
    else:
        gate = _tile(X, G, M, N, K, stride_x, K, p, s, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PDL)
        up = _tile(X, U, M, N, K, stride_x, K, p, s, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PDL)
    last = True
    if SPLITS > 1:
        at_gate, mask = _partials(P, M, N, p, 0, 2 * N, BLOCK_M, BLOCK_N)
        at_up, _ = _partials(P, M, N, p, N, 2 * N, BLOCK_M, BLOCK_N)
        tl.store(at_gate + s * M * 2 * N, gate, mask=mask)
        tl.store(at_up + s * M * 2 * N, up, mask=mask)
        last = _arrive(C, p, SPLITS)
        if last:
            gate = _sum(at_gate, mask, M, 2 * N, SPLITS, BLOCK_M, BLOCK_N)
            up = _sum(at_up, mask, M, 2 * N, SPLITS, BLOCK_M, BLOCK_N)
    if last:
        rows = tl.arange(0, BLOCK_M)
        cols = p * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = gate.to(Y.dtype.element_ty).to(tl.float32)
        up = up.to(Y.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)  # PyTorch's silu, then rounded
        tl.store(Y + rows[:, None] * N + cols[None, :], (act * up).to(Y.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


Config = tuple[int, int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, splits): a launch's tiles and how many programs share each
output tile's K (split-K: each stores an fp32 partial, the last to arrive sums them in split order)."""


def tiles(m: int) -> Config:
    """The configuration for m rows: every row in one tile, narrow column tiles (a 1024-wide output spreads over
    32-64 programs), a shorter K step at more rows. The fastest in the sweep of bench/decode_linear.py on an H200
    (bench/results/h200/speed/decode/run3/decode_linear.json); beyond 128 rows cuBLAS's are."""
    block_m = max(16, triton.next_power_of_2(m))
    if block_m <= 16:
        return block_m, 16, 128, 2, 4, 1
    return (block_m, 32, 128, 4, 3, 1) if block_m <= 64 else (block_m, 32, 64, 4, 4, 1)


def output_tiles(m: int) -> Config:
    """The configuration of o_proj and down_proj (one weight, a narrow output, a long K) for m rows: split-K, so that
    a 1024-wide output still spreads over every multiprocessor."""
    block_m = max(16, triton.next_power_of_2(m))
    return block_m, 32, 128, 4, 3, 4


COUNTERS = 1 << 16
"""Split-K arrival counters per device, each back at 0 after every launch: one per output tile of a launch."""
_counters: dict[torch.device, torch.Tensor] = {}


def _split(x: torch.Tensor, width: int, tiles: int, config: Config) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(partials workspace, arrival counters, K_SPLIT, splits) of a launch; a launch of more output tiles than
    there are counters takes one split. Launches that share the counters must not run concurrently (the engine's
    run one after another on its stream)."""
    k, splits, block_k = x.shape[1], config[5], config[2]
    if splits > 1 and tiles <= COUNTERS:
        if x.device not in _counters:
            _counters[x.device] = torch.zeros(COUNTERS, dtype=torch.int32, device=x.device)
        k_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
        return x.new_empty(splits, x.shape[0], width, dtype=torch.float32), _counters[x.device], k_split, splits
    return x, x, k, 1


PDL = False
"""Launch the kernels with programmatic dependent launch (Hopper on): each may start while the kernel before it
finishes, waiting (griddepcontrol.wait) only before it reads what that kernel wrote; a split of one K step loads
its weights before the wait."""


def _pdl(k_split: int, block_k: int) -> dict:
    if not PDL or _INTERPRETED or gdc_wait is None:
        return {"PDL": 0}
    return {"PDL": 2 if k_split <= block_k else 1, "launch_pdl": True}


def _precision(x: torch.Tensor) -> str:
    """fp32 products in full precision, as PyTorch's matmuls (Triton's default for fp32 dots would be tf32); the
    interpreter (the CPU tests) multiplies 16-bit floats as fp32, exactly as the GPU's fp32-accumulating dots do (it
    has no bf16 matmul of its own)."""
    return "ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32"


def project(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
            config: Config | None = None) -> list[torch.Tensor]:
    """[x @ w.T (+ b) for each of three weights], x: (M, K) with M <= MAX_ROWS, in one launch; ``config``: the
    ``tiles`` to use (the benchmark's sweep)."""
    m, k = x.shape
    config = config or tiles(m)
    block_m, block_n, block_k, warps, stages, _ = config
    outs = [x.new_empty(m, w.shape[0]) for w in weights]
    counts = [triton.cdiv(w.shape[0], block_n) for w in weights]
    partials, counters, k_split, splits = _split(x, sum(w.shape[0] for w in weights), sum(counts), config)
    b = biases or weights
    _project_kernel[(sum(counts), splits)](
        x, *weights, *b, *outs, partials, counters, m, k, *(w.shape[0] for w in weights), counts[0], counts[1],
        x.stride(0), k_split, HAS_BIAS=biases is not None, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=_precision(x), num_warps=warps, num_stages=stages, **_pdl(k_split, block_k))
    return outs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: Config | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the same kernel, x: (M, K) with M <= MAX_ROWS."""
    m, k = x.shape
    config = config or tiles(m)
    block_m, block_n, block_k, warps, stages, _ = config
    out = x.new_empty(m, weight.shape[0])
    count = triton.cdiv(weight.shape[0], block_n)
    partials, counters, k_split, splits = _split(x, weight.shape[0], count, config)
    b = bias if bias is not None else weight
    _project_kernel[(count, splits)](
        x, weight, weight, weight, b, b, b, out, out, out, partials, counters, m, k, weight.shape[0], 0, 0, count, 0,
        x.stride(0), k_split, HAS_BIAS=bias is not None, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=_precision(x), num_warps=warps, num_stages=stages, **_pdl(k_split, block_k))
    return out


def gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), x: (M, K) with M <= MAX_ROWS, in one launch."""
    m, k = x.shape
    config = config or tiles(m)
    block_m, block_n, block_k, warps, stages, _ = config
    out = x.new_empty(m, gate.shape[0])
    count = triton.cdiv(gate.shape[0], block_n)
    partials, counters, k_split, splits = _split(x, 2 * gate.shape[0], count, config)
    _gated_kernel[(count, splits)](x, gate, up, out, partials, counters, m, k, gate.shape[0], x.stride(0), k_split,
                                   SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                   PRECISION=_precision(x), num_warps=warps, num_stages=stages,
                                   **_pdl(k_split, block_k))
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


def _linear_forward(module: torch.nn.Linear):
    """``module``'s forward through ``linear`` at up to OUTPUT_MAX_ROWS rows (split-K tiles: ``output_tiles``)."""
    plain = torch.nn.Linear.forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, module.weight)
        if rows is None or rows.shape[0] > OUTPUT_MAX_ROWS:
            return plain(x)
        out = linear(rows, module.weight, module.bias, config=output_tiles(rows.shape[0]))
        return out.view(*x.shape[:-1], -1)
    return forward


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
                if _plain([module.o_proj]):
                    swap_forward(stack, module.o_proj, _linear_forward(module.o_proj))
                switched += 1
        for mlp in swiglu_mlps(model):
            if _plain([mlp.gate_proj, mlp.up_proj]) and mlp.gate_proj.bias is None:
                swap_forward(stack, mlp, _gated_forward(mlp, mlp.forward))
                if _plain([mlp.down_proj]):
                    swap_forward(stack, mlp.down_proj, _linear_forward(mlp.down_proj))
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
