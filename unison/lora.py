"""LoRA adapters through PEFT, injected into the policy in place: the engine and the trainer run the same modules.

``model.lora.r > 0`` wraps the target linear layers with PEFT's ``lora.Linear`` (the base weight frozen, ``lora_A``
and ``lora_B`` trainable, in the model's dtype). Nothing is merged: the engine decodes through base + adapters, from
the very adapter tensors the optimizer writes back into (CUDA graphs included: PEFT's forward is plain tensor work),
so every unison part that works on "the trainable parameters" (the optimizer's fp32 state, the changed masks, the
sparse sync and its anchors, the memory plan) covers the adapters alone. The reference policy of the KL term is the
same model with its adapters switched off: ``lora_B`` starts at zero, so that is exactly the initial policy.

Under tensor parallelism (``dist.tp > 1``) the adapters are built on the whole layers and then sharded like their
base (``shard_adapters``): ``lora_B`` column-wise on a column-wise projection, ``lora_A`` row-wise on a row-wise one,
the other replicated. ``LocalForward`` runs the sharded ones on their local shards like any sharded projection, so
the adapter's output is split as its base's is; the engine stays unmerged there (``engine_merges``).

Checkpoints hold the adapters in PEFT's own format (``adapter_model.safetensors`` and ``adapter_config.json``, what
``PeftModel.from_pretrained(base, folder)`` loads) and, with ``save_merged``, a merged HF folder beside them.

>>> cfg = LoraConfig(r=16, alpha=32, target_modules=["all-linear"])
>>> cfg.enabled, cfg.scaling
(True, 2.0)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .config import ConfigError

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names the adapter tensors
# Modules whose weight unison reads directly instead of calling the module: an adapter there would be ignored.
_READ_DIRECTLY = ("lm_head",)


@dataclass
class LoraConfig:
    r: int = 0
    """LoRA rank; 0 trains every parameter (full fine-tuning)."""
    alpha: float = 16.0
    """LoRA's alpha: the adapters' output is scaled by alpha / r (alpha / sqrt(r) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in the training forward only (the engine and the parity guard run without); 0
    with dist.tp > 1."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) to adapt, as PEFT's target_modules; 'all-linear': every linear layer but the
    output head."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(r)."""
    save_merged: bool = False
    """Also save each checkpoint's weights merged (base + adapters) as a plain HF folder, ``<checkpoint>/merged``."""
    adapter: str = ""
    """A PEFT adapter folder to start from (an SFT run's, a unison checkpoint): its r, lora_alpha, target_modules and
    use_rslora replace the settings above and its tensors the initial adapters; the KL reference is then the base
    with these adapters."""

    def __post_init__(self):
        if self.adapter:
            self._take_adapter_settings()
        if self.r < 0:
            raise ValueError(f"lora.r must be >= 0 (0: no adapters), got {self.r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the modules to adapt, or 'all-linear'")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ValueError(f"lora.target_modules: 'all-linear' stands alone, got {self.target_modules}")
        bad = [t for t in self.target_modules if t.split(".")[-1] in _READ_DIRECTLY]
        if bad:
            raise ValueError(f"lora.target_modules: {bad} is the output head, whose weight the engine and the chunked "
                             "logprobs read directly; adapt the decoder's linear layers instead")

    def _take_adapter_settings(self) -> None:
        path = os.path.join(self.adapter, ADAPTER_CONFIG)
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.lora.adapter={self.adapter}: no readable PEFT adapter config ({path}: "
                              f"{e})") from e
        if saved.get("peft_type", "LORA") != "LORA":
            raise ConfigError(f"model.lora.adapter={self.adapter} is a {saved['peft_type']} adapter, not LoRA")
        targets = saved.get("target_modules")
        if not isinstance(targets, (str, list)) or not targets:
            raise ConfigError(f"model.lora.adapter={self.adapter}: its target_modules {targets!r} are not a list of "
                              "module names or 'all-linear'")
        self.r, self.alpha = int(saved["r"]), float(saved["lora_alpha"])
        self.target_modules = [targets] if isinstance(targets, str) else sorted(targets)
        self.use_rslora = bool(saved.get("use_rslora", False))

    @property
    def enabled(self) -> bool:
        return self.r > 0 or bool(self.adapter)

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    def peft_config(self):
        """PEFT's ``LoraConfig`` of these settings."""
        peft = _peft()
        targets = "all-linear" if self.target_modules == ["all-linear"] else list(self.target_modules)
        return peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                               use_rslora=self.use_rslora, bias="none", task_type="CAUSAL_LM")


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError("model.lora.r > 0 trains LoRA adapters through PEFT, which is not installed: "
                          "pip install 'unison[lora]'") from e
    return peft


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> int:
    """Wrap ``cfg.target_modules`` of ``model`` with LoRA adapters in place; only the adapters train. Returns the
    number of adapted modules. Raises ``ConfigError`` where a target matches nothing or is not a linear layer."""
    peft = _peft()
    from peft.tuners.lora import LoraLayer

    dtype = next(model.parameters()).dtype
    try:
        peft.inject_adapter_in_model(cfg.peft_config(), model)
    except ValueError as e:  # PEFT's "Target modules ... not found in the base model"
        raise ConfigError(f"model.lora.target_modules={cfg.target_modules}: {e}") from e
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]
    not_linear = [f"{name} ({type(m.get_base_layer()).__name__})" for name, m in layers
                  if not isinstance(m.get_base_layer(), torch.nn.Linear)]
    if not_linear:
        raise ConfigError(f"model.lora.target_modules matched layers unison runs only as linear layers: "
                          f"{not_linear[:3]}; name linear modules (or 'all-linear')")
    direct = [name for name, _ in layers if name.split(".")[-1] in _READ_DIRECTLY]
    if direct:
        raise ConfigError(f"model.lora.target_modules matched the output head {direct}, whose weight is read "
                          "directly: leave it out")
    for _, m in layers:  # the adapters in the model's dtype: bf16 live tensors, fp32 masters in the optimizer
        m.to(dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA r=%d alpha=%g on %d modules: %d trainable parameters of %d (%.3f%%)", cfg.r, cfg.alpha,
             len(layers), trainable, total, 100 * trainable / total)
    return len(layers)


def shard_adapters(model: torch.nn.Module, mesh) -> int:
    """Shard the adapters of a model ``parallelize`` sharded over the 1-D ``mesh`` as PEFT does under transformers'
    tensor parallelism (``apply_lora`` before ``parallelize``, on the whole layers: given a sharded base, PEFT 0.21
    sizes the adapters by its local shard, and every rank draws the same values for its slice): on a column-wise
    base (output sharded) ``lora_B`` column-wise and ``lora_A`` replicated, on a row-wise base (input sharded)
    ``lora_A`` row-wise (its r-wide partial products summed over the group) and ``lora_B`` replicated. The adapter's
    output is then split as its base's is, and ``LocalForward`` runs the sharded adapter linears like any sharded
    projection. The replicated adapters are broadcast from the group's first rank, so they start identical whatever
    each rank's random state. Returns the number of adapter linears sharded."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan, replicated = {}, []
    for name, m in model.named_modules():
        if not _is_lora_layer(m):
            continue
        weight = m.get_base_layer().weight
        placement = weight.placements[-1] if isinstance(weight, DTensor) else None
        for a in m.lora_A:
            if isinstance(m.lora_dropout[a], torch.nn.Dropout) and m.lora_dropout[a].p > 0:
                raise ConfigError("model.lora.dropout > 0 is not supported with dist.tp > 1 yet: each rank would draw "
                                  "its own dropout masks for the replicated adapters, which then drift apart; set "
                                  "model.lora.dropout=0")
            if (m.lora_A[a].in_features, m.lora_B[a].out_features) != tuple(weight.shape[::-1]):
                raise ValueError(f"{name}: adapters of shape {m.lora_A[a].in_features} -> {m.lora_B[a].out_features}"
                                 f" on a {tuple(weight.shape[::-1])} layer: apply_lora before parallelize")
            if placement == Shard(0):
                plan[f"{name}.lora_B.{a}"] = ColwiseParallel()
                replicated.append(m.lora_A[a].weight)
            elif placement == Shard(1):
                plan[f"{name}.lora_A.{a}"] = RowwiseParallel()
                replicated.append(m.lora_B[a].weight)
            elif placement is None:  # a replicated base: its adapters stay replicated too
                replicated += [m.lora_A[a].weight, m.lora_B[a].weight]
            else:
                raise ValueError(f"{name}: a tensor-parallel base weight placed {placement}: LoRA adapts column- "
                                 "and row-wise projections only")
    if plan:
        parallelize_module(model, mesh, plan)
    group = mesh.get_group()
    with torch.no_grad():
        for p in replicated:
            dist.broadcast(p.data, dist.get_global_rank(group, 0), group=group)
    return len(plan)


def is_lora(model: torch.nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapters' parameters by name (what trains, syncs and is saved)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


MERGED_DEVICE_FRACTION = 0.25  # engine.lora_weights=auto merges where the copy takes at most this much of the GPU


def engine_merges(choice: str, model: torch.nn.Module, device: torch.device, tensor_parallel: bool = False) -> bool:
    """Whether the engine decodes a LoRA policy from merged copies (``EngineConfig.lora_weights``)."""
    if choice == "unmerged":
        return False
    if tensor_parallel:
        if choice == "merged":
            raise ConfigError("engine.lora_weights=merged is not supported with dist.tp > 1 yet: set it to auto or "
                              "unmerged")
        return False
    if choice == "merged":
        return True
    if device.type != "cuda":
        return False
    copy = sum(m.get_base_layer().weight.numel() * m.get_base_layer().weight.element_size()
               for m in model.modules() if _is_lora_layer(m))
    merge = copy <= MERGED_DEVICE_FRACTION * torch.cuda.get_device_properties(device).total_memory
    log.info("engine.lora_weights=auto: %s (the merged copy would take %.1f GiB)", "merged" if merge else "unmerged",
             copy / 2**30)
    return merge


class MergedAdapters:
    """The engine's merged weights of a LoRA policy (``engine.lora_weights=merged``): for each adapted linear layer
    a bf16 ``W + scaling * B @ A`` (one GEMM with W as its addend: fp32 accumulation, one rounding), recomputed from
    the live adapters by ``refresh()`` after every weight update, in place (CUDA graphs keep reading the same
    storage). Inside ``active()`` (the engine's forwards) those layers compute ``x @ W'^T`` instead of PEFT's
    unmerged sum; the training forward never sees them."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if _is_lora_layer(m)]
        self.weights = [torch.empty_like(m.get_base_layer().weight) for m in self.layers]
        self._on = False
        for layer, weight in zip(self.layers, self.weights, strict=True):
            layer.forward = self._forward_of(layer, layer.forward, weight)
        self.refresh()

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    @torch.no_grad()
    def refresh(self) -> None:
        for layer, weight in zip(self.layers, self.weights, strict=True):
            base = layer.get_base_layer().weight
            adapters = [a for a in layer.active_adapters if a in layer.lora_A]
            if len(adapters) != 1:
                raise ValueError(f"engine.lora_weights=merged merges one active adapter per layer, got {adapters}")
            a = adapters[0]
            torch.addmm(base, layer.lora_B[a].weight, layer.lora_A[a].weight, alpha=layer.scaling[a], out=weight)

    @contextmanager
    def active(self) -> Iterator[None]:
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def _forward_of(self, layer, peft_forward, weight):
        def forward(x, *args, **kwargs):
            if not self._on or layer.disable_adapters:
                return peft_forward(x, *args, **kwargs)
            return torch.nn.functional.linear(x, weight, layer.get_base_layer().bias)
        return forward


def synced_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """What a weight sync carries (``unison serve``'s receiver, the trainer's publisher): with LoRA the adapters alone,
    applied on the server's own copy of the same base; otherwise every parameter."""
    return adapter_params(model) if is_lora(model) else dict(model.named_parameters())


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base alone (the reference policy): every LoRA layer's adapters off, then back on."""
    layers = [m for m in model.modules() if _is_lora_layer(m)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


@contextmanager
def dropout_active(model: torch.nn.Module) -> Iterator[None]:
    """The adapters' dropout on (training mode) for a training forward; the rest of the model stays in eval mode."""
    drops = [d for m in model.modules() if _is_lora_layer(m) for d in m.lora_dropout.values()
             if isinstance(d, torch.nn.Dropout)]
    for d in drops:
        d.train()
    try:
        yield
    finally:
        for d in drops:
            d.eval()


def save_adapter(model: torch.nn.Module, cfg: LoraConfig, folder: str, base_model: str,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """The adapters in PEFT's format into ``folder`` (which exists): ``PeftModel.from_pretrained(base, folder)``
    loads them onto ``base_model``. ``state_dict`` replaces the model's own (a tensor-parallel model's, gathered
    whole by ``unison.dist.tensor_parallel.full_state_dict``)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapters = get_peft_model_state_dict(model, state_dict=state_dict)
    state = {_PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in adapters.items()}
    save_file(state, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = cfg.peft_config()
    config.base_model_name_or_path = base_model
    config.save_pretrained(folder)


def load_adapter(model: torch.nn.Module, folder: str) -> None:
    """Load the adapter tensors ``save_adapter`` wrote in ``folder`` into ``model``'s adapters, in place (their
    storage stays the one the engine reads). Every adapter tensor must be there, with its shape (the whole one: an
    adapter sharded for tensor parallelism takes this rank's slice of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = adapter_params(model)
    saved = read_adapter(model, folder)
    with torch.no_grad():
        for name, p in params.items():
            key = _peft_key(name)
            if isinstance(p, DTensor):  # this rank's slice, cut locally (src_data_rank=None: no collective)
                whole = saved[key].to(p.device, p.dtype)
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(saved[key])


def read_adapter(model: torch.nn.Module, folder: str) -> dict[str, torch.Tensor]:
    """The adapter tensors saved in ``folder`` (CPU, whole) under PEFT's names, checked against ``model``'s adapters:
    the same tensors, the same (whole) shapes."""
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.exists(path):
        raise ConfigError(f"{folder} holds no LoRA adapters ({ADAPTER_WEIGHTS}): it was not saved by a LoRA run")
    saved = {k.removeprefix(_PEFT_PREFIX): v for k, v in load_file(path).items()}
    mine = {_peft_key(name): p for name, p in adapter_params(model).items()}
    if set(saved) != set(mine):
        diff = sorted(set(saved) ^ set(mine))
        raise ConfigError(f"{folder}: its adapters are not this run's model.lora ({len(diff)} tensors differ, e.g. "
                          f"{diff[:2]}); use the settings it was saved with ({_saved_settings(folder)})")
    for key, p in mine.items():
        whole = p.shape  # a DTensor's shape is the whole one
        if saved[key].shape != whole:
            raise ConfigError(f"{folder}: {key} has shape {tuple(saved[key].shape)}, this run's adapter "
                              f"{tuple(whole)} (another lora.r?)")
    return saved


def _peft_key(name: str) -> str:
    """PEFT's saved name of an adapter parameter: without the adapter's name (``lora_A.default.weight`` ->
    ``lora_A.weight``)."""
    return name.replace(".default.", ".")


def _saved_settings(folder: str) -> str:
    try:
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            c = json.load(f)
        return f"r={c.get('r')}, alpha={c.get('lora_alpha')}, target_modules={c.get('target_modules')}"
    except (OSError, ValueError):
        return "its adapter_config.json is unreadable"


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The model's state dict under its HF names with every adapter merged into its base weight (in fp32, then the
    weight's dtype): what a plain ``from_pretrained`` of the architecture loads. ``state_dict`` replaces the model's
    own (a tensor-parallel model's, gathered whole)."""
    state = model.state_dict() if state_dict is None else state_dict
    merged: dict[str, torch.Tensor] = {}
    adapted = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        module_name, _, leaf = name.rpartition(".base_layer.")
        if module_name in adapted and leaf == "weight":
            m = adapted[module_name]
            delta = sum(state[f"{module_name}.lora_B.{a}.weight"].float()
                        @ state[f"{module_name}.lora_A.{a}.weight"].float() * m.scaling[a] for a in m.active_adapters)
            merged[f"{module_name}.weight"] = (tensor.float() + delta).to(tensor.dtype)
        else:
            merged[name.replace(".base_layer.", ".")] = tensor
    return merged
