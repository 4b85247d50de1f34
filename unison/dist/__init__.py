"""Scaling out on PyTorch's own distributed runtime (torchrun, torch.distributed)."""
