"""Each layer's q/k/v projections in one kernel, and its SwiGLU MLP's gate and up projections with the SiLU and the
product in one, for the engine's captured decode step.

At decode's few rows a projection reads its weight once and does little else: a 0.6B model's layer reads 30 MB
of weights in seven cuBLAS calls of ~5 us each on an H200 (bench/results/h200/speed/decode/base), about four times
what its bytes take, plus a SiLU and a product of two more launches. The weights are the trainer's own tensors, so
they cannot be concatenated into one matrix without a copy; the kernels (``unison.engine.triton_linear``) read them
where they are instead: one launch covers the tiles of the three projections' outputs side by side (``project``),
another computes a tile of gate and of up for the same columns and writes silu(gate) * up (``gated``).

At up to 64 rows o_proj and down_proj (0.6B: 1024-wide outputs, 32 column tiles, a quarter of an H200's
multiprocessors) run as ``split_linear``: K in shares side by side, each tile's last program summing the shares
(``SPLIT_ROWS``, ``split_for``). Inside the engine's fused decoder layers (``unison.engine.fused_layer``) they leave
the shares unsummed instead (``partials``) and the residual add + norm kernel after them sums them: the split kernel
then ends without its fence, counter and last program's sum (0.6B at 64 requests and ~345 keys: 1.74 -> 1.62 ms a
decode step on an H200, bench/results/h200/speed/deferred). Each kernel asks L2 for its weight rows before it waits
for the kernel in front of it (``unison.engine.gdc``).

``fused_projections(model)`` swaps them in for the duration of a ``with`` block (the engine captures its decode
graphs inside it) in the attention and MLP classes whose forward is transformers' (checked from its source), for
plain ``nn.Linear`` projections of one dtype: a LoRA layer, a tensor-parallel shard or any
other module keeps its own forward.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import ExitStack, contextmanager

import torch

from .triton_linear import Partials, gated, multiprocessors, project, split_for, split_linear, split_parts, tiles

MLP_CLASSES = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
_MLP_SOURCE = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"  # checked at switch time
ATTENTION_CLASSES = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "Qwen3MoeAttention"}
_QKV_SOURCE = ("self.q_proj(hidden_states)", "self.k_proj(hidden_states)", "self.v_proj(hidden_states)")
MAX_ROWS = 256
"""Rows (decode requests) up to which the kernels run; more rows take cuBLAS's, whose tiles then pay off. Beyond
ONE_WAVE_ROWS a kernel runs only where its column tiles fit one wave of programs (``_rows``)."""
ONE_WAVE_ROWS = 64
"""Above this many rows a program's pipeline stages fill a multiprocessor's shared memory: a grid of more programs
than multiprocessors runs in two waves, and cuBLAS's tiles were faster (1.7B's 6144-wide gate/up, 192 programs, at
128 rows: 26.3 against 23.2 us a layer; its q/k/v, 128 programs: 13.4 against 19.4 at 256;
bench/results/h200/speed/tma/)."""
DEVICES = {"cuda"}
"""Where the swapped-in forwards run the kernels: in Triton's interpreter (the CPU tests) they cost more than they
save, so the CPU keeps PyTorch's projections unless a test adds "cpu"."""


_PLAIN = (torch.nn.Parameter, torch.Tensor)


def plain_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """``module.weight`` where it is a plain tensor (a Parameter or Tensor of no subclass: not a DTensor, not a
    quantised type), else None. Read from the parameter dict: an eager engine step asks it of every projection,
    and ``Module.__getattr__`` and ``Parameter.data`` were most of its checks' cost (1.2 of the 3.7 ms a step's
    swaps took at 28 layers on a CI core)."""
    weight = module._parameters.get("weight")
    if weight is None:
        weight = module.__dict__.get("weight")  # a plain tensor put in the parameter's place
    return weight if type(weight) in _PLAIN else None


def _plain(linears: list[torch.nn.Module]) -> bool:
    """Plain ``nn.Linear`` layers with contiguous plain-tensor weights (``plain_weight``) of one dtype and input
    width, biased alike."""
    first = biased = None
    for m in linears:
        if type(m) is not torch.nn.Linear:
            return False
        w, b = plain_weight(m), m.bias
        if w is None or not w.is_contiguous():
            return False
        if first is None:
            first, biased = w, b is not None
        elif (w.dtype != first.dtype or w.shape[1] != first.shape[1] or w.device != first.device
              or (b is not None) != biased):
            return False
    return True


def _rows(x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor | None:
    """``x`` as (M, K) rows the kernels take for ``width`` output columns, or None (too many rows, another dtype or
    device, a strided last dim)."""
    rows = x.reshape(-1, x.shape[-1])
    if (rows.shape[0] > MAX_ROWS or rows.stride(-1) != 1 or x.dtype != weight.dtype or x.device != weight.device
            or x.device.type not in DEVICES):
        return None
    if x.is_cuda and not takes(rows.shape[0], width, tiles(rows.shape[0])[1], multiprocessors(x.device)):
        return None
    return rows


def takes(m: int, width: int, tile: int, multiprocessors: int) -> bool:
    """Whether the kernels take m rows of a ``width``-wide output in column tiles of ``tile``: up to ONE_WAVE_ROWS
    rows always, up to MAX_ROWS where the tiles fit one wave."""
    return m <= MAX_ROWS and (m <= ONE_WAVE_ROWS or -(-width // tile) <= multiprocessors)



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
                rows = _rows(x, linear.weight, sum(m.weight.shape[0] for m in self.linears))
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


INTERPRETED_MULTIPROCESSORS = 132
"""The multiprocessors ``split_for`` plans for in Triton's interpreter (the CPU tests): an H200's, so the CPU runs
the shares the GPU would."""
SPLIT_ROWS = 64
"""Rows up to which o_proj and down_proj run as ``split_linear`` (K in shares, so that a 1024-wide output's 32
column tiles fill the GPU, their weights prefetched while the kernel before runs); more rows (not measured), or a
shape without two shares in one wave, take cuBLAS's. A 0.6B decode step at 64 requests on an H200: 1.49-1.50 ms
with cuBLAS's, 1.45-1.46 with these (bench/results/h200/speed/pdl/)."""


def _split_forward(linear: torch.nn.Module):
    plain = torch.nn.Linear.forward.__get__(linear)

    def shares(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        rows = _rows(x, linear.weight, linear.weight.shape[0])
        if rows is None or rows.shape[0] > SPLIT_ROWS:
            return None
        n, k = linear.weight.shape
        sms = multiprocessors(x.device) if x.is_cuda else INTERPRETED_MULTIPROCESSORS
        splits = split_for(rows.shape[0], n, k, x.element_size(), sms)
        return (rows, splits) if splits >= 2 else None

    def forward(x: torch.Tensor) -> torch.Tensor:
        planned = shares(x)
        if planned is None:
            return plain(x)
        rows, splits = planned
        return split_linear(rows, linear.weight, linear.bias, splits).view(*x.shape[:-1], -1)

    def unsummed(x: torch.Tensor) -> Partials | torch.Tensor:
        planned = shares(x)
        if planned is None:
            return plain(x)
        rows, splits = planned
        return split_parts(rows, linear.weight, linear.bias, splits)
    forward.partials = unsummed
    return forward


def partials(module: torch.nn.Module, *args, **kwargs):
    """``module(*args, **kwargs)``, or where its swapped-in forward has a ``partials`` variant, that: o_proj's and
    down_proj's at decode's rows (and the fused attention's and MLP's around them) leave their K shares unsummed, as
    ``Partials``, for a kernel that sums them (``fused_norm.add_rms_norm``): the split kernel then ends without a
    last program's sum. Otherwise (a plain tensor) as the module computes it."""
    deferred = getattr(module.__dict__.get("forward"), "partials", None)
    return (deferred or module)(*args, **kwargs)


def swiglu_mlps(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None) -> list[torch.nn.Module]:
    """The SwiGLU MLPs of known classes in ``model`` (or in ``modules``, its modules listed once) whose forward is
    transformers' (checked from its source) and whose activation is SiLU (the trainer's fused MLPs too:
    ``unison.train.fused``)."""
    return [m for m in (model.modules() if modules is None else modules) if _swiglu_class(type(m))
            and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")]


@functools.cache
def _swiglu_class(cls: type) -> bool:
    return cls.__name__ in MLP_CLASSES and _MLP_SOURCE in inspect.getsource(cls.forward)


@functools.cache
def _qkv_class(cls: type) -> bool:
    return cls.__name__ in ATTENTION_CLASSES and all(s in inspect.getsource(cls.forward) for s in _QKV_SOURCE)


def _gated_forward(mlp: torch.nn.Module, original):
    def forward(x: torch.Tensor, output=None) -> torch.Tensor | Partials:
        rows = _rows(x, mlp.gate_proj.weight, mlp.gate_proj.weight.shape[0])
        if rows is None:
            return original(x)
        hidden = gated(rows, mlp.gate_proj.weight, mlp.up_proj.weight).view(*x.shape[:-1], -1)
        return output(mlp.down_proj, hidden) if output is not None else mlp.down_proj(hidden)
    forward.partials = functools.partial(forward, output=partials)
    return forward


@contextmanager
def fused_projections(model: torch.nn.Module, modules: list[torch.nn.Module] | None = None):
    """Within the block, the q/k/v projections of every known attention class in ``model`` run as one kernel, and
    the gate/up projections and SwiGLU of every known MLP as another, where they are plain ``nn.Linear`` layers.
    ``modules``: ``model``'s modules, listed once by the caller. Yields the number of modules switched."""
    modules = list(model.modules()) if modules is None else modules
    with ExitStack() as stack:
        switched = 0
        for module in modules:
            if _qkv_class(type(module)) and _plain([module.q_proj, module.k_proj, module.v_proj]):
                qkv = _QKV(module)
                for i, proj in enumerate(qkv.linears):
                    swap_forward(stack, proj, qkv.forward_of(i))
                switched += 1
                if _plain([module.o_proj]):
                    swap_forward(stack, module.o_proj, _split_forward(module.o_proj))
        for mlp in swiglu_mlps(model, modules):
            if _plain([mlp.gate_proj, mlp.up_proj]) and mlp.gate_proj.bias is None:
                swap_forward(stack, mlp, _gated_forward(mlp, mlp.forward))
                switched += 1
                if _plain([mlp.down_proj]):
                    swap_forward(stack, mlp.down_proj, _split_forward(mlp.down_proj))
        yield switched


def pack_projections(model: torch.nn.Module) -> int:
    """Lays out each known attention's q/k/v weights (and their biases, Qwen2's), and each SwiGLU MLP's gate/up
    weights, as consecutive rows of one matrix: the parameters stay the same objects with the same values, their data
    now views of one buffer. A projection that shares its input with the others then runs as one GEMM over all of
    them, forward and backward (``joined``; the trainer's ``unison.train.joined`` and ``unison.train.fused_qk``),
    where three (or two) ran. Plain ``nn.Linear`` groups only (a LoRA layer, a tensor-parallel shard keep their own;
    an MLP's only without biases). Call it on the model in its final place, before anything records its weights'
    addresses (the engine, the optimizer). Returns the number of groups laid out."""
    modules = list(model.modules())
    groups = [[m.q_proj, m.k_proj, m.v_proj] for m in modules if _qkv_class(type(m))]
    groups += [[m.gate_proj, m.up_proj] for m in swiglu_mlps(model, modules) if m.gate_proj.bias is None]
    packed = 0
    for linears in groups:
        if not _plain(linears) or joined([m.weight for m in linears]) is not None:
            continue
        for name in ("weight", "bias") if linears[0].bias is not None else ("weight",):
            _lay_out([getattr(m, name) for m in linears])
        packed += 1
    return packed


def _lay_out(tensors: list[torch.Tensor]) -> None:
    """Each tensor's data becomes a view of one new buffer holding them one after another (values kept)."""
    first = tensors[0]
    buffer = torch.empty(sum(t.shape[0] for t in tensors), *first.shape[1:], dtype=first.dtype, device=first.device)
    start = 0
    with torch.no_grad():
        for t in tensors:
            rows = buffer[start:start + t.shape[0]]
            rows.copy_(t)
            t.data = rows
            start += t.shape[0]


def joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The weights (or biases) as one matrix (vector), their rows one after another, no copy, where they lie so in
    one storage (``pack_projections``), else None."""
    first = tensors[0]
    rest, offset, storage = first.shape[1:], first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.shape[1:] != rest or t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != storage):
            return None
        offset += t.numel()
    return first.detach().as_strided((sum(t.shape[0] for t in tensors), *rest), first.stride())


def swap_forward(stack: ExitStack, module: torch.nn.Module, forward) -> None:
    """``module.forward = forward`` until ``stack`` closes, then the module's own forward again. Written to the
    instance's ``__dict__`` directly (where ``nn.Module.__setattr__`` puts a function too): an engine's eager step
    swaps ~200 forwards in and out, and ``__setattr__``'s checks were a few percent of its host time."""
    attrs = module.__dict__
    own = attrs.get("forward")
    attrs["forward"] = forward

    def restore():
        if own is None:
            attrs.pop("forward", None)
        else:
            attrs["forward"] = own
    stack.callback(restore)
