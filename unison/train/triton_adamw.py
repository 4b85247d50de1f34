"""The fp32-master AdamW step and its bf16 write-back as one Triton kernel each (``unison.train.adamw``).

PyTorch runs ``adamw_step`` as about ten elementwise kernels per tensor and ``write_back`` as three, each reading
and writing fp32 state: ~130 bytes of traffic per parameter, 55-80 ms a step for the Qwen3-0.6B and 1.7B shapes on
the H200, launch-bound at the small tensors (bench/results/h200/speed). These read each operand once and write each
result once (35 bytes per parameter). Same arithmetic in the same order, IEEE square root and division, no fused
multiply-adds: the result is torch's to within a rounding step of fp32 (tests/test_fused_train.py).
``MultiTensorStep`` runs both for every tensor of a step in one launch (``DeviceStore``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _adamw(g, p, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps):
    """One AdamW update of fp32 g (already scaled), master p and moments m, v: the new (p, m, v)."""
    p = p * decay
    m = m + one_minus_beta1 * (g - m)  # torch's lerp for a weight below 0.5
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    return p - step_size * tl.div_rn(m, denom), m, v


@triton.jit
def _bf16_bits(x):
    """bf16(x)'s bits (int16), rounded to nearest even in integer arithmetic (torch's rounding; a NaN, which a step
    with a non-finite gradient norm never makes, becomes 0x7FC0)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16, bitcast=True)


@triton.jit
def _adamw_kernel(MASTER, GRAD, EXP_AVG, EXP_AVG_SQ, n, grad_scale, decay, one_minus_beta1, beta2, one_minus_beta2,
                  step_size, bc2_sqrt, eps, BLOCK: tl.constexpr):
    """The scalars come from Python doubles rounded to fp32 once, as torch rounds its scalar arguments."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    p, m, v = _adamw(g, tl.load(MASTER + offs, mask=mask, other=0.0), tl.load(EXP_AVG + offs, mask=mask, other=0.0),
                     tl.load(EXP_AVG_SQ + offs, mask=mask, other=0.0), decay, one_minus_beta1, beta2,
                     one_minus_beta2, step_size, bc2_sqrt, eps)
    tl.store(MASTER + offs, p, mask=mask)
    tl.store(EXP_AVG + offs, m, mask=mask)
    tl.store(EXP_AVG_SQ + offs, v, mask=mask)


@triton.jit
def _write_back_kernel(MASTER, PARAM_BITS, CHANGED, n, BLOCK: tl.constexpr):
    """bf16(master) into the parameter's bits, and where those bits changed."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    new = _bf16_bits(tl.load(MASTER + offs, mask=mask, other=0.0))
    old = tl.load(PARAM_BITS + offs, mask=mask, other=0)
    tl.debug_barrier()  # every thread's read of the old bits before any thread's write (their layouts may differ)
    tl.store(PARAM_BITS + offs, new, mask=mask)
    tl.store(CHANGED + offs, (new != old).to(tl.uint8), mask=mask)


def covered(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: contiguous, one device."""
    return all(t.is_contiguous() and t.device == tensors[0].device for t in tensors)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               grad_scale: float, decay: float, beta1: float, beta2: float, step_size: float, bc2_sqrt: float,
               eps: float) -> None:
    """``unison.train.adamw.adamw_step`` in one pass, ``grad * grad_scale`` taken in fp32 from any float dtype."""
    n = master.numel()
    if not 0.5 < beta1 < 1.0:
        raise ValueError(f"the AdamW kernel follows torch's lerp for beta1 in (0.5, 1), got {beta1}")
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](master, grad, exp_avg, exp_avg_sq, n, grad_scale, decay, 1.0 - beta1,
                                             beta2, 1.0 - beta2, step_size, bc2_sqrt, eps, BLOCK=_BLOCK,
                                             num_warps=8, enable_fp_fusion=False)


def write_back(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``unison.train.adamw.write_back`` for a bf16 ``param``, in one pass."""
    if param.dtype != torch.bfloat16:
        raise ValueError(f"the write-back kernel takes bf16 parameters, not {param.dtype}")
    changed = torch.empty(param.shape, dtype=torch.bool, device=param.device)
    n = param.numel()
    _write_back_kernel[(triton.cdiv(n, _BLOCK),)](master, param.view(torch.int16), changed.view(torch.uint8), n,
                                                  BLOCK=_BLOCK, num_warps=8)
    return changed


# One launch for every tensor of a step: each program takes CHUNK elements of one tensor, found through a table.
# Per tensor, the single-tensor kernels above cost the host two launches, a mask allocation and a count; over the
# ~300 tensors of a Qwen3 model that kept the GPU idle ~57 of a 69 ms optimizer step (bench/results/h200/speed/host).
# Blocks of 1024 elements, one a program, 4 warps, every load issued before the arithmetic: 6.1 ms for Qwen3-0.6B's
# parameters on the H200 (3.1 TB/s at 32 bytes a parameter), against 9.3 ms with blocks of 2048, four a program,
# 8 warps and the parameter's old bits loaded after the update (bench/adamw_kernel.py; the same bits either way).
_MULTI_BLOCK = 1024
_CHUNK_BLOCKS = 1
_WARPS = 4
_COLUMNS = 7  # a tensor's row of the table: master, exp_avg, exp_avg_sq, param bits, mask offset, numel, first


@triton.jit
def _multi_tensor_block(grad, master, exp_avg, exp_avg_sq, param, changed, offs, n, grad_scale, decay,
                        one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, MASKED: tl.constexpr):
    """One block of one tensor: masked only at its end. With every block masked by an element count read at run
    time the kernel took 19 against 12.9 ms at 0.6B on the H200, likely its loads running an element at a time."""
    mask = offs < n if MASKED else None
    other = 0.0 if MASKED else None
    # Every load first, the parameter's old bits included: loaded after the update's arithmetic they waited a second
    # DRAM round trip per block.
    g = tl.load(grad + offs, mask=mask, other=other).to(tl.float32) * grad_scale
    old = tl.load(param + offs, mask=mask, other=0 if MASKED else None)
    p, m, v = _adamw(g, tl.load(master + offs, mask=mask, other=other), tl.load(exp_avg + offs, mask=mask, other=other),
                     tl.load(exp_avg_sq + offs, mask=mask, other=other), decay, one_minus_beta1, beta2,
                     one_minus_beta2, step_size, bc2_sqrt, eps)
    tl.store(master + offs, p, mask=mask)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    new = _bf16_bits(p)
    # Every thread's read of the old bits before any thread's write: the load and the store may map an element to
    # different threads (on the H200 a mask said "unchanged" where the bits had changed, without this barrier).
    tl.debug_barrier()
    tl.store(param + offs, new, mask=mask)
    tl.store(changed + offs, (new != old).to(tl.uint8), mask=mask)


@triton.jit
def _multi_tensor_kernel(TABLE, GRADS, OWNER, CHANGED, grad_scale, decay, one_minus_beta1, beta2, one_minus_beta2,
                         step_size, bc2_sqrt, eps, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
                         CHUNK_BLOCKS: tl.constexpr, COLUMNS: tl.constexpr):
    """``_adamw_kernel`` then ``_write_back_kernel`` on program pid's chunk of tensor OWNER[pid]. TABLE (int64,
    one row of COLUMNS per tensor): the addresses of its master, moments and bf16 parameter bits, its offset in
    CHANGED (uint8, every tensor's mask end to end), its element count, its first program. GRADS: the addresses of
    this step's gradients. Every address and offset is a multiple of 16 bytes (``MultiTensorStep`` checks)."""
    pid = tl.program_id(0)
    t = tl.load(OWNER + pid).to(tl.int64)
    row = TABLE + t * COLUMNS
    master = tl.multiple_of(tl.load(row + 0), 16).to(tl.pointer_type(tl.float32))
    exp_avg = tl.multiple_of(tl.load(row + 1), 16).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.multiple_of(tl.load(row + 2), 16).to(tl.pointer_type(tl.float32))
    param = tl.multiple_of(tl.load(row + 3), 16).to(tl.pointer_type(tl.int16))
    changed = CHANGED + tl.multiple_of(tl.load(row + 4), 16)
    n = tl.load(row + 5)
    first = tl.load(row + 6)
    grad_at = tl.multiple_of(tl.load(GRADS + t), 16)
    if GRAD_BF16:
        grad = grad_at.to(tl.pointer_type(tl.bfloat16))
    else:
        grad = grad_at.to(tl.pointer_type(tl.float32))
    for i in tl.static_range(CHUNK_BLOCKS):
        start = ((pid - first) * CHUNK_BLOCKS + i) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _multi_tensor_block(grad, master, exp_avg, exp_avg_sq, param, changed, offs, n, grad_scale, decay,
                                one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, MASKED=False)
        elif start < n:
            _multi_tensor_block(grad, master, exp_avg, exp_avg_sq, param, changed, offs, n, grad_scale, decay,
                                one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, MASKED=True)


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether ``MultiTensorStep`` takes these tensors: their addresses multiples of 16 bytes."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


class MultiTensorStep:
    """The one-launch step over a fixed list of tensors: ``masters``, ``moments`` and ``params`` keep their storage
    for the optimizer's life, so their table is built once; only the gradients' addresses are sent each step."""

    def __init__(self, masters: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 params: list[torch.Tensor]):
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        chunk = _MULTI_BLOCK * _CHUNK_BLOCKS
        programs = [triton.cdiv(n, chunk) for n in self.numels]
        if not aligned(*masters, *exp_avgs, *exp_avg_sqs, *params):
            raise ValueError("MultiTensorStep: every tensor must start at a multiple of 16 bytes")
        rows, self.offsets, offset, first = [], [], 0, 0
        for m, a, s, p, n, k in zip(masters, exp_avgs, exp_avg_sqs, params, self.numels, programs, strict=True):
            rows.append([m.data_ptr(), a.data_ptr(), s.data_ptr(), p.data_ptr(), offset, n, first])
            self.offsets.append(offset)
            offset, first = offset + -(-n // 16) * 16, first + k  # each mask 16-byte aligned in the buffer
        self.total = offset
        device = params[0].device
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.owner = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                             torch.tensor(programs)).to(device)
        self.programs = first
        self._pointers = tuple(t.data_ptr() for t in masters + exp_avgs + exp_avg_sqs + params)

    def matches(self, masters, exp_avgs, exp_avg_sqs, params) -> bool:
        return self._pointers == tuple(t.data_ptr() for t in masters + exp_avgs + exp_avg_sqs + params)

    def __call__(self, grads: list[torch.Tensor], scalars: dict[str, float]) -> list[torch.Tensor]:
        """Step every tensor (grads: one dtype, bf16 or fp32, contiguous, ``aligned``); returns each one's changed
        mask, views of one bool buffer whose other elements (the padding that aligns each mask) are False."""
        if not aligned(*grads):
            raise ValueError("MultiTensorStep: every gradient must start at a multiple of 16 bytes")
        device = self.table.device
        addresses = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64).to(device, non_blocking=True)
        changed = torch.zeros(self.total, dtype=torch.bool, device=device)
        beta1 = scalars["beta1"]
        if not 0.5 < beta1 < 1.0:
            raise ValueError(f"the AdamW kernel follows torch's lerp for beta1 in (0.5, 1), got {beta1}")
        _multi_tensor_kernel[(self.programs,)](
            self.table, addresses, self.owner, changed.view(torch.uint8), scalars["grad_scale"], scalars["decay"],
            1.0 - beta1, scalars["beta2"], 1.0 - scalars["beta2"], scalars["step_size"], scalars["bc2_sqrt"],
            scalars["eps"], GRAD_BF16=grads[0].dtype == torch.bfloat16, BLOCK=_MULTI_BLOCK, CHUNK_BLOCKS=_CHUNK_BLOCKS,
            COLUMNS=_COLUMNS, num_warps=_WARPS, enable_fp_fusion=False)
        return [changed[a:a + n].view(shape) for a, n, shape in zip(self.offsets, self.numels, self.shapes,
                                                                     strict=True)]
