"""Per-request state of the conv, linear-attention and state-space layers of hybrid models, beside the paged KV.

A hybrid model (Qwen3-Next and Qwen3.5 gated delta-nets, Lfm2's short convs, FalconH1's Mamba2 mixers) keeps, per
sequence and per such layer, a fixed-size state instead of a growing KV: the last ``kernel - 1`` inputs of each causal
conv, and the recurrent matrix of the delta rule or the SSM. The engine keeps them in a ``StatePool``: one slot per
running (or parked) request, fp32, advanced by every prefill chunk and decode step of that request, dropped with its
KV (preemption, a weight update under ``recompute``, lending) and recomputed with it.

transformers' layers compute these sequences through module-level functions (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``) that ``unison.train.boundaries`` wraps; since 5.25 the conv
and the scan are reached through helpers around transformers' cache (``causal_conv1d_forward``,
``mamba2_scan_forward``) which, given no cache (the engine passes none), call the same functions. In an engine forward
(``paged=`` in the layer's kwargs; a forward pre-hook adds the layer's index as ``state_layer``) the wrappers hand
the call to the step's ``StepStates``, which runs every request's tokens of the batch-1 row as its own sequence from
its slot's state and writes the state after them back: the conv over the row with each request's stored inputs in
front of its tokens (one ``conv1d``), the delta rule and the scan per request from the stored state (one batched
recurrent step when every request decodes one token; flash-linear-attention's varlen kernel with per-request
initial states on the GPU where transformers found it). A request whose chunk starts at position 0 starts from zeros.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..train.boundaries import hub_function, keep_samples_apart
from . import vmm

# What a hybrid layer's forward may call from its modeling module: the sequence functions the engine runs per request
# (through unison.train.boundaries), their one-token cached forms (only reached with transformers' own cache) and the
# padding mask. Any other module function is a sequence kernel the engine does not know (Mamba1's selective scan...).
_GATED_DELTA, _MAMBA2, _CONV = "torch_chunk_gated_delta_rule", "mamba2_chunk_scan", "causal_conv1d_fn"
_KNOWN = {_GATED_DELTA, _MAMBA2, _CONV, "causal_conv1d_update", "torch_recurrent_gated_delta_rule",
          "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined", "apply_mask_to_padding_states"}
# transformers' helpers (5.25) that run the conv and the scan around its cache: read through, the functions their
# bodies call count as the layer's; one whose body cannot be read stays an unknown function and is refused.
_HELPERS = {"causal_conv1d_forward", "mamba2_scan_forward"}


@dataclass(frozen=True)
class StateLayer:
    """What one layer keeps per sequence: the conv's last ``kernel - 1`` inputs, ``(channels, kernel - 1)``, and
    the recurrent state of shape ``recurrent`` (``()`` for a conv-only layer)."""

    layer_idx: int
    kind: str  # "gated_delta", "mamba2" or "conv"
    channels: int
    kernel: int
    recurrent: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        rec = 1
        for d in self.recurrent:
            rec *= d
        return self.channels * (self.kernel - 1) + (rec if self.recurrent else 0)


def state_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's conv / linear-attention / state-space mixers: modules with a ``layer_idx`` and a causal
    ``nn.Conv1d`` child."""
    return [m for m in model.modules() if hasattr(m, "layer_idx")
            and any(isinstance(c, torch.nn.Conv1d) for c in m.children())]


def state_layers(model: torch.nn.Module) -> list[StateLayer]:
    """Each state-keeping layer's shapes, in layer order; raises for a mixer the engine cannot run exactly."""
    layers, seen = [], {}
    for module in state_modules(model):
        if module.layer_idx in seen:  # Inkling's several convs per layer, each with its own state (state_idx)
            raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}): a second sequence module in the "
                             f"layer of {seen[module.layer_idx]}; unison's engine keeps one state per layer")
        seen[module.layer_idx] = type(module).__name__
        names = _module_functions(module)
        conv = next(c for c in module.children() if isinstance(c, torch.nn.Conv1d))
        channels, kernel = conv.in_channels, conv.kernel_size[0]
        unknown = sorted(names - _KNOWN)
        if unknown or _CONV not in names:
            raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}): a sequence layer whose functions "
                             f"({', '.join(unknown) or 'no causal_conv1d_fn'}) unison's engine does not run per "
                             f"request; it would carry state across requests and steps. Supported: gated delta-nets "
                             f"(Qwen3-Next, Qwen3.5), short convs (Lfm2), Mamba2 mixers (FalconH1)")
        if _GATED_DELTA in names:
            layers.append(StateLayer(module.layer_idx, "gated_delta", channels, kernel,
                                     (module.num_v_heads, module.head_k_dim, module.head_v_dim)))
        elif _MAMBA2 in names:
            layers.append(StateLayer(module.layer_idx, "mamba2", channels, kernel,
                                     (module.num_heads, module.head_dim, module.ssm_state_size)))
        else:
            layers.append(StateLayer(module.layer_idx, "conv", channels, kernel))
    return sorted(layers, key=lambda s: s.layer_idx)


def _module_functions(module: torch.nn.Module) -> set[str]:
    """The functions of its modeling module that a mixer's forward calls by name, those of transformers' cache
    helpers (``_HELPERS``) in place of the helper."""
    space = sys.modules[type(module).__module__]
    names = _calls(inspect.unwrap(type(module).forward), space)
    for helper in names & _HELPERS:
        fn = hub_function(getattr(space, helper))
        if fn is not None:
            names = names - {helper} | _calls(fn, space)
    return names


def _calls(fn, space) -> set[str]:
    """The names ``fn`` looks up that hold a function in ``space``: anything callable but a class (a plain or
    wrapped function, a ``kernels`` function module, a callable unison cannot read, which is then refused)."""
    def is_function(value) -> bool:
        return callable(value) and not inspect.isclass(value)

    return {n for n in fn.__code__.co_names if is_function(getattr(space, n, None))}


def install(model: torch.nn.Module) -> list[StateLayer]:
    """Prepare ``model``'s hybrid layers for engine forwards (idempotent): the sequence functions wrapped
    (``unison.train.boundaries``), each mixer told its layer index. Returns the state layers (empty: none)."""
    layers = state_layers(model)
    if not layers:
        return layers
    replaced = {name.rsplit(".", 1)[1] for name in keep_samples_apart(model)}
    for module in state_modules(model):
        missing = sorted(_module_functions(module) & {_GATED_DELTA, _MAMBA2, _CONV} - replaced)
        if missing:
            raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}): its {', '.join(missing)} has a "
                             f"signature unison does not know, so the engine cannot give it per-request state")
        if not getattr(module, "_unison_state_hook", False):
            module.register_forward_pre_hook(_tell_layer, with_kwargs=True)
            module._unison_state_hook = True
    return layers


def _tell_layer(module, args, kwargs):
    if kwargs.get("paged") is not None:
        return args, {**kwargs, "state_layer": module.layer_idx}
    return None


class StatePool(vmm.LendsMemory):
    """Every state layer's per-sequence states, ``num_slots`` sequences (the last one scratch: padded rows of a
    CUDA-graph step write there), fp32, in one lendable allocation (``release``/``restore``, as ``KVPool``):
    ``conv[layer]`` is ``(slots, channels, kernel - 1)``, ``recurrent[layer]`` ``(slots, *shape)``."""

    def __init__(self, layers: list[StateLayer], num_slots: int, device: torch.device):
        self.layers = {s.layer_idx: s for s in layers}
        self.num_slots = num_slots
        self.scratch = num_slots - 1
        numel = num_slots * sum(s.numel for s in layers)
        self._memory = vmm.LendableBuffer(numel, torch.float32, device)
        self.storage = self._memory.storage
        self.conv, self.recurrent = {}, {}
        offset = 0
        for s in layers:
            size = num_slots * s.channels * (s.kernel - 1)
            self.conv[s.layer_idx] = self.storage[offset:offset + size].view(num_slots, s.channels, s.kernel - 1)
            offset += size
            if s.recurrent:
                size = num_slots * (s.numel - s.channels * (s.kernel - 1))
                self.recurrent[s.layer_idx] = self.storage[offset:offset + size].view(num_slots, *s.recurrent)
                offset += size

    def copy_slot(self, src: int, dst: int) -> None:
        """Every layer's state of sequence ``src`` into ``dst`` (a group's sample starting from its prompt's)."""
        for views in (self.conv, self.recurrent):
            for t in views.values():
                t[dst].copy_(t[src])


class StepStates:
    """One engine step's requests as sequences of the batch-1 row: request s has ``lengths[s]`` tokens, its state
    in pool slot ``slots[s]``, starting from zeros where ``fresh[s]`` (its chunk starts at position 0)."""

    def __init__(self, pool: StatePool, slots: torch.Tensor, fresh: torch.Tensor, lengths: list[int]):
        self.pool = pool
        self.slots = slots  # (S,) int64, device
        self.fresh = fresh  # (S,) bool, device
        self.lengths = lengths
        self.single = all(n == 1 for n in lengths)  # a decode step: one batched recurrent step
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        self.bounds = bounds
        self.cu_seqlens = torch.tensor(bounds, dtype=torch.int64, device=slots.device)  # flash-linear-attention's
        self._conv_index: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}
        self.visited: set[int] = set()

    @classmethod
    def for_chunks(cls, pool: StatePool, slots: list[int], starts: list[int], lengths: list[int],
                   device: torch.device) -> StepStates:
        return cls(pool, torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor([s == 0 for s in starts], dtype=torch.bool, device=device), lengths)

    def prepare_static(self) -> None:
        """Build every index tensor the layers will ask for now (a CUDA-graph capture cannot copy from the host)."""
        for layer in self.pool.layers.values():
            self._conv_layout(layer.kernel - 1)

    def _initial(self, views: torch.Tensor) -> torch.Tensor:
        init = views.index_select(0, self.slots)
        return init.masked_fill(self.fresh.view(-1, *[1] * (init.ndim - 1)), 0.0)

    def _conv_layout(self, gap: int):
        """Row positions, in a row where each request's ``gap`` stored inputs precede its tokens, of the tokens,
        of the stored inputs, and of each request's last ``gap`` inputs (its next state)."""
        if gap not in self._conv_index:
            tokens, stored, last = [], [], []
            for s, n in enumerate(self.lengths):
                base = self.bounds[s] + s * gap
                stored += range(base, base + gap)
                tokens += range(base + gap, base + gap + n)
                last += range(base + n, base + n + gap)
            dev = self.slots.device
            total = self.bounds[-1] + len(self.lengths) * gap
            self._conv_index[gap] = tuple(torch.tensor(i, dtype=torch.int64, device=dev)
                                          for i in (tokens, stored, last)) + (total,)
        return self._conv_index[gap]

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None) -> torch.Tensor:
        """x: (1, C, N) the row's conv inputs; weight: (C, K). Returns (1, C, N) in x's dtype, activation applied."""
        self.visited.add(layer)
        views = self.pool.conv[layer]
        channels, gap = x.shape[1], weight.shape[-1] - 1
        tokens, stored, last, total = self._conv_layout(gap)
        row = x.new_empty(channels, total, dtype=weight.dtype)
        row.index_copy_(1, tokens, x[0].to(weight.dtype))
        init = self._initial(views)  # (S, C, gap)
        row.index_copy_(1, stored, init.permute(1, 0, 2).reshape(channels, -1).to(weight.dtype))
        out = F.conv1d(row[None], weight.unsqueeze(1), bias, groups=channels)[0]  # output j ends at input j + gap
        y = out.index_select(1, tokens - gap)
        views.index_copy_(0, self.slots, row.index_select(1, last).view(channels, -1, gap).transpose(0, 1)
                          .to(views.dtype))
        if activation is not None:
            y = ACT2FN[activation](y)
        return y[None].to(x.dtype)

    def gated_delta(self, layer: int, query, key, value, g, beta, chunk_size: int, use_qk_l2norm: bool,
                    chunk_fn, recurrent_fn, kernel: bool):
        """The gated delta rule of every request from its state. query/key: (1, N, Hk, Dk); value: (1, N, Hv, Dv);
        g, beta: (1, N, Hv). ``chunk_fn``/``recurrent_fn``: transformers' (or flash-linear-attention's) chunked
        and token-by-token forms; ``kernel``: chunk_fn is flash-linear-attention's (takes cu_seqlens). Returns
        (out (1, N, Hv, Dv), None)."""
        self.visited.add(layer)
        views = self.pool.recurrent[layer]
        init = self._initial(views)
        args = dict(output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
        if self.single:  # every request one token: a batch of one-token sequences
            rows = [t[0].unsqueeze(1) for t in (query, key, value, g, beta)]
            out, final = recurrent_fn(*rows[:3], g=rows[3], beta=rows[4], initial_state=init, **args)
            out = out.transpose(0, 1)
        elif kernel and query.is_cuda:
            out, final = chunk_fn(query, key, value, g=g, beta=beta, initial_state=init, cu_seqlens=self.cu_seqlens,
                                  **args)
        else:
            outs, finals = [], []
            for s, (a, b) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=True)):
                o, f = chunk_fn(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                chunk_size=chunk_size, initial_state=init[s:s + 1], **args)
                outs.append(o)
                finals.append(f)
            out, final = torch.cat(outs, 1), torch.cat(finals, 0)
        views.index_copy_(0, self.slots, final.to(views.dtype))
        return out, None

    def mamba2(self, layer: int, hidden_states, dt, A, B, C, chunk_size: int, scan_fn, D=None, dt_bias=None,
               dt_softplus: bool = False, dt_limit=(0.0, float("inf")), z=None, **_):
        """The Mamba2 scan of every request from its state. hidden_states: (1, N, H, P); dt: (1, N, H); B, C:
        (1, N, G, n). Returns the scan's output alone, (1, N, H, P) fp32 (the mixer asked for no final state)."""
        self.visited.add(layer)
        if z is not None:
            raise ValueError("mamba2_chunk_scan: a gate z inside the scan is not supported by unison's engine")
        views = self.pool.recurrent[layer]
        init = self._initial(views)  # (S, H, P, n)
        if self.single:
            out, final = _mamba2_step(hidden_states[0], dt[0], A, B[0], C[0], init, D, dt_bias, dt_softplus, dt_limit)
            out = out[None]
        else:
            outs, finals = [], []
            for s, (a, b) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=True)):
                o, f = scan_fn(hidden_states[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], chunk_size, D=D,
                               dt_bias=dt_bias, initial_states=init[s:s + 1], dt_softplus=dt_softplus,
                               dt_limit=dt_limit, return_final_states=True)
                outs.append(o)
                finals.append(f)
            out, final = torch.cat(outs, 1), torch.cat(finals, 0)
        views.index_copy_(0, self.slots, final.to(views.dtype))
        return out


def _mamba2_step(x, dt, A, B, C, state, D, dt_bias, dt_softplus, dt_limit):
    """One token of each of S sequences through the Mamba2 recurrence, the chunked scan's arithmetic for a chunk of
    one token. x: (S, H, P); dt: (S, H); B, C: (S, G, n); state: (S, H, P, n) fp32. Returns (y (S, H, P) fp32,
    the new state)."""
    heads, groups = x.shape[1], B.shape[1]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=1, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=1, output_size=heads)
    decay = torch.exp(A.float() * dt)  # (S, H)
    state = state * decay[..., None, None] + (x * dt[..., None])[..., None] * B[:, :, None, :]
    y = torch.einsum("shpn,shn->shp", state, C)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, state


def check_visited(states: StepStates) -> None:
    """After an engine forward: every state layer ran through the step's states (a layer that did not would have
    computed its sequence from zeros, across requests)."""
    missing = sorted(set(states.pool.layers) - states.visited)
    if missing:
        raise RuntimeError(f"the engine forward did not reach the per-request state of layers {missing}: their "
                           f"sequence functions were not unison's (unison.train.boundaries)")
