"""Device memory at a fixed virtual address whose physical backing can be given back and taken again.

CUDA's virtual memory management (through ``cuda-bindings``): reserve an address range once, map physical
memory into it, unmap and release the physical memory to lend it out, map fresh physical memory at the same
addresses to take it back. Tensors viewing the range and CUDA graphs captured on it stay valid across a
release/map cycle; the contents do not survive it.
"""

from __future__ import annotations

import torch


def available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class VirtualBuffer:
    """``nbytes`` (rounded up to the allocation granularity) of device memory at a fixed address."""

    def __init__(self, nbytes: int, device: torch.device):
        from cuda.bindings import driver as drv

        self._drv = drv
        torch.cuda.init()
        self.device_index = torch.device(device).index
        if self.device_index is None:
            self.device_index = torch.cuda.current_device()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        self._prop = prop
        granularity = _check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self.nbytes = -(-nbytes // granularity) * granularity
        self.address = int(_check(drv.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
        self._handle = None
        self.map()

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the range with fresh physical memory (contents undefined)."""
        if self._handle is not None:
            return
        drv = self._drv
        handle = _check(drv.cuMemCreate(self.nbytes, self._prop, 0))
        _check(drv.cuMemMap(self.address, self.nbytes, 0, handle, 0))
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(drv.cuMemSetAccess(self.address, self.nbytes, [access], 1))
        self._handle = handle

    def unmap(self) -> None:
        """Give the physical memory back to the device; the addresses stay reserved."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device_index)  # nothing may still be reading or writing it
        _check(self._drv.cuMemUnmap(self.address, self.nbytes))
        _check(self._drv.cuMemRelease(self._handle))
        self._handle = None

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``dtype`` over the whole range (it does not own the memory)."""
        class _Interface:
            __cuda_array_interface__ = {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False),
                                        "version": 3}
        flat = torch.as_tensor(_Interface(), device=f"cuda:{self.device_index}")
        return flat.view(dtype)

    def __del__(self):
        try:
            if self._handle is not None:
                self._drv.cuMemUnmap(self.address, self.nbytes)
                self._drv.cuMemRelease(self._handle)
            self._drv.cuMemAddressFree(self.address, self.nbytes)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


class LendableBuffer:
    """``numel`` zeroed elements of ``dtype`` that can be given back to the device and taken again, contents lost (the
    engine's KV and state pools, lent to the training step): CUDA virtual memory at a fixed address where
    ``cuda-bindings`` is installed, else a tensor whose storage is resized to nothing and back."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        device = torch.device(device)
        self._vmm = VirtualBuffer(numel * dtype.itemsize, device) if available(device) else None
        self.storage = self._vmm.tensor(dtype)[:numel] if self._vmm is not None else \
            torch.zeros(numel, dtype=dtype, device=device)
        self.storage.zero_()
        self.nbytes = numel * dtype.itemsize
        self.released = False

    @property
    def fixed_address(self) -> bool:
        return self._vmm is not None

    def release(self) -> int:
        """Give the memory back to the device. Returns the bytes released (0 if already released)."""
        if self.released:
            return 0
        if self._vmm is not None:
            self._vmm.unmap()
        else:
            self.storage.untyped_storage().resize_(0)
        self.released = True
        return self.nbytes

    def restore(self) -> bool:
        """Take the memory again, zeroed. Returns whether every address is what it was before ``release()``."""
        if not self.released:
            return True
        if self._vmm is not None:
            self._vmm.map()
        else:
            self.storage.untyped_storage().resize_(self.nbytes)
        self.storage.zero_()
        self.released = False
        return self._vmm is not None


class LendsMemory:
    """A pool whose tensors all view one ``LendableBuffer``, ``self._memory``: lent and taken back as a whole."""

    _memory: LendableBuffer

    @property
    def nbytes(self) -> int:
        return self._memory.nbytes

    @property
    def fixed_address(self) -> bool:
        return self._memory.fixed_address

    @property
    def released(self) -> bool:
        return self._memory.released

    def release(self) -> int:
        """Give the pool's memory back to the device. Returns the bytes released."""
        return self._memory.release()

    def restore(self) -> bool:
        """Take the memory again, zeroed. Returns whether every address is what it was before ``release()``."""
        return self._memory.restore()
