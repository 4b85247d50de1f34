"""Sample boundaries for the conv, recurrent and state-space layers of hybrid models in packed forwards.

transformers' hybrid layers (Qwen3Next and Qwen3.5 gated delta-nets, Lfm2's short conv, FalconH1's Mamba2, and the
families generated from them) call their sequence kernels as module-level functions of their modeling module, under
the names transformers' kernel hub resolves (``use_kernel_func_from_hub_with_fallback``): ``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ``mamba2_split_conv1d_scan_combined``. Since 5.25 the conv
and the scan are reached through helpers around transformers' cache (``causal_conv1d_forward``,
``mamba2_scan_forward``) that call the same names by module lookup, and where the ``kernels`` package is active (5.25
requires it) each name holds a ``kernels`` function module rather than the function (``hub_function`` reads both). A
packed forward's ``cu_seq_lens_q`` reaches them in the layer's kwargs, and none of their PyTorch bodies keeps samples
apart: the gated delta rule refuses the boundaries (``unison train`` stopped at startup), Lfm2's conv ran ~2 tokens
across samples, FalconH1's conv and scan carried state across them. Dao's ``causal_conv1d`` kernel would not see them
either (transformers passes no ``seq_idx``).

``keep_samples_apart(model)`` replaces each of these names in the modeling modules ``model`` is built from by a
function that, given boundaries, computes each sample alone and exactly, and otherwise calls the original unchanged
(the engine's and plain forwards are untouched):

- the causal conv: one conv over the row with ``kernel - 1`` zeros before every sample, what each sample's own
  left padding gives it;
- the gated delta rule: on the GPU, flash-linear-attention's kernel with ``cu_seqlens`` where transformers found
  it (the ``unison[hybrid]`` extra), else transformers' own PyTorch body once per sample;
- the Mamba2 scan: on the GPU, mamba_ssm's kernel with ``seq_idx`` where installed, else transformers' PyTorch
  body once per sample; the fused conv + scan kernel declines packed rows, so the mixer takes its unfused conv and scan.

Only functions whose signature is the one written against here are replaced; anything else stays, and
``unison.train.leak.check_packed_attention`` refuses the model if it leaks.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

log = logging.getLogger(__name__)

# The packed-forward kwargs transformers hands the layers (unison.train.logprobs.policy_logprobs passes them).
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def keep_samples_apart(model: torch.nn.Module) -> list[str]:
    """Install the boundary-keeping functions in every modeling module ``model``'s layers come from (idempotent).

    Returns the replaced names as ``"module.function"``, sorted: empty for a model with no such layers."""
    replaced = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        for name, make in _REPLACEMENTS.items():
            original = getattr(module, name, None)
            if original is None or not callable(original):
                continue
            if not getattr(original, "_unison_keeps_samples_apart", False):
                fn = hub_function(original)
                if fn is None or tuple(inspect.signature(inspect.unwrap(fn)).parameters)[:len(_SIGNATURES[name])] \
                        != _SIGNATURES[name]:
                    continue
                replacement = make(original, module)
                replacement._unison_keeps_samples_apart = True
                setattr(module, name, replacement)
            replaced.append(f"{module_name}.{name}")
    return replaced


def hub_function(obj) -> Callable | None:
    """The Python function a modeling module holds under a kernel-hub name, or None for anything else.

    Without the ``kernels`` package, or beside a version transformers does not take (5.24 takes 0.18.2 <= v < 0.19),
    that is the name's value itself. With it (5.25 requires it), ``kernels.use_kernel_forward_from_hub`` turns the
    function into the instance of an ``nn.Module`` class ``Func`` whose forward calls it (or, inside a layer that
    ``kernelize`` prepared, that layer's kernel): the function is the forward's closure cell ``func``."""
    if inspect.isfunction(obj):
        return obj
    forward = getattr(type(obj), "forward", None)
    if not (isinstance(obj, torch.nn.Module) and hasattr(obj, "kernel_layer_name") and inspect.isfunction(forward)):
        return None
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
    fn = cells["func"].cell_contents if "func" in cells else None
    return fn if inspect.isfunction(fn) else None


def pytorch_body(value) -> Callable | None:
    """transformers' own PyTorch body behind a hub name's value, whatever the name resolved to: through unison's
    replacement, a ``kernels`` function module and transformers' kernel fallback (``__wrapped__``)."""
    fn = hub_function(inspect.unwrap(value))
    return None if fn is None else inspect.unwrap(fn)


def _wraps(original) -> Callable:
    """``functools.wraps`` for a hub name's value: the function's name and docstring, ``__wrapped__`` the value
    itself (a ``kernels`` function module too), so putting ``__wrapped__`` back restores transformers' own."""
    def decorate(replacement: Callable) -> Callable:
        functools.update_wrapper(replacement, hub_function(original))
        replacement.__wrapped__ = original
        return replacement

    return decorate


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens: (S+1,) int32, ``[0, ..., total]``. Returns (total,) int64: the segment of every position."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def segment_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv within each segment. x: (1, C, T); weight: (C, K); bias: (C,) or None; cu_seqlens:
    (S+1,) int32 with ``cu_seqlens[-1] == T``. Returns (1, C, T) in weight's dtype, before any activation.

    Every segment is preceded by K - 1 zeros in one longer row, so each output window sees its own segment and
    zeros only: what a conv of that segment alone, zero-padded on the left, computes."""
    _, channels, total = x.shape
    gap = weight.shape[-1] - 1
    segments = len(cu_seqlens) - 1
    dest = torch.arange(total, device=x.device) + gap * (segment_ids(cu_seqlens, total) + 1)
    spaced = x.new_zeros(1, channels, total + gap * segments, dtype=weight.dtype)
    spaced = spaced.index_copy(2, dest, x.to(weight.dtype))
    out = F.conv1d(spaced, weight.unsqueeze(1), bias, groups=channels)  # output j ends at input j + gap
    return out.index_select(2, dest - gap)


def _packed_boundaries(kwargs: dict, key: str = "cu_seq_lens_q") -> torch.Tensor | None:
    cu = kwargs.get(key)
    return cu if isinstance(cu, torch.Tensor) else None


def _without_packed(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in PACKED_KWARGS and k not in ("cu_seqlens", "seq_idx")}


def _check_row(name: str, x: torch.Tensor, seq_dim: int, cu: torch.Tensor) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"{name}: a packed row is batch 1, got batch {x.shape[0]}")
    if x.shape[seq_dim] != int(cu[-1]):
        raise ValueError(f"{name}: the row has {x.shape[seq_dim]} tokens but cu_seqlens ends at {int(cu[-1])}")


def _kernel_in_use(fn: Callable) -> bool:
    """Whether transformers resolved the hub function ``fn`` (``hub_function``'s) to a kernel package
    (flash-linear-attention, mamba_ssm) rather than its own PyTorch body. A wrapper of another shape counts as
    PyTorch: the per-sample path is exact either way."""
    if not fn.__closure__:
        return False
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__, strict=True))
    if "implementation" not in cells:
        return False
    return cells["implementation"].cell_contents is not getattr(fn, "__wrapped__", None)


def _engine_states(kwargs: dict):
    """An engine forward's per-request states (``unison.engine.state.StepStates``) and the calling layer, or None."""
    paged = kwargs.get("paged")
    states = getattr(paged, "states", None)
    if states is None:
        return None
    if "state_layer" not in kwargs:
        raise RuntimeError("an engine forward reached a sequence layer whose index it was not told "
                           "(unison.engine.state.install was not run on this model)")
    return states, kwargs["state_layer"]


def _conv(original: Callable, module) -> Callable:
    @_wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        engine = _engine_states(kwargs)
        if engine is not None:
            states, layer = engine
            return states.conv(layer, hidden_states, weight, bias, activation)
        cu = _packed_boundaries(kwargs)
        if cu is None:
            return original(hidden_states, weight, bias, activation, **kwargs)
        _check_row("causal_conv1d_fn", hidden_states, 2, cu)
        out = segment_causal_conv1d(hidden_states, weight, bias, cu)
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)

    return causal_conv1d_fn


def _gated_delta_rule(original: Callable, module) -> Callable:
    kernel = _kernel_in_use(hub_function(original))
    body = pytorch_body(original)

    @_wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
        engine = _engine_states(kwargs)
        if engine is not None:
            states, layer = engine
            recurrent = module.torch_recurrent_gated_delta_rule  # the one-token form, as resolved
            return states.gated_delta(layer, query, key, value, g, beta, chunk_size, use_qk_l2norm_in_kernel,
                                      original if kernel and query.is_cuda else body, recurrent, kernel)
        # flash-linear-attention takes cu_seqlens itself, unless its backward would refuse this GPU's Triton.
        fla = kernel and query.is_cuda and not (torch.is_grad_enabled() and fla_backward_refused())
        if cu_seqlens is None or fla:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        _check_row("chunk_gated_delta_rule", query, 1, cu_seqlens)
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            out, final = body(
                query[:, start:end], key[:, start:end], value[:, start:end], g=g[:, start:end],
                beta=beta[:, start:end], chunk_size=chunk_size,
                initial_state=None if initial_state is None else initial_state[i:i + 1],
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **_without_packed(kwargs))
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, 1), (torch.cat(finals, 0) if output_final_state else None)

    return torch_chunk_gated_delta_rule


@functools.cache
def fla_backward_refused() -> bool:
    """Whether flash-linear-attention's gated chunk backward refuses to run here: on Hopper GPUs with Triton 3.4 to
    3.7.0 (wrong gradients, its issue #640) unless tilelang is installed. Packed training then takes transformers'
    PyTorch body per sample (exact, slower; measured on one H200 with Triton 3.6); forwards keep the kernels."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # not installed, or a version without the check
        return False
    refused = IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 \
        and importlib.util.find_spec("tilelang") is None
    if refused:
        log.warning("flash-linear-attention refuses its gated delta-rule backward with this Triton on Hopper (its "
                    "issue #640): packed training runs transformers' PyTorch body per sample instead; Triton >= 3.7.1 "
                    "or `pip install tilelang` gives the kernels back")
    return refused


def _mamba2_scan(original: Callable, module) -> Callable:
    kernel = _kernel_in_use(hub_function(original))
    body = pytorch_body(original)

    @_wraps(original)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs):
        engine = _engine_states(kwargs)
        if engine is not None:
            if args:
                raise ValueError("mamba2_chunk_scan: unison's engine takes its optional arguments by name")
            states, layer = engine
            rest = {k: v for k, v in _without_packed(kwargs).items()
                    if k not in ("paged", "state_layer", "initial_states", "return_final_states")}
            return states.mamba2(layer, hidden_states, dt, A, B, C, chunk_size, body, **rest)
        cu = _packed_boundaries(kwargs)
        if cu is None:
            return original(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)
        _check_row("mamba2_chunk_scan", hidden_states, 1, cu)
        rest = _without_packed(kwargs)
        if args or rest.get("initial_states") is not None or rest.get("return_final_states"):
            raise ValueError("mamba2_chunk_scan: a packed row carries no state in or out, and takes its optional "
                             "arguments by name")
        if kernel and hidden_states.is_cuda:  # mamba_ssm's scan restarts at every change of seq_idx
            seq_idx = segment_ids(cu, hidden_states.shape[1]).to(torch.int32)[None]
            return original(hidden_states, dt, A, B, C, chunk_size, seq_idx=seq_idx, **rest)
        bounds = cu.tolist()
        return torch.cat([body(hidden_states[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], chunk_size, **rest)
                          for s, e in zip(bounds[:-1], bounds[1:], strict=True)], 1)

    return mamba2_chunk_scan


def _mamba2_fused(original: Callable, module) -> Callable:
    @_wraps(original)
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        if _packed_boundaries(kwargs) is not None or _engine_states(kwargs) is not None:
            return None  # the mixer then runs its unfused conv and scan, which keep the samples apart
        return original(*args, **kwargs)

    return mamba2_split_conv1d_scan_combined


# Each takes transformers' function and the modeling module it is found in.
_REPLACEMENTS: dict[str, Callable[[Callable, object], Callable]] = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _gated_delta_rule,
    "mamba2_chunk_scan": _mamba2_scan,
    "mamba2_split_conv1d_scan_combined": _mamba2_fused,
}
# The leading parameters of transformers' PyTorch bodies these replacements are written against.
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "causal_conv1d_fn": ("hidden_states", "weight", "bias", "activation"),
    "torch_chunk_gated_delta_rule": ("query", "key", "value", "g", "beta", "chunk_size", "initial_state",
                                     "output_final_state", "use_qk_l2norm_in_kernel"),
    "mamba2_chunk_scan": ("hidden_states", "dt", "A", "B", "C", "chunk_size"),
    "mamba2_split_conv1d_scan_combined": ("zxbcdt", "conv1d_weight", "conv1d_bias"),
}
