"""AdamW whose fp32 masters and moments live in pinned host memory and pass through the GPU at each step.

The step is cut into units of at most ``chunk_numel`` elements of one parameter (AdamW is elementwise, so a
chunk's update is exactly the whole tensor's update restricted to it). For each unit: copy its master and
moments in on one stream, step them and write bf16(master) back into the live parameter on the compute stream
(recording which elements changed), copy them out on a third stream. The next unit's copy-in overlaps this
unit's step; at most ``in_flight`` units hold GPU memory at once, so the GPU needs about
``in_flight * 12 * chunk_numel`` bytes for the optimizer instead of 12 bytes per parameter. The same operations
run on the same device as ``MasterAdamW``'s, so the parameters come out bit-identical.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from contextlib import nullcontext

import torch

from .optimizer import MasterAdamW, OptimConfig, _AdamState, adamw_step, changed_bits, trainable


class HostAdamW(MasterAdamW):
    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig, total_steps: int,
                 chunk_numel: int = 1 << 25, in_flight: int = 3):
        self.chunk_numel = chunk_numel
        self.in_flight = in_flight
        params = trainable(named_params)
        unique = params.values()
        # One host arena for every master and moment, page-locked as a whole: exact size (the pinned caching
        # allocator rounds each allocation up to a power of two, +30-50% host memory for a model's tensors).
        self._arena = torch.empty(3 * sum(p.numel() for p in unique), dtype=torch.float32)
        self._cursor = 0
        self._registered = False
        if any(p.is_cuda for p in unique) and self._arena.numel():
            err = int(torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.nbytes, 0))
            if err != 0:
                raise RuntimeError(f"page-locking {self._arena.nbytes / 2**30:.1f} GiB of host memory for the "
                                   f"optimizer state failed (CUDA error {err})")
            self._registered = True
        super().__init__(params.items(), cfg, total_steps)

    def _new_state(self, name: str, param: torch.nn.Parameter) -> _AdamState:
        def take() -> torch.Tensor:
            out = self._arena[self._cursor:self._cursor + param.numel()].view(param.shape)
            self._cursor += param.numel()
            return out

        return _AdamState(master=take().copy_(param.detach()), exp_avg=take().zero_(), exp_avg_sq=take().zero_())

    def __del__(self):
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())

    def _update_all(self, stepped: dict[str, torch.nn.Parameter], grad_scale: float, lr: float
                    ) -> dict[str, torch.Tensor]:
        if not stepped:
            return {}
        device = next(iter(stepped.values())).device
        cuda = device.type == "cuda"
        copy_in = torch.cuda.Stream(device) if cuda else None
        copy_out = torch.cuda.Stream(device) if cuda else None
        compute = torch.cuda.current_stream(device) if cuda else None
        units = [(name, p, a, min(a + self.chunk_numel, p.numel()))
                 for name, p in stepped.items() for a in range(0, p.numel(), self.chunk_numel)]
        masks = {name: torch.empty(p.shape, dtype=torch.bool, device=device) for name, p in stepped.items()}
        if cuda:
            copy_in.wait_stream(compute)  # the gradients are complete

        def load(unit):
            name, _, a, b = unit
            state = self.state[name]
            with torch.cuda.stream(copy_in) if cuda else nullcontext():
                bufs = [t.view(-1)[a:b].to(device, non_blocking=True)
                        for t in (state.master, state.exp_avg, state.exp_avg_sq)]
            return bufs, copy_in.record_event() if cuda else None

        done: deque = deque()
        pending = load(units[0])
        for i, (name, param, a, b) in enumerate(units):
            bufs, loaded = pending
            while len(done) >= self.in_flight:  # bound the GPU memory held by units in flight
                done.popleft().synchronize()
            if i + 1 < len(units):
                pending = load(units[i + 1])
            if cuda:
                compute.wait_event(loaded)
            master, exp_avg, exp_avg_sq = bufs
            grad = param.grad.view(-1)[a:b].to(torch.float32)
            if grad_scale != 1.0:
                grad = grad * grad_scale
            adamw_step(master, grad, exp_avg, exp_avg_sq, step=self.step_count, lr=lr, beta1=self.cfg.beta1,
                       beta2=self.cfg.beta2, eps=self.cfg.eps, weight_decay=self.cfg.weight_decay)
            flat = param.detach().view(-1)[a:b]
            new = master.to(param.dtype)
            masks[name].view(-1)[a:b] = changed_bits(new, flat)
            flat.copy_(new)
            state = self.state[name]
            if cuda:
                stepped_event = compute.record_event()
                with torch.cuda.stream(copy_out):
                    copy_out.wait_event(stepped_event)
                    for host, buf in zip((state.master, state.exp_avg, state.exp_avg_sq), bufs, strict=True):
                        host.view(-1)[a:b].copy_(buf, non_blocking=True)
                        buf.record_stream(compute)
                        buf.record_stream(copy_out)
                    done.append(copy_out.record_event())
            else:
                for host, buf in zip((state.master, state.exp_avg, state.exp_avg_sq), bufs, strict=True):
                    host.view(-1)[a:b].copy_(buf)
        if cuda:
            copy_out.synchronize()  # host state complete before anyone reads it (checkpoints, the next step)
        return masks
