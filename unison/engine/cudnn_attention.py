"""The trainer's packed-row attention through cuDNN's fused SDPA, forward and backward.

Flash varlen (FA2, what torch ships) ran a packed row of 28 samples of 576 tokens at 16 query and 8 KV heads of 128 in
0.29 ms forward and 0.75 ms backward a layer on an H200; cuDNN's SDPA over the same ragged (THD) tensors took 0.15 and
0.51 ms, and 0.18 and 0.60 against 0.33 and 0.96 for 22 samples of 80-1161 tokens
(bench/results/h200/speed/cudnn_attention). torch 2.11's own cuDNN varlen operator rebuilt its graph on every call
(55 ms), so unison builds the graphs with cuDNN's frontend (``pip install 'unison[gpu]'``) and keeps them: one per
dtype, head counts and width, scale, and the row's sequence count and longest sequence each rounded up to a power of
two (a row's sequences past its own count are empty). A forward and a backward graph took ~0.07 s to build.

Within ``packed_rows()`` (``unison.train.logprobs.training_kernels`` enters it with the fused training kernels) a
packed row's causal self-attention (``attention.varlen_causal``) runs here where cuDNN takes the layer: bf16 or fp16
on a GPU of compute capability 8.0 or later, equal query, key and value widths of at most 128 divisible by 8, no
sliding window, sinks or softcap, token offsets within int32. Anything else, or a graph cuDNN refuses (said once),
runs flash as before. Outputs and gradients agree with flash's to bf16 rounding, not bit for bit; the backward is
cuDNN's deterministic one where ``torch.use_deterministic_algorithms`` is on.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

_active = 0
_refused: set[tuple] = set()
_graphs: dict[tuple, tuple] = {}
_last_row: list = [None, None]  # the cumulative lengths tensor and its _Row: every layer of a row passes the same one


@contextmanager
def packed_rows():
    """Within the block, packed rows' causal attention runs through cuDNN where it can (module docstring)."""
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


@functools.cache
def frontend():
    """cuDNN's frontend module, or None where it is not installed or finds no cuDNN library."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    return cudnn


def runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
         softcap: float | None) -> bool:
    """Whether ``causal`` may take this layer now (it may still refuse: None): inside ``packed_rows()``, on a GPU
    with cuDNN's frontend, a layer ``takes`` describes."""
    return (_active > 0 and q.is_cuda and takes(q, k, v, window, sinks, softcap) and frontend() is not None
            and _capable(q.device.index))


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
          softcap: float | None) -> bool:
    """Whether the layer is one cuDNN's graphs here compute: bf16/fp16, one width <= 128 divisible by 8 for q, k and
    v, whole query groups per KV head, no window, sinks or softcap, token offsets within int32."""
    width = q.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype and window is None
            and sinks is None and softcap is None and k.shape[-1] == v.shape[-1] == width and width % 8 == 0
            and width <= 128 and q.shape[1] % k.shape[1] == 0 and q.shape[0] * q.shape[1] * width < 2**31)


def buckets(sequences: int, longest: int) -> tuple[int, int]:
    """The graph's (sequences, longest sequence) for a row: each a power of two, at least 8 and 128."""
    return max(8, 1 << max(sequences - 1, 0).bit_length()), max(128, 1 << max(longest - 1, 0).bit_length())


@dataclass
class _Row:
    sequences: int  # the graph's, the row's own plus empty ones
    longest: int  # the graph's
    tokens: int  # the backward graph's bound on the row's tokens (workspace)
    lengths: torch.Tensor  # (sequences, 1, 1, 1) int32
    starts: torch.Tensor  # (sequences + 1, 1, 1, 1) int32: cumulative token counts
    packs: dict = field(default_factory=dict)  # graph key -> its variant pack's lengths and ragged offsets


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
           scale: float) -> torch.Tensor | None:
    """Causal attention within each segment of a packed row, differentiable w.r.t. q, k, v: ``varlen_causal``'s
    function. q: (T, H, D); k, v: (T, KVH, D); cu_seqlens: (S+1,) int32. Returns (T, H, D), or None where cuDNN
    refused the graph (flash then). Check ``runs`` first."""
    row = _row(cu_seqlens, max_len, q.shape[0])
    deterministic = torch.are_deterministic_algorithms_enabled()
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    shape = (q.device.index, q.dtype, q.shape[1], k.shape[1], q.shape[-1], float(scale), row.sequences, row.longest)
    keys = [("fwd", *shape)] + ([("bwd", *shape, row.tokens, deterministic)] if wants_grad else [])
    if not all(_graph(key) for key in keys):
        return None
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    if wants_grad:
        return _Causal.apply(q, k, v, row, keys[0], keys[1])
    return _forward(q, k, v, row, keys[0])[0]


class _Causal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, row, fwd_key, bwd_key):
        out, stats = _forward(q, k, v, row, fwd_key)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.row, ctx.key = row, bwd_key
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, stats = ctx.saved_tensors
        row = ctx.row
        graph, t = _graphs[ctx.key]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _execute(graph, q.device, {
            t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: out, t["do"]: grad.contiguous(), t["stats"]: stats,
            t["dq"]: dq, t["dk"]: dk, t["dv"]: dv, **_offsets(t, row, ctx.key)})
        return dq, dk, dv, None, None, None


def _forward(q, k, v, row: _Row, key) -> tuple[torch.Tensor, torch.Tensor]:
    graph, t = _graphs[key]
    out = torch.empty_like(q)
    stats = torch.empty(row.sequences, q.shape[1], row.longest, 1, dtype=torch.float32, device=q.device)
    _execute(graph, q.device, {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: out, t["stats"]: stats,
                               **_offsets(t, row, key)})
    return out, stats


def _offsets(t: dict, row: _Row, key: tuple) -> dict:
    """The variant pack's lengths and ragged offsets (in elements: token start x heads x width), once per row and
    graph."""
    pack = row.packs.get(key)
    if pack is None:
        heads, kv_heads, width = key[3:6]
        q_start, kv_start = row.starts * (heads * width), row.starts * (kv_heads * width)
        pack = {t["lengths_q"]: row.lengths, t["lengths_kv"]: row.lengths}
        for name in t:
            if name.endswith("_start"):
                pack[t[name]] = kv_start if name[:-6] in ("k", "v", "dk", "dv") else q_start
        row.packs[key] = pack
    return pack


def _execute(graph: tuple, device: torch.device, pack: dict) -> None:
    """Runs a (graph, workspace bytes) on the device's current stream."""
    cudnn = frontend()
    handle = _handle(device.index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    graph, size = graph
    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    graph.execute(pack, workspace, handle=handle)


@functools.cache
def _handle(index: int):
    with torch.cuda.device(index):
        return frontend().create_handle()


def _row(cu_seqlens: torch.Tensor, max_len: int, tokens: int) -> _Row:
    """The row's lengths and starts, padded to the graph's sequence count (computed once for all its layers)."""
    held, row = _last_row
    if held is cu_seqlens and row is not None:
        return row
    n = cu_seqlens.numel() - 1
    sequences, longest = buckets(n, max(max_len, 1))
    cu = cu_seqlens.to(torch.int32)
    starts = torch.cat([cu, cu[-1:].expand(sequences - n)])
    row = _Row(sequences, longest, 1 << max(tokens - 1, 0).bit_length(), (starts[1:] - starts[:-1]).view(-1, 1, 1, 1),
               starts.view(-1, 1, 1, 1))
    _last_row[:] = [cu_seqlens, row]
    return row


def _graph(key: tuple) -> bool:
    """Builds the key's graph unless held; False (and said once) where cuDNN refuses it."""
    if key in _graphs:
        return True
    if key in _refused:
        return False
    try:
        with torch.cuda.device(key[1]):
            _graphs[key] = _build(key)
        return True
    except Exception as e:  # cuDNN's refusals come as several exception types (unsupported, validation, build)
        _refused.add(key)
        warnings.warn(f"cuDNN attention refused {key[0]} graph {key[2:]}: {type(e).__name__}: {e}; flash attention "
                      f"runs these rows", stacklevel=3)
        return False


def _build(key: tuple):
    cudnn = frontend()
    kind, _, dtype, heads, kv_heads, width, scale, sequences, longest = key[:9]
    io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
    f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_handle(key[1]))
    t: dict = {}

    def ragged(name: str, count: int, tensor=None):
        """(sequences, heads, longest, width) over a (tokens, heads, width) buffer, each sequence at its offset."""
        dims, strides = [sequences, count, longest, width], [longest * count * width, width, count * width, 1]
        if tensor is None:
            tensor = graph.tensor(name=name, dim=dims, stride=strides, data_type=io)
        else:
            tensor.set_output(True).set_dim(dims).set_stride(strides)
        t[name + "_start"] = graph.tensor(name=name + "_start", dim=[sequences + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                          data_type=i32)
        tensor.set_ragged_offset(t[name + "_start"])
        t[name] = tensor
        return tensor

    for name in ("lengths_q", "lengths_kv"):
        t[name] = graph.tensor(name=name, dim=[sequences, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    q, k, v = ragged("q", heads), ragged("k", kv_heads), ragged("v", kv_heads)
    mask = dict(attn_scale=scale, use_padding_mask=True, seq_len_q=t["lengths_q"], seq_len_kv=t["lengths_kv"],
                diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    stats_dims = dict(dim=[sequences, heads, longest, 1], stride=[heads * longest, longest, 1, 1])
    if kind == "fwd":
        out, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **mask)
        ragged("o", heads, out)
        stats.set_output(True).set_data_type(f32).set_dim(stats_dims["dim"]).set_stride(stats_dims["stride"])
        t["stats"] = stats
    else:
        tokens, deterministic = key[9], key[10]
        out, grad = ragged("o", heads), ragged("do", heads)
        t["stats"] = graph.tensor(name="stats", data_type=f32, **stats_dims)
        dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=out, dO=grad, stats=t["stats"],
                                         max_total_seq_len_q=tokens, max_total_seq_len_kv=tokens,
                                         use_deterministic_algorithm=deterministic, **mask)
        ragged("dq", heads, dq), ragged("dk", kv_heads, dk), ragged("dv", kv_heads, dv)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return (graph, graph.get_workspace_size()), t
