"""What a patch must satisfy before a receiver writes any of it, and the errors that say why one was refused.

Every check here runs before the first write, so a refused patch leaves the weights exactly as they were: the
metadata's types (a corrupted or hostile header must not reach the apply with a list where a mapping belongs), the
versions, each tensor's name, dtype and shape, the sparse indices' bounds and order, a checksum for every tensor the
patch touches, and finite values (an anchor of NaN weights with matching checksums used to be applied).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .codec import Patch

INDEX_DTYPES = {"gap16": torch.int16, "gap32": torch.int32, "int32": torch.int32, "int64": torch.int64}
_INT = re.compile(r"-?[0-9]{1,18}")


class PatchError(ValueError):
    """A patch refused before anything was written: the weights are as they were, and it alone needs no anchor."""


class MissedVersionError(PatchError):
    """A sparse patch for a version ahead of the receiver's: one went missing, and only an anchor catches up (the
    weights held are still the trainer's at the receiver's version)."""


class DivergedError(PatchError):
    """The weights do not match the trainer's: a checksum mismatch after the write (which is undone; the weights held
    had diverged, or the values were corrupted on the way: the two look alike), or a write that failed half-way."""


def read_metadata(meta: object, restart_optional: bool) -> tuple[int, int, bool, bool, dict, dict]:
    """(base_version, version, anchor, restart, checksums, index_encoding) from a patch's metadata (strings, as
    safetensors stores them), each checked for its type. ``restart_optional``: an older format, without the flag."""
    if not isinstance(meta, dict):
        raise PatchError(f"patch metadata is a {type(meta).__name__}, not a mapping")
    base, version = _int_field(meta, "base_version"), _int_field(meta, "version")
    anchor = _flag_field(meta, "anchor")
    restart = _flag_field(meta, "restart") if "restart" in meta or not restart_optional else False
    checksums, encodings = _str_map_field(meta, "checksums"), _str_map_field(meta, "index_encoding")
    unknown = sorted(set(encodings.values()) - INDEX_DTYPES.keys())
    if unknown:
        raise PatchError(f"unknown index encoding {unknown[0]!r} (known: {', '.join(INDEX_DTYPES)})")
    return base, version, anchor, restart, checksums, encodings


def _str_field(meta: dict, key: str) -> str:
    if key not in meta:
        raise PatchError(f"patch metadata has no {key!r}")
    if not isinstance(meta[key], str):
        raise PatchError(f"patch metadata {key!r} is a {type(meta[key]).__name__}, not a string")
    return meta[key]


def _int_field(meta: dict, key: str) -> int:
    value = _str_field(meta, key)
    if not _INT.fullmatch(value):
        raise PatchError(f"patch metadata {key!r} is {value[:40]!r}, not an integer")
    return int(value)


def _flag_field(meta: dict, key: str) -> bool:
    value = _str_field(meta, key)
    if value not in ("0", "1"):
        raise PatchError(f"patch metadata {key!r} is {value[:40]!r}, not '0' or '1'")
    return value == "1"


def _str_map_field(meta: dict, key: str) -> dict[str, str]:
    try:
        value = json.loads(_str_field(meta, key))
    except ValueError as e:
        raise PatchError(f"patch metadata {key!r} is not JSON: {e}") from e
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PatchError(f"patch metadata {key!r} must map names to strings, got a {type(value).__name__}")
    return value


def check_patch(params: dict[str, torch.Tensor], patch: Patch, version: int) -> None:
    """Raise a ``PatchError`` (``MissedVersionError`` for a version ahead) unless ``patch`` applies to ``params`` held
    at ``version``; nothing is written."""
    check_versions(patch, version)
    if not isinstance(patch.values, dict) or not isinstance(patch.indices, dict):
        raise PatchError("patch values and indices must be mappings of names to tensors")
    unknown = [n for n in patch.values if n not in params]
    if unknown:
        raise PatchError(f"patch names unknown tensors: {unknown[:3]}")
    if patch.anchor and set(patch.values) != set(params):
        raise PatchError(f"anchor covers {len(patch.values)} of {len(params)} tensors")
    stray = [n for n in patch.indices if n not in patch.values]
    if not patch.anchor and stray:
        raise PatchError(f"patch has indices without values for {stray[:3]}")
    checksums = patch.checksums if isinstance(patch.checksums, dict) else {}
    for name, values in patch.values.items():
        if not isinstance(values, torch.Tensor):
            raise PatchError(f"{name}: values are a {type(values).__name__}, not a tensor")
        target = params[name]
        if values.dtype != target.dtype:
            raise PatchError(f"{name}: patch dtype {values.dtype}, parameter dtype {target.dtype}")
        if patch.anchor:
            if tuple(values.shape) != tuple(target.shape):
                raise PatchError(f"{name}: anchor shape {tuple(values.shape)}, parameter {tuple(target.shape)}")
        else:
            _check_sparse(name, target, patch.indices.get(name), values)
        if not isinstance(checksums.get(name), str):
            raise PatchError(f"{name}: the patch carries no checksum for it")
        if values.dtype.is_floating_point and not bool(torch.isfinite(values).all()):
            raise PatchError(f"{name}: NaN or infinite values")


def check_versions(patch: Patch, version: int) -> None:
    """The versions' types and order: a sparse patch moves forward from exactly ``version``; an anchor never goes
    below ``version`` unless it is the trainer's restart anchor."""
    fields = (patch.base_version, patch.version, patch.anchor, patch.restart)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in fields[:2]) or \
            not all(isinstance(v, bool) for v in fields[2:]):
        raise PatchError(f"patch versions must be integers and its flags booleans, got {fields!r}")
    b, v = patch.base_version, patch.version
    if patch.anchor:
        if v < 0:
            raise PatchError(f"anchor for version {v}: versions start at 0")
        if v < version and not patch.restart:
            raise PatchError(f"anchor for version {v} would take the weights back from version {version} (only the "
                             "trainer's restart anchor may)")
        return
    if patch.restart:
        raise PatchError(f"patch {b} -> {v}: only an anchor can mark a restart")
    if b < 0 or v <= b:
        raise PatchError(f"patch {b} -> {v}: a sparse patch moves forward from a version >= 0")
    if b < version:
        raise PatchError(f"patch {b} -> {v} does not apply to version {version}: it is older (a stale patch)")
    if b > version:
        raise MissedVersionError(f"patch {b} -> {v} does not apply to version {version}: a version went missing")


def _check_sparse(name: str, target: torch.Tensor, idx: object, values: torch.Tensor) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64:
        raise PatchError(f"{name}: sparse indices must be an int64 tensor, got {getattr(idx, 'dtype', idx)!r}")
    if idx.dim() != 1 or values.dim() != 1:
        raise PatchError(f"{name}: sparse indices and values must be flat, got shapes {tuple(idx.shape)} and "
                         f"{tuple(values.shape)}")
    if idx.numel() != values.numel():
        raise PatchError(f"{name}: {idx.numel()} indices for {values.numel()} values")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= target.numel()):
        raise PatchError(f"{name}: index out of bounds [0, {target.numel()})")
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise PatchError(f"{name}: indices not strictly ascending")
    if not target.is_contiguous():
        raise PatchError(f"{name}: the parameter is not contiguous, so it cannot be patched in place")
