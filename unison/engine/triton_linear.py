"""The decode step's projection kernels (``unison.engine.fused_linear`` swaps them in): x @ w.T for a few rows, with
every row in one tile and the weight's columns spread over the programs.

- ``project``: the tiles of three weights' outputs side by side in one launch (q/k/v), ``linear`` one weight;
- ``gated``: a tile of gate and of up for the same columns, written as silu(gate) * up (SwiGLU's first half).

At 64 rows each program re-reads all of x (128 KiB at 1024 wide) for 64 KiB of weight, so x's tiles are most of
what a program loads, from L2. Loads (``loads_for``): "tma" brings x's tiles with the copy engine of a Hopper GPU,
five stages deep; "pointer" through pointers (older GPUs, rows not 16-byte aligned, grids of more than one wave).
Rounding as transformers': fp32 accumulation, the bias added in fp32, one rounding to the weights' dtype;
silu(gate) and the product each rounded as PyTorch rounds them. The summation order is not cuBLAS's, so results
agree to the dtype's rounding (tests/test_fused_linear.py, tests/test_triton_gpu.py).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gdc

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED_C = tl.constexpr(_INTERPRETED)  # a compiled kernel reads only constexpr globals
LOADS = ("tma", "pointer")
"""How x's tiles reach a program: through a tensor descriptor (the copy engine), or through pointers; the weights'
tiles come through pointers either way (bench/results/h200/speed/tma/: descriptors for the weights too, made on the
device where a program picks one of three weights, were 0.7 us slower at 64 rows)."""


@triton.jit
def _x_tile(X, x_desc, M, K, stride_x, k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, X_TMA: tl.constexpr):
    if X_TMA:  # rows and columns past the ends arrive as zeros
        return x_desc.load([0, k])
    rows = tl.arange(0, BLOCK_M)
    ks = k + tl.arange(0, BLOCK_K)
    return tl.load(X + rows[:, None] * stride_x + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :],
                   other=0.0)


@triton.jit
def _w_tile(W, N, K, col0, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = col0 + tl.arange(0, BLOCK_N)
    ks = k + tl.arange(0, BLOCK_K)
    return tl.load(W + cols[:, None].to(tl.int64) * K + ks[None, :], mask=(cols < N)[:, None] & (ks < K)[None, :],
                   other=0.0)


@triton.jit
def _prefetch_rows(W, N, K, col0, k0, piece_bytes, BLOCK_N: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr):
    """Ask L2 for this program's weight rows (col0 onwards, those below N) from column k0, each in PARTS pieces of
    ``piece_bytes`` (the kernels' launches prefetch only where the pieces are whole 16-byte units, else PARTS=0)."""
    if PARTS > 0:
        cols = tl.minimum(col0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)[:, None]  # past N: the last row again
        piece = piece_bytes // (W.dtype.element_ty.primitive_bitwidth // 8)
        gdc.prefetch(W + cols * K + k0 + tl.arange(0, PARTS)[None, :] * piece, piece_bytes, PDL)


@triton.jit
def _dot(x, w, acc, PRECISION: tl.constexpr):
    if PRECISION == "ieee":
        x, w = x.to(tl.float32), w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["M"])
def _project_kernel(X, x_desc, W0, W1, W2, B0, B1, B2, Y0, Y1, Y2, M, K, N0, N1, N2, T0, T1, stride_x, piece_bytes,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, X_TMA: tl.constexpr, STAGES: tl.constexpr, PARTS: tl.constexpr,
                    PDL: tl.constexpr):
    """Program p: output tile p of the three projections' tiles side by side (T0 of the first, T1 of the second).
    One loop for whichever weight the program takes, so its pipeline stages are allocated once (a loop per weight
    took three times the shared memory)."""
    p = tl.program_id(0)
    if p < T0:
        W, B, Y, N, tile = W0, B0, Y0, N0, p
    elif p < T0 + T1:
        W, B, Y, N, tile = W1, B1, Y1, N1, p - T0
    else:
        W, B, Y, N, tile = W2, B2, Y2, N2, p - T0 - T1
    _prefetch_rows(W, N, K, tile * BLOCK_N, 0, piece_bytes, BLOCK_N, PARTS, PDL)
    gdc.wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = _x_tile(X, x_desc, M, K, stride_x, k, BLOCK_M, BLOCK_K, X_TMA)
        w = _w_tile(W, N, K, tile * BLOCK_N, k, BLOCK_N, BLOCK_K)
        acc = _dot(x, w, acc, PRECISION)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _gated_kernel(X, x_desc, G, U, Y, M, K, N, stride_x, piece_bytes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, X_TMA: tl.constexpr, STAGES: tl.constexpr,
                  PARTS: tl.constexpr, PDL: tl.constexpr):
    """Program p: columns tile p of silu(X @ G.T) * (X @ U.T), each product rounded to Y's dtype first."""
    p = tl.program_id(0)
    _prefetch_rows(G, N, K, p * BLOCK_N, 0, piece_bytes, BLOCK_N, PARTS, PDL)
    _prefetch_rows(U, N, K, p * BLOCK_N, 0, piece_bytes, BLOCK_N, PARTS, PDL)
    gdc.wait(PDL)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = _x_tile(X, x_desc, M, K, stride_x, k, BLOCK_M, BLOCK_K, X_TMA)
        gate = _dot(x, _w_tile(G, N, K, p * BLOCK_N, k, BLOCK_N, BLOCK_K), gate, PRECISION)
        up = _dot(x, _w_tile(U, N, K, p * BLOCK_N, k, BLOCK_N, BLOCK_K), up, PRECISION)
    rows = tl.arange(0, BLOCK_M)
    cols = p * BLOCK_N + tl.arange(0, BLOCK_N)
    gate = gate.to(Y.dtype.element_ty).to(tl.float32)
    up = up.to(Y.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)  # PyTorch's silu, then rounded
    tl.store(Y + rows[:, None] * N + cols[None, :], (act * up).to(Y.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M"])
def _split_kernel(X, x_desc, W, B, Y, Part, Count, M, K, N, stride_x, piece_bytes, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                  PRECISION: tl.constexpr, X_TMA: tl.constexpr, STAGES: tl.constexpr, PARTS: tl.constexpr,
                  PDL: tl.constexpr, REDUCE: tl.constexpr = True):
    """Program (tile, split): output tile ``tile`` over split ``split``'s share of K (K / SPLITS, whole K steps),
    its fp32 partial to ``Part``; with ``REDUCE`` the tile's last program to finish (a counter per tile, put back to
    0 by that program) sums the partials in the order of the splits, so the result does not depend on which
    finished last. Without, the partials are the output (``split_parts``: the next kernel sums them)."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    k_per = K // SPLITS
    k0 = split * k_per
    _prefetch_rows(W, N, K, tile * BLOCK_N, k0, piece_bytes, BLOCK_N, PARTS, PDL)
    gdc.wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(k0, k0 + k_per, BLOCK_K, num_stages=STAGES):
        x = _x_tile(X, x_desc, M, K, stride_x, k, BLOCK_M, BLOCK_K, X_TMA)
        w = _w_tile(W, N, K, tile * BLOCK_N, k, BLOCK_N, BLOCK_K)
        acc = _dot(x, w, acc, PRECISION)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    tl.store(Part + split * BLOCK_M * N + at, acc, mask=inside)
    if not REDUCE:
        return
    # Every thread's partial reaches the device before one thread counts the program as done.
    _fence()
    tl.debug_barrier()
    done = tl.atomic_add(Count + tile, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:
        _fence()
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(Part + s * BLOCK_M * N + at, mask=inside, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + at, total.to(Y.dtype.element_ty), mask=inside)
        tl.atomic_xchg(Count + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fence():
    """A device-scope fence by every thread (the interpreter runs programs one at a time and needs none)."""
    if not _INTERPRETED_C:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


def tiles(m: int, loads: str = "tma", element_size: int = 2) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m rows: every row in one tile, narrow column tiles (a
    1024-wide output spreads over 32-64 programs). With x through a descriptor: five stages of 128-wide K steps up to
    64 rows, 64-wide from there (what fits the shared memory at 256 rows), the fastest in bench/decode_linear.py's
    sweep on an H200 (bench/results/h200/speed/tma/decode_linear.json); through pointers: the fastest of its earlier
    sweep (bench/results/h200/speed/decode/run3/decode_linear.json). fp32 tiles take half as wide K steps."""
    block_m = max(16, triton.next_power_of_2(m))
    if loads == "tma":
        config = (block_m, 32, 128, 4, 5) if block_m <= 64 else (block_m, 32, 64, 4, 5)
    elif block_m <= 16:
        config = block_m, 16, 128, 2, 4
    elif block_m <= 64:
        config = block_m, 32, 128, 4, 3
    else:
        config = (block_m, 32, 64, 4, 4) if block_m <= 128 else (block_m, 32, 64, 4, 3)
    if element_size > 2:
        config = (*config[:2], config[2] // 2, *config[3:])
    return config


def _precision(x: torch.Tensor) -> str:
    """fp32 products in full precision, as PyTorch's matmuls (Triton's default for fp32 dots would be tf32); the
    interpreter (the CPU tests) multiplies 16-bit floats as fp32, exactly as the GPU's fp32-accumulating dots do (it
    has no bf16 matmul of its own)."""
    return "ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32"


def loads_for(x: torch.Tensor, weights: list[torch.Tensor], width: int) -> str:
    """"tma" where x's tiles can come through a tensor descriptor: the copy engine of a Hopper GPU or later (in the
    interpreter fp32 only: its 16-bit descriptor loads are wrong), every row 16-byte aligned, and the ``width``
    output columns' tiles one wave of programs; else "pointer". Five stages fill a multiprocessor's shared memory
    where the pointer kernels' fewer stages leave room for two programs: 1.7B's 6144-wide gate/up (192 tiles) took
    18.9 us a layer at 64 rows through descriptors, 17.0 through pointers (15.9 and 15.0 at 16 rows;
    bench/results/h200/speed/tma/decode_linear_sweep.json, "tma-x" there)."""
    if _INTERPRETED:
        capable = x.dtype == torch.float32
    else:
        capable = (x.is_cuda and _capability(x.device) >= (9, 0)
                   and -(-width // tiles(x.shape[0], "tma", x.element_size())[1]) <= multiprocessors(x.device))
    aligned = all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, *weights))
    return "tma" if capable and aligned else "pointer"


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _x_descriptor(x: torch.Tensor, block_m: int, block_k: int, loads: str) -> TensorDescriptor | torch.Tensor:
    """x's tensor descriptor (host-made: the launch passes it by value, a graph keeps it), or x where none is used."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k]) if loads == "tma" else x


PREFETCH_BYTES = 16 << 20
"""The most weight bytes one launch asks L2 for before its wait: the first columns of each row where the rows hold
more (1.7B's 50 MB gate/up would evict its own prefetched rows before the kernel read them from a 50 MB L2)."""


def _prefetch_parts(weights: list[torch.Tensor], block_n: int, warps: int, shares: int = 1) -> tuple[int, int]:
    """(PARTS, piece bytes): a programmatic launch prefetches the first PARTS pieces of each weight row (of each of
    its ``shares`` of K, for ``split_linear``), a piece a thread, at most PREFETCH_BYTES in all; (0, 0) where a
    piece would not be whole 16-byte units at 16-byte aligned addresses."""
    k, size = weights[0].shape[1] // shares, weights[0].element_size()
    parts = max(1, warps * 32 // block_n)
    row = min(k * size, PREFETCH_BYTES // (shares * sum(w.shape[0] for w in weights)))
    piece = row // parts // 16 * 16
    if piece == 0 or (weights[0].shape[1] * size) % 16 or any(w.data_ptr() % 16 for w in weights):
        return 0, 0
    return parts, piece


def _check_loads(loads: str) -> str:
    if loads not in LOADS:
        raise ValueError(f"loads={loads!r}: one of {LOADS}")
    return loads


def project(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None,
            config: tuple[int, int, int, int, int] | None = None, loads: str | None = None) -> list[torch.Tensor]:
    """[x @ w.T (+ b) for each of three weights], x: (M, K) with few rows, in one launch; ``config``: the ``tiles``
    to use, ``loads``: one of LOADS (the benchmark's sweep; by default ``loads_for``'s)."""
    outs = [x.new_empty(x.shape[0], w.shape[0]) for w in weights]
    _launch_project(x, weights, biases, outs, [w.shape[0] for w in weights], config, loads)
    return outs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int, int, int] | None = None, loads: str | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the same kernel (the weight in the first place, no tiles of the others)."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    _launch_project(x, [weight] * 3, None if bias is None else [bias] * 3, [out] * 3, [weight.shape[0], 0, 0],
                    config, loads)
    return out


def _launch_project(x, weights, biases, outs, widths, config, loads) -> None:
    m, k = x.shape
    loads = _check_loads(loads or loads_for(x, weights, sum(widths)))
    block_m, block_n, block_k, warps, stages = config or tiles(m, loads, x.element_size())
    counts = [triton.cdiv(n, block_n) for n in widths]
    launch = gdc.launch(x)
    parts, piece = _prefetch_parts(weights, block_n, warps) if launch["PDL"] else (0, 0)
    _project_kernel[(sum(counts),)](
        x, _x_descriptor(x, block_m, block_k, loads), *weights, *(biases or weights), *outs, m, k, *widths,
        counts[0], counts[1], x.stride(0), piece, HAS_BIAS=biases is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=_precision(x), X_TMA=loads == "tma", STAGES=stages, PARTS=parts,
        num_warps=warps, **launch)


COUNTERS = 4096
"""Counters per device for ``split_linear``'s tiles (allocated once, before any graph reads them): outputs up to
COUNTERS column tiles wide."""
_counters: dict[torch.device, torch.Tensor] = {}


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int,
                 config: tuple[int, int, int, int, int] | None = None, loads: str | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with K in ``splits`` shares (programs side by side for an output too narrow to fill
    the GPU: 0.6B's o_proj and down_proj are 32 column tiles), summed in the kernel by each tile's last program.
    K must be a whole number of K steps per share (``split_for``). Launches on one device must not overlap (the
    tiles' counters are the device's): the engine runs its kernels on one stream."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    _launch_split(x, weight, bias, splits, config, loads, out)
    return out


class Partials(NamedTuple):
    """x @ weight.T (+ bias) not yet summed over K's shares: ``parts[s, :rows]`` is share s's fp32 product. The
    kernel that takes it (``fused_norm.add_rms_norm``) sums the shares in order, adds the bias and rounds to
    ``dtype`` as ``split_linear``'s last program would, so the result has the same bits."""
    parts: torch.Tensor  # (splits, BLOCK_M, N) fp32
    bias: torch.Tensor | None
    rows: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.parts.shape[2]


def split_parts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int,
                config: tuple[int, int, int, int, int] | None = None, loads: str | None = None) -> Partials:
    """``split_linear`` without its reduction: the kernel ends when each program has stored its share's product (no
    fence, counter or last program's sum at the end of the launch); the kernel after it sums them."""
    return Partials(_launch_split(x, weight, bias, splits, config, loads, None), bias, x.shape[0], x.dtype)


def _launch_split(x, weight, bias, splits, config, loads, out: torch.Tensor | None) -> torch.Tensor:
    """Launch ``_split_kernel``: reducing into ``out``, or (None) leaving the shares' partials; returns those."""
    m, k = x.shape
    n = weight.shape[0]
    loads = _check_loads(loads or loads_for(x, [weight], n * splits))
    block_m, block_n, block_k, warps, stages = config or tiles(m, loads, x.element_size())
    columns = triton.cdiv(n, block_n)
    if k % (splits * block_k) or columns > COUNTERS:
        raise ValueError(f"K={k} in {splits} shares of whole {block_k}-wide steps, {columns} column tiles")
    part = torch.empty(splits, block_m, n, dtype=torch.float32, device=x.device)
    launch = gdc.launch(x)
    parts, piece = _prefetch_parts([weight], block_n, warps, splits) if launch["PDL"] else (0, 0)
    reduce = out is not None
    _split_kernel[(columns, splits)](
        x, _x_descriptor(x, block_m, block_k, loads), weight, weight if bias is None or not reduce else bias,
        out if reduce else part, part, _tile_counters(x.device) if reduce else part, m, k, n, x.stride(0), piece,
        HAS_BIAS=bias is not None and reduce, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits,
        PRECISION=_precision(x), X_TMA=loads == "tma", STAGES=stages, PARTS=parts, num_warps=warps, REDUCE=reduce,
        **launch)
    return part


def split_for(m: int, n: int, k: int, element_size: int, multiprocessors: int, most: int = 8) -> int:
    """The most shares of K (a power of two, at most ``most``) for which m rows of an n-wide output keep their
    programs within one wave and each share is whole K steps; 1 where fewer than two fit."""
    config = tiles(m, "tma", element_size)
    columns = -(-n // config[1])
    splits = 1
    while (splits * 2 <= most and columns * splits * 2 <= multiprocessors
           and k % (splits * 2 * config[2]) == 0 and k % (splits * 2 * tiles(m, "pointer", element_size)[2]) == 0):
        splits *= 2
    return splits


def _tile_counters(device: torch.device) -> torch.Tensor:
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split_linear's first launch on a device is inside a graph capture; launch it once "
                               "before capturing")
        counters = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counters


def gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
          config: tuple[int, int, int, int, int] | None = None, loads: str | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T), x: (M, K) with few rows, in one launch."""
    m, k = x.shape
    loads = _check_loads(loads or loads_for(x, [gate, up], gate.shape[0]))
    block_m, block_n, block_k, warps, stages = config or tiles(m, loads, x.element_size())
    out = x.new_empty(m, gate.shape[0])
    launch = gdc.launch(x)
    parts, piece = _prefetch_parts([gate, up], block_n, warps) if launch["PDL"] else (0, 0)
    _gated_kernel[(triton.cdiv(gate.shape[0], block_n),)](
        x, _x_descriptor(x, block_m, block_k, loads), gate, up, out, m, k, gate.shape[0], x.stride(0), piece,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(x), X_TMA=loads == "tma",
        STAGES=stages, PARTS=parts, num_warps=warps, **launch)
    return out
