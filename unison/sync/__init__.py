"""Weight sync for disaggregated generation: exact changed masks, sparse patches, transports, the receiver."""

from .codec import Patch, PatchError, anchor_patch, apply, checksum, decode, encode, sparse_patch
from .receiver import Receiver

__all__ = ["Patch", "PatchError", "Receiver", "anchor_patch", "apply", "checksum", "decode", "encode",
           "sparse_patch"]
