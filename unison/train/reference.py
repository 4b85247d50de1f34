"""The frozen reference policy of the KL term (``loss.beta``): a copy of the initial weights, run through the policy's
own modules.

The copy is a set of frozen tensors, not a second model: for a reference forward they are swapped into the policy's
modules in place of its parameters and swapped back after (the engine is not stepped meanwhile; DESIGN.md: one host
thread). On the device the copy costs the weights' size again. With ``on_host`` (runs that keep the optimizer state
in host memory) it stays in pinned host memory and each decoder layer's tensors are copied to the device just before
that layer runs and dropped after it, so the device holds one layer of it at a time, plus the layers outside the
decoder stack (embeddings, final norm, lm_head). A LoRA policy's reference is its base, the same modules with the
adapters switched off (``AdaptersOffReference``): no copy at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..lora import adapter_params, adapters_disabled, is_lora, read_adapter
from .logprobs import policy_logprobs
from .packing import PackedRow


class ReferenceModel:
    """Frozen copy of ``model``'s parameters now; ``logprobs(row)`` are the reference policy's.

    >>> ref = ReferenceModel(policy, on_host=False)        # doctest: +SKIP
    >>> ref_logp = ref.logprobs(row, temperature=1.0)      # (M,) float32, no gradient  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, on_host: bool = False):
        self.model = model
        self.on_host = on_host
        pin = on_host and torch.cuda.is_available()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            t = p.detach().to("cpu", copy=True) if on_host else p.detach().clone()
            self.tensors[name] = t.pin_memory() if pin else t
        self.layers = decoder_layers(model)
        self._layer_restore: dict[str, list] = {}  # a streamed layer's own parameters while it runs

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.no_grad()
    def logprobs(self, row: PackedRow, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
        """(M,) float32 reference logprobs of ``row``'s targets at its loss positions (``policy_logprobs``'s)."""
        with self._swapped_in():
            logp, _ = policy_logprobs(self.model, row, temperature=temperature, chunk_size=chunk_size)
        return logp

    @contextmanager
    def _swapped_in(self) -> Iterator[None]:
        device = next(self.model.parameters()).device
        streamed = self.layers if self.on_host else []
        in_layers = tuple(prefix + "." for prefix, _ in streamed)
        outside = {n: t.to(device, non_blocking=True) for n, t in self.tensors.items() if not n.startswith(in_layers)}
        restore: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        hooks = []
        try:
            _swap(self.model, outside, restore)
            for prefix, layer in streamed:
                hooks.append(layer.register_forward_pre_hook(self._stream_in(prefix, device)))
                hooks.append(layer.register_forward_hook(self._stream_out(prefix)))
            yield
        finally:
            for h in hooks:
                h.remove()
            for prefix in list(self._layer_restore):
                _put_back(self._layer_restore.pop(prefix))
            _put_back(restore)

    def _stream_in(self, prefix: str, device: torch.device):
        def hook(layer, _args):
            on_device = {n[len(prefix) + 1:]: t.to(device, non_blocking=True) for n, t in self.tensors.items()
                         if n.startswith(prefix + ".")}
            self._layer_restore[prefix] = []
            _swap(layer, on_device, self._layer_restore[prefix])
        return hook

    def _stream_out(self, prefix: str):
        def hook(_layer, _args, _output):
            _put_back(self._layer_restore.pop(prefix))
        return hook


class AdaptersOffReference:
    """The reference of a LoRA policy: its base alone, the adapters switched off for the forward. ``lora_B`` starts
    at zero, so this is exactly the initial policy, also after a resume."""

    nbytes = 0

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def logprobs(self, row: PackedRow, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
        with adapters_disabled(self.model):
            logp, _ = policy_logprobs(self.model, row, temperature=temperature, chunk_size=chunk_size)
        return logp


class InitialAdaptersReference:
    """The reference of a LoRA policy that started from saved adapters (``model.lora.adapter``): the base with those
    adapters, a copy of the adapter tensors alone swapped in for the forward (also after a resume)."""

    def __init__(self, model: torch.nn.Module, folder: str):
        self.model = model
        saved = read_adapter(model, folder)
        self.tensors = {name: saved[name.replace(".default.", ".")].to(p.device, p.dtype)
                        for name, p in adapter_params(model).items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.no_grad()
    def logprobs(self, row: PackedRow, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
        restore: list = []
        try:
            _swap(self.model, self.tensors, restore)
            logp, _ = policy_logprobs(self.model, row, temperature=temperature, chunk_size=chunk_size)
        finally:
            _put_back(restore)
        return logp


def build_reference(model: torch.nn.Module, beta: float, on_host: bool, tensor_parallel: bool,
                    initial: Callable[[], torch.nn.Module] | None = None, adapter: str = ""
                    ) -> ReferenceModel | AdaptersOffReference | InitialAdaptersReference | None:
    """The run's reference (None when ``beta`` is 0): of ``model`` as it is, or of ``initial()``'s model (a resumed
    run's reference is its initial policy, not the checkpoint's weights); a LoRA policy's base, with the adapters it
    started from (``adapter``) where it did not start from zero."""
    if beta == 0:
        return None
    if is_lora(model) and adapter:
        if tensor_parallel:
            raise ValueError("loss.beta > 0 with model.lora.adapter is not supported with dist.tp > 1 yet")
        return InitialAdaptersReference(model, adapter)
    if is_lora(model):
        return AdaptersOffReference(model)
    if tensor_parallel:
        raise ValueError("loss.beta > 0 (a reference model) is not supported with dist.tp > 1 yet: set loss.beta=0 "
                         "or train without tensor parallelism")
    if initial is None:
        return ReferenceModel(model, on_host)
    ref = ReferenceModel(initial(), on_host)
    ref.model = model  # the initial weights, run through the policy's own modules
    ref.layers = decoder_layers(model)
    return ref


def _swap(root: torch.nn.Module, tensors: dict[str, torch.Tensor], restore: list) -> None:
    """Put ``tensors`` (named as in ``root.named_parameters()``) in place of those parameters, tied copies
    included; ``restore`` collects (module, key, parameter) to put back."""
    names = {id(p): n for n, p in root.named_parameters()}  # a tied parameter has one name here
    for module in root.modules():
        for key, param in list(module._parameters.items()):
            t = tensors.get(names.get(id(param), "")) if param is not None else None
            if t is not None:
                restore.append((module, key, param))
                module._parameters[key] = torch.nn.Parameter(t, requires_grad=False)


def _put_back(restore: list) -> None:
    for module, key, param in reversed(restore):
        module._parameters[key] = param


def decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the decoder's layer stack: the largest ModuleList of the model."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    name, layers = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return [(f"{name}.{i}", layer) for i, layer in enumerate(layers)]
