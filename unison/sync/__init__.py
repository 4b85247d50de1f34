"""Weight sync for disaggregated generation: exact changed masks, sparse patches, transports, the receiver."""

from .codec import Framed, Patch, PatchError, anchor_patch, apply, checksum, decode, encode, frame, sparse_patch
from .receiver import Receiver
from .validate import DivergedError, MissedVersionError

__all__ = ["DivergedError", "Framed", "MissedVersionError", "Patch", "PatchError", "Receiver", "anchor_patch", "apply",
           "checksum", "decode", "encode", "frame", "sparse_patch"]
