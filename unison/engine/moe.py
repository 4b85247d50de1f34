"""Mixture-of-experts experts on unison's Triton kernels (``triton_moe``): which modules, and the switch to them.

transformers dispatches each experts module (``@use_experts_implementation``) to the function its config names
(``grouped_mm`` by default, differentiable). ``EngineConfig.moe_kernel="triton"`` runs
the engine's forwards (prefill chunks and the captured decode step) inside ``experts_kernels(modules)``, which
points each supported experts module's ``forward`` at ``triton_moe.fused_experts`` for the ``with`` block only,
as ``fused_norms`` does for RMSNorm: a training forward never sees it, and a CUDA graph captured inside it replays
the kernels. A module falls back to its own dispatch (the model's experts implementation) on the CPU and whenever
autograd would need the result, so the CPU engine stays exact against eager. The training forward keeps the
model's own path: ``unison.train.fused_experts`` holds the kernels' backward, exact, but slower than grouped_mm's
at training shapes on the H200 (bench/results/h200/moe_train), so nothing enters it by default.

Supported, exactly two layouts of transformers 5.24 and 5.25: the one most MoE classes share (Qwen2-MoE, Qwen3-MoE,
Mixtral, GLM4-MoE, DeepSeek-V2/V3 and the others with the default flags): gate and up concatenated in
``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), no bias, the default gate with SiLU; and GptOss's:
``gate_up_proj`` (E, H, 2I) transposed with gate and up interleaved, ``down_proj`` (E, I, H), both biased,
``GptOssExperts._apply_gate`` (its clamped SwiGLU). Neither with a post-expert norm or expert parallelism. Any
other layout or gate (a default-gate module with biases, a GptOss subclass with its own gate) keeps transformers'
path.

"unison" is also registered in transformers' ``ALL_EXPERTS_FUNCTIONS``, for a model loaded with
``experts_implementation="unison"``; there the fallback is ``grouped_mm``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate, grouped_mm_experts_forward
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

EXPERTS_NAME = "unison"
_DEFAULT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
            "has_post_expert_norm": False, "_is_expert_parallel": False}
_GPT_OSS = {**_DEFAULT, "is_concatenated": False, "is_transposed": True, "has_bias": True}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_experts_module(module: torch.nn.Module) -> bool:
    """A module whose class transformers' ``@use_experts_implementation`` decorated."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(type(module), "_apply_gate")


def unsupported(module: torch.nn.Module) -> str | None:
    """Why the Triton kernels cannot compute ``module`` exactly as transformers does; None when they can."""
    name = type(module).__name__
    flags = {flag: getattr(module, flag, None) for flag in _DEFAULT}
    # the nearer of the two layouts names what differs
    want = min((_DEFAULT, _GPT_OSS), key=lambda layout: sum(flags[f] != v for f, v in layout.items()))
    for flag, value in want.items():
        if flags[flag] != value:
            return f"{name}.{flag} is {flags[flag]!r} (the kernels take {value!r} with {_layout_name(want)})"
    if want is _GPT_OSS:
        if type(module)._apply_gate is not GptOssExperts._apply_gate:
            return f"{name} has GptOss's layout but its own _apply_gate, not GptOssExperts'"
        for attr in ("alpha", "limit"):
            if not isinstance(getattr(module, attr, None), (int, float)):
                return f"{name}.{attr} is {getattr(module, attr, None)!r}, not a number"
    else:
        if type(module)._apply_gate is not _default_apply_gate:
            return f"{name} has its own _apply_gate"
        if not isinstance(getattr(module, "act_fn", None), (SiLUActivation, torch.nn.SiLU)):
            return f"{name}.act_fn is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    return _weights_unsupported(module, name, transposed=want is _GPT_OSS)


def _layout_name(layout: dict) -> str:
    return "GptOss's layout" if layout is _GPT_OSS else "the default layout"


def _weights_unsupported(module: torch.nn.Module, name: str, transposed: bool) -> str | None:
    names = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if transposed else ())
    tensors = [getattr(module, n, None) for n in names]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return f"{name} has no {' / '.join(names)} tensors"
    if any(type(t.data) is not torch.Tensor for t in tensors):
        return f"{name}'s weights are not plain tensors (sharded or quantized)"
    gate_up, down = tensors[:2]
    shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True))
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"{name}: {shapes} are not 3-D expert weights"
    experts, two_i, hidden = (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1]) if transposed else gate_up.shape
    want = ((experts, hidden, two_i), (experts, two_i // 2, hidden), (experts, two_i), (experts, hidden)) \
        if transposed else ((experts, two_i, hidden), (experts, hidden, two_i // 2))
    if two_i % 2 or any(tuple(t.shape) != w for t, w in zip(tensors, want, strict=True)):
        return f"{name}: {shapes} are not {', '.join(str(w) for w in want)} (E={experts}, H={hidden}, 2I={two_i})"
    if gate_up.dtype not in _DTYPES or any(t.dtype != gate_up.dtype for t in tensors):
        return f"{name}'s weights are {' / '.join(str(t.dtype) for t in tensors)}"
    return None


DEVICES = {"cuda"}  # where the switched modules take the kernels (the CPU tests add "cpu": Triton's interpreter)


def kernels_apply(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """This call can take the kernels: CUDA, and nothing that autograd would have to differentiate."""
    return hidden_states.device.type in DEVICES and not needs_grad(module, hidden_states)


def needs_grad(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """Autograd records this call (a training forward): the kernels have no backward."""
    return torch.is_grad_enabled() and (hidden_states.requires_grad or any(
        p.requires_grad for p in module.parameters(recurse=False)))


def module_layout(module: torch.nn.Module):
    """(``triton_moe.ExpertsLayout``, gate_up bias, down bias) of an experts module one ``unsupported`` passes."""
    from .triton_moe import ExpertsLayout
    if not module.has_bias:  # the default layout (``unsupported`` admits these two only)
        return ExpertsLayout(), None, None
    layout = ExpertsLayout(transposed=True, interleaved=True, gate="gptoss", alpha=float(module.alpha),
                           limit=float(module.limit))
    return layout, module.gate_up_proj_bias, module.down_proj_bias


def kernels_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, sizes=None) -> torch.Tensor:
    """``module`` (one ``unsupported`` passes) on the kernels: ``triton_moe.fused_experts`` in its layout, with
    ``sizes`` (``triton_moe.BlockSizes``) or the shape's default blocks."""
    from .triton_moe import fused_experts
    layout, gate_up_bias, down_bias = module_layout(module)
    return fused_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, sizes,
                         gate_up_bias=gate_up_bias, down_bias=down_bias, layout=layout)


def unison_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered "unison" experts function: the kernels where they apply, else transformers' grouped_mm.
    hidden_states: (T, H); top_k_index: (T, K) int; top_k_weights: (T, K). Returns (T, H)."""
    if unsupported(self) is None and kernels_apply(self, hidden_states):
        return kernels_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, unison_experts_forward)


def kernel_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of ``model`` the kernels compute exactly (``unsupported`` says why the others not)."""
    return [m for m in model.modules() if is_experts_module(m) and unsupported(m) is None]


@contextmanager
def experts_kernels(modules: list[torch.nn.Module], forward=None) -> Iterator[int]:
    """Within the block, each of ``modules`` (from ``kernel_modules``) runs the kernels where they apply and its
    own forward (the model's experts implementation) elsewhere. ``forward`` (module, hidden_states, top_k_index,
    top_k_weights) replaces ``kernels_forward``: the trainer's differentiable one
    (``unison.train.fused_experts.module_forward``) applies on CUDA whether or not autograd records the call.
    Blocks nest: a module already switched is left as it is. Yields how many modules it switched."""
    patched = []
    for module in modules:
        if getattr(module.__dict__.get("forward"), _SWITCHED, False):
            continue
        patched.append((module, module.__dict__.get("forward")))
        module.forward = _scoped_forward(module, module.forward, forward)
    try:
        yield len(patched)
    finally:
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own


_SWITCHED = "_unison_experts_kernels"


def _scoped_forward(module: torch.nn.Module, original, kernels=None):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        if not args and not kwargs:
            if kernels is None and kernels_apply(module, hidden_states):
                return kernels_forward(module, hidden_states, top_k_index, top_k_weights)
            if kernels is not None and hidden_states.device.type in DEVICES:
                return kernels(module, hidden_states, top_k_index, top_k_weights)
        return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)  # a call the kernels do not know
    setattr(forward, _SWITCHED, True)
    return forward


class WithExpertsKernels:
    """The engine's forward context (``local``: tensor parallelism's or a plain one) with ``experts_kernels``."""

    def __init__(self, local, modules: list[torch.nn.Module]):
        self.local, self.modules = local, modules
        self.heartbeat = getattr(local, "heartbeat", None)

    @contextmanager
    def __call__(self, train: bool = False) -> Iterator[int]:
        with self.local(train=train) as value, experts_kernels(self.modules):
            yield value
