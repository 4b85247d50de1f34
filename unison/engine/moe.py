"""The engine's mixture-of-experts experts on unison's Triton kernels (``triton_moe``), training on transformers'.

transformers dispatches each experts module (``@use_experts_implementation``) to the function its config names;
the default ``grouped_mm`` is differentiable, and the trainer keeps it. ``EngineConfig.moe_kernel="triton"`` runs
the engine's forwards (prefill chunks and the captured decode step) inside ``experts_kernels(modules)``, which
points each supported experts module's ``forward`` at ``triton_moe.fused_experts`` for the ``with`` block only,
as ``fused_norms`` does for RMSNorm: a training forward never sees it, and a CUDA graph captured inside it replays
the kernels. A module falls back to its own dispatch (the model's experts implementation) on the CPU and whenever
autograd would need the result, so the CPU engine stays exact against eager.

Supported: the layout most MoE classes of transformers 5.24 share (Qwen2-MoE, Qwen3-MoE, Mixtral, GLM4-MoE,
DeepSeek-V2/V3 and the others with the default flags): gate and up concatenated in ``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I), no bias, no post-expert norm, the default gate with SiLU, no expert parallelism. GptOss
(interleaved, transposed, biased, clamped gate) and any other layout keep transformers' path.

"unison" is also registered in transformers' ``ALL_EXPERTS_FUNCTIONS``, for a model loaded with
``experts_implementation="unison"``; there the fallback is ``grouped_mm``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate, grouped_mm_experts_forward

EXPERTS_NAME = "unison"
_FLAGS = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
          "has_post_expert_norm": False, "_is_expert_parallel": False}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_experts_module(module: torch.nn.Module) -> bool:
    """A module whose class transformers' ``@use_experts_implementation`` decorated."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(type(module), "_apply_gate")


def unsupported(module: torch.nn.Module) -> str | None:
    """Why the Triton kernels cannot compute ``module`` exactly as transformers does; None when they can."""
    name = type(module).__name__
    for flag, want in _FLAGS.items():
        if getattr(module, flag, None) != want:
            return f"{name}.{flag} is {getattr(module, flag, None)!r} (the kernels take {want!r})"
    if type(module)._apply_gate is not _default_apply_gate:
        return f"{name} has its own _apply_gate"
    if not isinstance(getattr(module, "act_fn", None), (SiLUActivation, torch.nn.SiLU)):
        return f"{name}.act_fn is {type(getattr(module, 'act_fn', None)).__name__}, not SiLU"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return f"{name} has no gate_up_proj / down_proj tensors"
    if type(gate_up.data) is not torch.Tensor or type(down.data) is not torch.Tensor:
        return f"{name}'s weights are {type(gate_up.data).__name__} (sharded or quantized), not plain tensors"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 or down.shape != (
            gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        return (f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                "(E, 2I, H) and (E, H, I)")
    if gate_up.dtype not in _DTYPES or down.dtype != gate_up.dtype:
        return f"{name}'s weights are {gate_up.dtype} / {down.dtype}"
    return None


def kernels_apply(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """This call can take the kernels: CUDA, and nothing that autograd would have to differentiate."""
    return hidden_states.is_cuda and not needs_grad(module, hidden_states)


def needs_grad(module: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """Autograd records this call (a training forward): the kernels have no backward."""
    return torch.is_grad_enabled() and (hidden_states.requires_grad or module.gate_up_proj.requires_grad
                                        or module.down_proj.requires_grad)


def _kernels_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    from .triton_moe import fused_experts
    return fused_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)


def unison_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered "unison" experts function: the kernels where they apply, else transformers' grouped_mm.
    hidden_states: (T, H); top_k_index: (T, K) int; top_k_weights: (T, K). Returns (T, H)."""
    if unsupported(self) is None and kernels_apply(self, hidden_states):
        return _kernels_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, unison_experts_forward)


def kernel_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of ``model`` the kernels compute exactly (``unsupported`` says why the others not)."""
    return [m for m in model.modules() if is_experts_module(m) and unsupported(m) is None]


@contextmanager
def experts_kernels(modules: list[torch.nn.Module]) -> Iterator[int]:
    """Within the block, each of ``modules`` (from ``kernel_modules``) runs the kernels where they apply and its
    own forward (the model's experts implementation) elsewhere. Yields how many modules it switched."""
    patched = []
    for module in modules:
        patched.append((module, module.__dict__.get("forward")))
        module.forward = _scoped_forward(module, module.forward)
    try:
        yield len(patched)
    finally:
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _scoped_forward(module: torch.nn.Module, original):
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        if not args and not kwargs and kernels_apply(module, hidden_states):
            return _kernels_forward(module, hidden_states, top_k_index, top_k_weights)
        return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)  # a call the kernels do not know
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
