"""Weight patches: the elements one optimizer step changed.

A sparse patch holds, per changed tensor, the flat indices of its changed elements (ascending) and their new
values in the parameter's dtype; indices are stored as 16- or 32-bit gaps (the first one from -1; the unsigned
gaps kept as the bits of int16/int32) where those fit, else int32/int64 positions. An anchor holds every tensor
whole. Both carry the version they apply to, the version they produce, and a checksum of each tensor they touch as
it must be afterwards, so a receiver proves it holds the trainer's weights; an anchor may be marked as the trainer's
restart (the only patch that takes a receiver's version back). Keys: ``<name>.idx`` / ``<name>.val`` (sparse),
``<name>`` (anchor); the metadata says the rest.

Two framings of the same content: a safetensors file (``encode``: bytes, for directories, buckets and HTTP), and
``Framed`` (``frame``: a JSON header and each tensor's bytes where the patch lives), which the
``torch.distributed`` transport broadcasts device to device, never through host memory.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..bits import checksum
from .validate import INDEX_DTYPES, DivergedError, PatchError, check_patch, read_metadata

FORMAT = "unison-patch-3"  # 3 added the restart flag
_READABLE = {FORMAT: False, "unison-patch-2": True}  # format -> whether the restart flag may be absent (then false)


@dataclass
class Patch:
    base_version: int  # the version it applies to (-1 for an anchor: applies to any version up to its own)
    version: int  # the version it produces
    anchor: bool
    indices: dict[str, torch.Tensor] = field(default_factory=dict)  # int64 flat positions, ascending (sparse)
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # changed values (sparse) or whole tensors
    checksums: dict[str, str] = field(default_factory=dict)  # of each touched tensor after the patch
    restart: bool = False  # an anchor the trainer sent as it (re)started: accepted at any version, even a lower one

    @property
    def num_elements(self) -> int:
        return sum(v.numel() for v in self.values.values())


def sparse_patch(params: dict[str, torch.Tensor], masks: dict[str, torch.Tensor], base_version: int,
                 version: int, to_host: bool = True) -> Patch:
    """The elements of ``params`` where ``masks`` is true (the optimizer's changed masks), after the update; on the
    host, or where the parameters are (``to_host=False``, for ``frame``)."""
    patch = Patch(base_version, version, anchor=False)
    for name, mask in masks.items():
        flat = mask.reshape(-1)
        if not bool(flat.any()):
            continue
        idx = flat.nonzero().squeeze(1)
        values = params[name].detach().reshape(-1)[idx]
        patch.indices[name], patch.values[name] = (idx.cpu(), values.cpu()) if to_host else (idx, values)
        patch.checksums[name] = checksum(params[name])
    return patch


def anchor_patch(params: dict[str, torch.Tensor], version: int, to_host: bool = True, restart: bool = False) -> Patch:
    """Every tensor whole: host copies, or the parameters themselves (``to_host=False``: frame it at once).
    ``restart``: the trainer's first anchor of a run (or a resumed one), which receivers take at any version."""
    values = {n: p.detach().cpu().clone() if to_host else p.detach() for n, p in params.items()}
    return Patch(-1, version, anchor=True, values=values, checksums={n: checksum(p) for n, p in params.items()},
                 restart=restart)


@dataclass
class Framed:
    """A patch as the ``torch.distributed`` transport carries it: ``header`` (JSON: the metadata and each tensor's
    key, dtype and shape) and ``parts``, each tensor's bytes as a flat uint8 tensor, in the header's order. No
    concatenation: framing an anchor costs no memory (its parts are views of the parameters)."""
    header: bytes
    parts: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(part.numel() for part in self.parts)


def payload_nbytes(payload: bytes | Framed) -> int:
    """What a patch costs on the wire, in either framing."""
    return payload.nbytes if isinstance(payload, Framed) else len(payload)


def encode(patch: Patch) -> bytes:
    tensors, meta = _contents(patch)
    return st_save({k: v.cpu() for k, v in tensors.items()}, metadata=meta)


def frame(patch: Patch) -> Framed:
    """The patch's tensors as byte views where they live (no copy through host memory)."""
    tensors, meta = _contents(patch)
    entries = [[key, str(t.dtype).removeprefix("torch."), list(t.shape)] for key, t in tensors.items()]
    parts = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
    return Framed(json.dumps({"meta": meta, "tensors": entries}).encode(), parts)


def decode(payload: bytes | Framed) -> Patch:
    """Parse a patch (either framing); anything malformed is a ``PatchError`` (never a crash). Checked here: the
    metadata's fields and types, and that the tensors are the ones it names; ``apply`` checks the rest."""
    try:
        if isinstance(payload, Framed):
            meta, tensors = _unframe(payload)
        else:
            meta, tensors = _metadata(payload), st_load(payload)
        fmt = meta.get("format") if isinstance(meta, dict) else None
        if fmt not in _READABLE:
            raise PatchError(f"not a unison patch (format {fmt!r}, expected {FORMAT!r})")
        base, version, anchor, restart, checksums, encodings = read_metadata(meta, _READABLE[fmt])
        patch = Patch(base, version, anchor, checksums=checksums, restart=restart)
        if anchor:
            patch.values = tensors
            return patch
        expected = {f"{name}.{part}" for name in encodings for part in ("idx", "val")}
        if set(tensors) != expected:
            odd = sorted(set(tensors) ^ expected)
            raise PatchError(f"the tensors do not match the index encoding: {odd[:3]}")
        for name, encoding in encodings.items():
            patch.indices[name] = _decode_indices(tensors[f"{name}.idx"], encoding)
            patch.values[name] = tensors[f"{name}.val"]
        return patch
    except PatchError:
        raise
    except Exception as e:  # truncated or corrupted bytes, a missing key, bad JSON
        raise PatchError(f"unreadable patch: {type(e).__name__}: {e}") from e


def _contents(patch: Patch) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors under their keys, and the metadata, of either framing."""
    tensors, encodings = {}, {}
    for name, values in patch.values.items():
        if patch.anchor:
            tensors[name] = values.contiguous()
            continue
        encodings[name], tensors[f"{name}.idx"] = _encode_indices(patch.indices[name])
        tensors[f"{name}.val"] = values.contiguous()
    meta = {"format": FORMAT, "base_version": str(patch.base_version), "version": str(patch.version),
            "anchor": "1" if patch.anchor else "0", "restart": "1" if patch.restart else "0",
            "checksums": json.dumps(patch.checksums),
            "index_encoding": json.dumps(encodings)}
    return tensors, meta


_DTYPES = {name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", "float64", "int8", "uint8",
                                                     "int16", "int32", "int64")}


def _unframe(framed: Framed) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    header = json.loads(framed.header)
    if len(header["tensors"]) != len(framed.parts):
        raise PatchError(f"the header lists {len(header['tensors'])} tensors, {len(framed.parts)} arrived")
    tensors = {}
    for (key, dtype_name, shape), part in zip(header["tensors"], framed.parts, strict=True):
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise PatchError(f"{key}: unsupported dtype {dtype_name!r}")
        if not isinstance(key, str) or key in tensors:
            raise PatchError(f"tensor key {key!r} is not a string, or appears twice")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise PatchError(f"{key}: shape {shape!r} is not a list of sizes")
        if math.prod(shape) * dtype.itemsize != part.numel():
            raise PatchError(f"{key}: {dtype_name}{shape} does not fit the {part.numel()} bytes that arrived")
        tensors[key] = part.view(dtype).reshape(shape)
    return header["meta"], tensors


def peek_metadata(f) -> dict[str, str]:
    """The metadata of an encoded patch from the start of an open binary file, without reading its tensors."""
    head = f.read(8)
    if len(head) < 8:
        raise PatchError(f"unreadable patch: {len(head)} bytes")
    (size,) = struct.unpack("<Q", head)
    if size > 1 << 27:  # a safetensors header lists the tensors: megabytes at most
        raise PatchError(f"unreadable patch: a header of {size} bytes")
    try:
        return _metadata(head + f.read(size))
    except (ValueError, AttributeError) as e:  # not JSON, or not an object
        raise PatchError(f"unreadable patch header: {e}") from e


def _metadata(blob: bytes) -> dict[str, str]:
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + size])
    if not isinstance(header, dict):
        raise PatchError(f"unreadable patch: its header is a {type(header).__name__}")
    return header.get("__metadata__", {})


def _encode_indices(idx: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Ascending int64 positions -> (encoding, stored), where they are (host or device). Gaps below 2**16 / 2**32
    are stored as the low 16 / 32 bits (an integer cast wraps: the unsigned value's bits in int16 / int32)."""
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    top = int(gaps.max()) if gaps.numel() else 0
    if top < 2**16:
        return "gap16", gaps.to(torch.int16)
    if top < 2**32:
        return "gap32", gaps.to(torch.int32)
    if int(idx.max()) < 2**31:
        return "int32", idx.to(torch.int32)
    return "int64", idx.to(torch.int64)


def _decode_indices(stored: torch.Tensor, encoding: str) -> torch.Tensor:
    if encoding in INDEX_DTYPES and (stored.dim() != 1 or stored.dtype != INDEX_DTYPES[encoding]):
        raise PatchError(f"{encoding} indices must be flat {INDEX_DTYPES[encoding]}, got {stored.dtype}"
                         f"{tuple(stored.shape)}")
    if encoding in ("gap16", "gap32"):
        mask = 0xFFFF if encoding == "gap16" else 0xFFFFFFFF
        return torch.cumsum(stored.to(torch.int64) & mask, 0) - 1
    if encoding in ("int32", "int64"):
        return stored.to(torch.int64)
    raise PatchError(f"unknown index encoding {encoding!r}")


def apply(params: dict[str, torch.Tensor], patch: Patch, version: int) -> int:
    """Apply ``patch`` to ``params`` (held at ``version``) in place, all or nothing; returns the new version.

    Everything is checked before anything is written (``validate.check_patch``: versions, names, dtypes, shapes,
    index bounds and order, checksums present, finite values). An anchor's tensors are verified against its
    checksums before they replace the parameters; a sparse patch's after writing, and a mismatch is undone (the old
    values at the patched indices are restored). Every failure is a ``PatchError``: ``MissedVersionError`` for a
    version ahead of ``version``, ``DivergedError`` when the weights held are not the trainer's.
    """
    check_patch(params, patch, version)
    try:
        with torch.no_grad():
            (_write_anchor if patch.anchor else _write_sparse)(params, patch)
    except PatchError:
        raise
    except Exception as e:  # undone by _write_sparse; an anchor fails before writing or raises DivergedError
        raise PatchError(f"patch {patch.base_version} -> {patch.version} could not be applied (nothing changed): "
                         f"{type(e).__name__}: {e}") from e
    return patch.version


def _write_anchor(params: dict[str, torch.Tensor], patch: Patch) -> None:
    bad = [n for n, values in patch.values.items() if checksum(values) != patch.checksums[n]]
    if bad:
        raise PatchError(f"anchor for version {patch.version} does not match its own checksums: {bad[:3]} "
                         "(corrupted on the way)")
    try:
        for name, values in patch.values.items():
            params[name].copy_(values)
    except Exception as e:
        raise DivergedError(f"anchor for version {patch.version} failed half-way, the weights are mixed: "
                            f"{type(e).__name__}: {e}") from e


def _write_sparse(params: dict[str, torch.Tensor], patch: Patch) -> None:
    saved = []  # (flat parameter, indices, the values there before): what undoes the write
    try:
        for name, values in patch.values.items():
            flat = params[name].view(-1)
            idx = patch.indices[name].to(flat.device)
            saved.append((flat, idx, flat[idx]))  # advanced indexing copies
            flat[idx] = values.to(flat.device)
        bad = [n for n in patch.values if checksum(params[n]) != patch.checksums[n]]
    except BaseException:
        _restore(saved)
        raise
    if bad:
        _restore(saved)
        raise DivergedError(f"checksum mismatch after applying version {patch.version}: {bad[:3]} (undone: the "
                            "weights held had diverged from the trainer's, or the values were corrupted on the way)")


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    try:
        for flat, idx, old in reversed(saved):
            flat[idx] = old
    except Exception as e:
        raise DivergedError(f"could not undo a failed patch, the weights are mixed: {type(e).__name__}: {e}") from e
