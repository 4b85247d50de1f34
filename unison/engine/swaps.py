"""The engine's kernel swaps for its eager steps, planned once (``KernelSwaps``).

Every eager engine step (a prefill, a tool reply's tokens, a step of mixed rows) runs its forward inside
``graphs.fused_kernels``, which walks the decoder, checks each module against the fused kernels' conditions, builds
~340 replacement forwards (at the Qwen3-0.6B shape, 28 layers) and swaps them in, then swaps the modules' own
forwards back: 6.0 ms of host time a step on a CI core, for a step whose host time is most of its ~35 ms on an H200
(bench/results/h200/speed/multiturn). The same modules get the same replacements each time, so ``KernelSwaps``
records what ``fused_kernels`` put where once, and afterwards only writes those forwards in and takes them out
again, a dict write each, after checking that the plan still holds: 0.48 ms (``bench/swap_cost.py``).

The plan is kept while the decoder still is what it was planned on: the same module objects, each with the forward
of its own it had then (none, or one someone else swapped in), the same ``apply_rotary_pos_emb`` in the modeling
modules, and parameters of the same kinds (class, dtype, device, contiguity: what the swaps' conditions read). Any
change (a LoRA layer put in, a dtype conversion, a module's forward wrapped) plans again. The replacements read
their weights when called, so moved or updated weights need nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

_MISSING = object()
ROPE = "apply_rotary_pos_emb"


class KernelSwaps:
    """``swaps()`` is ``fused(decoder)`` (``graphs.fused_kernels``), from the second time on without planning."""

    def __init__(self, decoder: torch.nn.Module, fused: Callable[[torch.nn.Module], AbstractContextManager]):
        self.decoder = decoder
        self.fused = fused
        self.plans = 0  # how many times the swaps were planned (tests)
        self._modules: list[torch.nn.Module] | None = None
        self._key: tuple | None = None
        self._writes: list[tuple[dict, str, object]] = []  # (namespace, name, the replacement) in swap order
        self._chains: list = []  # the fused adds' carriers, emptied on the way out (``fused_layer._Chain``)

    def __call__(self) -> AbstractContextManager:
        return self._swapped()

    @contextmanager
    def _swapped(self) -> Iterator[None]:
        modules = list(self.decoder.modules())
        if not self._holds(modules):
            self._plan(modules)
        saved: list[tuple[dict, str, object]] = []
        try:
            for space, name, value in self._writes:
                saved.append((space, name, space.get(name, _MISSING)))
                space[name] = value
            yield
        finally:
            for space, name, old in reversed(saved):
                if old is _MISSING:
                    space.pop(name, None)
                else:
                    space[name] = old
            for chain in self._chains:
                chain.take(None, None)  # what a failed forward left behind

    def _plan(self, modules: list[torch.nn.Module]) -> None:
        """Enter ``fused`` once and record what it wrote where."""
        before = self._state(modules)
        spaces = _rope_spaces(modules)
        own = [m.__dict__.get("forward", _MISSING) for m in modules]
        own_rope = [space.get(ROPE, _MISSING) for space in spaces]
        with self.fused(self.decoder):
            writes = [(m.__dict__, "forward", m.__dict__["forward"]) for m, was in zip(modules, own, strict=True)
                      if m.__dict__.get("forward", _MISSING) is not was]
            writes += [(space, ROPE, space[ROPE]) for space, was in zip(spaces, own_rope, strict=True)
                       if space.get(ROPE, _MISSING) is not was]
        self._writes = writes
        self._chains = list({id(c): c for c in (getattr(fn, "chain", None) for _, _, fn in writes)
                             if c is not None}.values())
        self._modules, self._key = modules, before
        self.plans += 1

    def _holds(self, modules: list[torch.nn.Module]) -> bool:
        """Whether the plan was made on these very modules (held, so that no other object takes one's id), in the
        state they are in now."""
        planned = self._modules
        return (planned is not None and len(planned) == len(modules)
                and all(a is b for a, b in zip(planned, modules, strict=True)) and self._key == self._state(modules))

    @staticmethod
    def _state(modules: list[torch.nn.Module]) -> tuple:
        """What the plan depends on besides the modules themselves: their own forwards, the modeling modules' RoPE
        and the parameters' kinds."""
        params = tuple((type(p), p.dtype, p.device, p.is_contiguous()) for m in modules
                       for p in m._parameters.values() if p is not None)
        return (tuple(m.__dict__.get("forward", _MISSING) for m in modules),
                tuple(space.get(ROPE, _MISSING) for space in _rope_spaces(modules)), params)


def _rope_spaces(modules: list[torch.nn.Module]) -> list[dict]:
    """The namespaces of the modeling modules whose ``apply_rotary_pos_emb`` ``fused_rope`` may swap."""
    from .fused_rope import ATTENTION_CLASSES
    names = {type(m).__module__ for m in modules if type(m).__name__ in ATTENTION_CLASSES}
    return [vars(sys.modules[name]) for name in sorted(names) if name in sys.modules]
