"""Programmatic dependent launch: each of the engine's kernels starts while the one before it finishes.

A decode step at 64 rows is about nine kernels a layer of a few microseconds each. Between two of them the GPU
drains the first, launches the second and ramps its loads up, ~1-2 us a boundary in which little reaches memory.
On Hopper and later, a kernel launched with programmatic stream serialization (Triton's ``launch_pdl``) may start
as soon as every program of the kernel before it has executed ``griddepcontrol.launch_dependents``; it must then
execute ``griddepcontrol.wait`` (which returns once the kernel before has completed and its writes are visible)
before it reads what that kernel or any earlier one wrote, and before it writes anything. CUDA graphs keep the
dependency (a programmatic edge).

Before its wait a kernel touches only what no kernel of the step writes, and only to bring it into L2 (``prefetch``):
the projections ask for their weight rows (the optimizer writes them between steps, never during one); every other
kernel waits first thing. After the wait a kernel signals its dependents (``wait``), so at most two kernels share
the GPU: the one running and the next one's programs waiting (a signal before the wait would let a chain of waiting
kernels take the room that the running one's later programs need).

Measured on an H200 (bench/results/h200/speed/pdl/, ``bench/engine.py --no-pdl``), 0.6B at 64 requests: 1.59 ms a
decode step without, 1.45-1.46 ms with; at 256 requests, 3.20-3.22 ms both ways; 1.7B at 64, 2.20 ms without and
2.11 with (2.20 before the prefetch was capped at ``triton_linear.PREFETCH_BYTES``). A prefetch of the decode
attention's first 128 keys' K/V rows before its wait (through the host-written block table) was slower at 256
(3.36 ms) and no faster at 64 (1.46 against 1.45), so the attention waits first thing like the rest.

``launch(tensor)`` is the launch keyword for a kernel on ``tensor``'s device: programmatic launch on CUDA devices of
compute capability 9.0 or later, unless ``UNISON_PDL=0`` (the benchmark's baseline); the kernels take the same
decision as their ``PDL`` constant, so a kernel launched without it compiles neither instruction.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device launch programmatically (see the module's docstring)."""
    return (not _INTERPRETED and x.is_cuda and os.environ.get("UNISON_PDL", "1") != "0"
            and _capability(x.device) >= (9, 0))


def launch(x: torch.Tensor) -> dict:
    """The launch keywords of a kernel on ``x``'s device: ``PDL`` (the kernel's constant) and ``launch_pdl``."""
    on = enabled(x)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before (its writes visible), then let the next kernel's programs start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch(ptrs, nbytes, PDL: tl.constexpr):
    """Ask L2 for ``nbytes`` (a multiple of 16) from each of ``ptrs`` (16-byte aligned), without waiting: one bulk
    prefetch (``cp.async.bulk.prefetch.L2``) per element."""
    if PDL:
        sizes = tl.zeros(ptrs.shape, tl.int32) + nbytes
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r", [ptrs, sizes],
                                  dtype=tl.int32, is_pure=False, pack=1)
