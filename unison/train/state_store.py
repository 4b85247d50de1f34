"""Where the optimizer's fp32 masters and moments live: with the parameters (``DeviceStore``), or in pinned host
memory, passing through the GPU at each step (``HostStore``).

A store allocates the state of the (local) tensors this rank steps and runs a step over them: for each tensor,
``update(master, exp_avg, exp_avg_sq, grad)`` (the AdamW arithmetic, the same for every store) and the write-back
of bf16(master) into the live parameter, yielding each tensor's changed mask as soon as it is written, so an
ownership policy can broadcast it while the store goes on with the next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Protocol

import torch

from .adamw import AdamState, AdamWStep, write_back

Update = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``update(master, exp_avg, exp_avg_sq, grad)``: one AdamW step in place; fp32 state, grad in its own dtype."""

Work = list[tuple[str, AdamState, torch.Tensor, torch.Tensor]]
"""``(name, state, data, grad)`` per stepped tensor: its state, the live (local) tensor and its gradient."""


class StateStore(Protocol):
    def allocate(self, tensors: dict[str, torch.Tensor]) -> dict[str, AdamState]:
        """State for each tensor: master = its value in fp32, moments zero."""

    def update(self, work: Work, update: Update) -> Iterator[tuple[str, torch.Tensor]]:
        """Step every tensor of ``work`` in order, yielding ``(name, changed mask)`` once each is written back."""


_MULTI_CACHE = 4


class DeviceStore:
    """State beside the parameters: 12 bytes per parameter on its device. On a GPU, with bf16 parameters, every
    tensor's update and write-back run in one launch (``triton_adamw.MultiTensorStep``; ``fused=False``: a launch
    or two each)."""

    def __init__(self, fused: bool = True):
        self.fused = fused
        self._multi: dict[tuple[str, ...], object] = {}

    def allocate(self, tensors: dict[str, torch.Tensor]) -> dict[str, AdamState]:
        return {name: AdamState(master=t.detach().to(torch.float32, copy=True),
                                exp_avg=torch.zeros_like(t, dtype=torch.float32),
                                exp_avg_sq=torch.zeros_like(t, dtype=torch.float32))
                for name, t in tensors.items()}

    def update(self, work: Work, update: Update) -> Iterator[tuple[str, torch.Tensor]]:
        masks: dict[str, torch.Tensor] = {}
        if self.fused and isinstance(update, AdamWStep) and 0.5 < update.beta1 < 1.0:
            for group in _one_launch_groups(work):
                grads = [grad for _, _, _, grad in group]
                masks.update(zip((name for name, *_ in group), self._multi_step(group)(grads, update.kernel_scalars()),
                                 strict=True))
        for name, state, data, grad in work:  # in order: an ownership policy broadcasts each as it comes
            if name not in masks:
                update(state.master, state.exp_avg, state.exp_avg_sq, grad)
                masks[name] = write_back(data, state.master)
            yield name, masks[name]

    def _multi_step(self, group: Work):
        from .triton_adamw import MultiTensorStep  # Triton only where the kernels run

        states = [state for _, state, _, _ in group]
        tensors = ([s.master for s in states], [s.exp_avg for s in states], [s.exp_avg_sq for s in states],
                   [data for _, _, data, _ in group])
        key = tuple(name for name, *_ in group)
        step = self._multi.get(key)
        if step is None or not step.matches(*tensors):
            if len(self._multi) >= _MULTI_CACHE:  # the set of stepped tensors can change every step (an MoE expert
                self._multi.clear()               # no token reached has no gradient): keep a few tables, not all
            step = self._multi[key] = MultiTensorStep(*tensors)
        return step


def _one_launch_groups(work: Work) -> list[Work]:
    """The tensors of ``work`` that ``MultiTensorStep`` takes (bf16 parameters on a GPU, every tensor contiguous and
    16-byte aligned, fp32 or bf16 gradients), grouped by device and gradient dtype: one launch each."""
    groups: dict[tuple, Work] = {}
    for item in work:
        _, state, data, grad = item
        tensors = (state.master, state.exp_avg, state.exp_avg_sq, data, grad)
        if (data.is_cuda and data.dtype == torch.bfloat16 and grad.dtype in (torch.bfloat16, torch.float32)
                and data.numel() > 0 and all(t.is_contiguous() and t.device == data.device for t in tensors)
                and all(t.dtype == torch.float32 for t in tensors[:3])
                and all(t.data_ptr() % 16 == 0 for t in tensors)):
            groups.setdefault((data.device, grad.dtype), []).append(item)
    return list(groups.values())


class HostStore:
    """State in one page-locked host arena, streamed through the GPU in units of at most ``chunk_numel`` elements
    of one tensor (AdamW is elementwise, so a chunk's update is exactly the whole tensor's update restricted to it).

    For each unit: copy its master and moments in on one stream, step them and write bf16(master) back into the
    live parameter on the compute stream (recording which elements changed), copy them out on a third stream. The
    next unit's copy-in overlaps this unit's step; at most ``in_flight`` units hold GPU memory at once, so the GPU
    needs about ``in_flight * 12 * chunk_numel`` bytes for the optimizer instead of 12 bytes per parameter. The same
    operations run on the same device as ``DeviceStore``'s, so the parameters come out bit-identical. On the CPU
    (tensors off any GPU) the arena is plain host memory and the copies are synchronous.
    """

    def __init__(self, chunk_numel: int = 1 << 25, in_flight: int = 3):
        self.chunk_numel = chunk_numel
        self.in_flight = in_flight
        self._arena = torch.empty(0, dtype=torch.float32)
        self._registered = False

    def allocate(self, tensors: dict[str, torch.Tensor]) -> dict[str, AdamState]:
        if self._arena.numel():
            raise RuntimeError("a HostStore holds the state of one optimizer")
        # One host arena for every master and moment, page-locked as a whole: exact size (the pinned caching
        # allocator rounds each allocation up to a power of two, +30-50% host memory for a model's tensors).
        self._arena = torch.empty(3 * sum(t.numel() for t in tensors.values()), dtype=torch.float32)
        if any(t.is_cuda for t in tensors.values()) and self._arena.numel():
            err = int(torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.nbytes, 0))
            if err != 0:
                raise RuntimeError(f"page-locking {self._arena.nbytes / 2**30:.1f} GiB of host memory for the "
                                   f"optimizer state failed (CUDA error {err})")
            self._registered = True
        cursor = 0

        def take(t: torch.Tensor) -> torch.Tensor:
            nonlocal cursor
            out = self._arena[cursor:cursor + t.numel()].view(t.shape)
            cursor += t.numel()
            return out

        return {name: AdamState(master=take(t).copy_(t.detach()), exp_avg=take(t).zero_(), exp_avg_sq=take(t).zero_())
                for name, t in tensors.items()}

    def __del__(self):
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())

    def update(self, work: Work, update: Update) -> Iterator[tuple[str, torch.Tensor]]:
        if not work:
            return
        device = work[0][2].device
        cuda = device.type == "cuda"
        copy_in = torch.cuda.Stream(device) if cuda else None
        copy_out = torch.cuda.Stream(device) if cuda else None
        compute = torch.cuda.current_stream(device) if cuda else None
        units = [(name, state, data, grad, a, min(a + self.chunk_numel, data.numel()))
                 for name, state, data, grad in work for a in range(0, max(data.numel(), 1), self.chunk_numel)]
        masks = {name: torch.empty(data.shape, dtype=torch.bool, device=device) for name, _, data, _ in work}
        if cuda:
            copy_in.wait_stream(compute)  # the gradients are complete

        def load(unit):
            _, state, _, _, a, b = unit
            with torch.cuda.stream(copy_in) if cuda else nullcontext():
                bufs = [t.view(-1)[a:b].to(device, non_blocking=True)
                        for t in (state.master, state.exp_avg, state.exp_avg_sq)]
            return bufs, copy_in.record_event() if cuda else None

        done: deque = deque()
        pending = load(units[0])
        for i, (name, state, data, grad, a, b) in enumerate(units):
            bufs, loaded = pending
            while len(done) >= self.in_flight:  # bound the GPU memory held by units in flight
                done.popleft().synchronize()
            if i + 1 < len(units):
                pending = load(units[i + 1])
            if cuda:
                compute.wait_event(loaded)
            master, exp_avg, exp_avg_sq = bufs
            update(master, exp_avg, exp_avg_sq, grad.view(-1)[a:b])
            masks[name].view(-1)[a:b] = write_back(data.view(-1)[a:b], master)
            host = (state.master, state.exp_avg, state.exp_avg_sq)
            if cuda:
                stepped_event = compute.record_event()
                with torch.cuda.stream(copy_out):
                    copy_out.wait_event(stepped_event)
                    for t, buf in zip(host, bufs, strict=True):
                        t.view(-1)[a:b].copy_(buf, non_blocking=True)
                        buf.record_stream(compute)
                        buf.record_stream(copy_out)
                    done.append(copy_out.record_event())
            else:
                for t, buf in zip(host, bufs, strict=True):
                    t.view(-1)[a:b].copy_(buf)
            if b == data.numel():  # the tensor's last unit: its mask is complete (on the compute stream)
                yield name, masks[name]
        if cuda:
            copy_out.synchronize()  # host state complete before anyone reads it (checkpoints, the next step)
