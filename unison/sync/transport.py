"""How patches travel: a directory any fsspec URL names (a local path, ``s3://...``), or a ``torch.distributed``
process group that the trainer and the servers share (gloo on CPU, NCCL on GPU).

Directory: the trainer writes ``<version>.patch`` / ``<version>.anchor`` under a temporary name and renames it
into place, so a reader never sees half a file (its restart anchor first clears what a previous run left); a
server that needs an anchor drops a file under ``requests/``, and the trainer answers with an anchor at its next
sync. Process group: each sync the trainer broadcasts the patch, every rank then reports (an all-reduce of flags)
whether it needs an anchor (or refused what came: it is behind), and if any does the trainer broadcasts one at
once: every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import NamedTuple

import fsspec
import torch
import torch.distributed as dist

from .codec import Framed, Patch, frame, peek_metadata
from .receiver import Receiver

log = logging.getLogger(__name__)


class DirectoryPublisher:
    def __init__(self, url: str, keep: int = 16):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.keep = keep
        self.fs.makedirs(f"{self.root}/requests", exist_ok=True)
        self.warned: set[str] = set()

    def publish(self, blob: bytes, version: int, anchor: bool, restart: bool = False) -> str:
        """Write ``<version>.patch`` / ``.anchor``. ``restart`` (the trainer's first anchor): first remove what a
        previous run left, whose later versions would shadow this run's files (and outlive them in the prune)."""
        if restart:
            for entry in patch_files(self.fs, self.root, self.warned):
                self._remove(entry.path)
        path = f"{self.root}/{version:010d}.{'anchor' if anchor else 'patch'}"
        tmp = f"{self.root}/.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(blob)
        self.fs.mv(tmp, path)
        self._prune()
        return path

    def anchor_requested(self) -> bool:
        """Whether a server asked for an anchor since the last call (the requests are consumed)."""
        requests = plain_files(self.fs, f"{self.root}/requests", self.warned)
        for r in requests:
            self._remove(r["name"])
        return bool(requests)

    def _prune(self) -> None:
        files = [e.path for e in patch_files(self.fs, self.root, self.warned)]
        anchors = [p for p in files if p.endswith(".anchor")]
        keep = set(files[-self.keep:]) | set(anchors[-1:])  # the newest anchor always stays
        for p in files:
            if p not in keep:
                self._remove(p)

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm(path)
        except OSError as e:  # gone already (another reader), or not ours to remove
            warn_once(self.warned, path, "cannot remove %s: %s", path, e)


class PatchFile(NamedTuple):
    version: int
    anchor: bool
    path: str
    stamp: object  # changes when the file is rewritten: its modification time (or ETag, or size)


def warn_once(warned: set[str], key: str, msg: str, *args) -> None:
    """Log a warning about ``key`` the first time only: a bad entry is seen at every poll."""
    if key not in warned:
        warned.add(key)
        log.warning(msg, *args)


def listing(fs, folder: str) -> list[dict]:
    """``fs.ls`` details of ``folder``; empty when it does not exist (yet)."""
    try:
        return fs.ls(folder, detail=True)
    except FileNotFoundError:
        return []


def plain_files(fs, folder: str, warned: set[str]) -> list[dict]:
    """The files in ``folder``; anything else there is skipped with one warning."""
    files = []
    for entry in listing(fs, folder):
        if _is_file(entry, warned):
            files.append(entry)
    return files


def patch_files(fs, root: str, warned: set[str]) -> list[PatchFile]:
    """The ``<version>.patch`` / ``<version>.anchor`` files under ``root``, by version (a patch before the anchor of
    the same version). Something else named so (a folder ``0000000003.patch/`` made every poll fail) is skipped with
    one warning."""
    found = []
    for entry in listing(fs, root):
        stem, _, kind = entry["name"].rsplit("/", 1)[-1].partition(".")
        if kind in ("patch", "anchor") and stem.isdigit() and _is_file(entry, warned):
            stamp = entry.get("mtime") or entry.get("LastModified") or entry.get("ETag") or entry.get("size")
            found.append(PatchFile(int(stem), kind == "anchor", entry["name"], stamp))
    return sorted(found, key=lambda e: (e.version, e.anchor, e.path))


def _is_file(entry: dict, warned: set[str]) -> bool:
    if entry.get("type", "file") == "file":
        return True
    warn_once(warned, entry["name"], "skipping %s in the sync directory: a %s, not a file", entry["name"],
              entry.get("type"))
    return False


class DirectorySubscriber:
    """Applies what the publisher wrote since the receiver's version; asks for an anchor when it needs one.

    A file the receiver refused is not read again unless it is rewritten (a new modification stamp); one that
    cannot be read (permissions, gone between the listing and the read) is retried at each poll, and an anchor asked
    for meanwhile; something else named like a patch (a folder) is skipped. Each is warned about once: ``poll`` never
    raises for a bad entry. The anchor request is rewritten at most every ``request_every_s`` seconds while the
    version it reports stays the same (a waiting server rewrote it 200 times in 2 s)."""

    def __init__(self, url: str, receiver: Receiver, name: str = "server", request_every_s: float = 5.0):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.receiver = receiver
        self.name = name
        self.request_every_s = request_every_s
        self.failed_at = -1  # the version of the last file not applied: only an anchor at least as new repairs that
        self.refused: dict[str, object] = {}  # path -> stamp of the files the receiver refused
        self.listed: dict[str, object] = {}  # path -> stamp at the previous poll: what is new (a restart anchor)
        self.warned: set[str] = set()
        self.requested: tuple[int, float] | None = None  # (version reported, monotonic time) of the last request

    @property
    def wants_anchor(self) -> bool:
        """The receiver needs an anchor, or a file it could not apply left it behind the trainer."""
        return self.receiver.needs_anchor or self.failed_at > self.receiver.version

    def poll(self) -> int:
        """Apply every new file in order; returns how many were applied."""
        try:
            files = patch_files(self.fs, self.root, self.warned)
        except OSError as e:  # the directory itself: unreadable for now
            warn_once(self.warned, self.root, "cannot list the sync directory %s: %s", self.root, e)
            return 0
        applied = 0
        anchor = self._anchor_to_apply([e for e in files if e.anchor])
        if anchor is not None and self._apply(anchor):
            applied += 1
            self.failed_at = -1  # what failed before the anchor no longer matters (a restart's may lie ahead)
        for entry in files:
            if entry.anchor or entry.version <= self.receiver.version:
                continue
            if self.receiver.needs_anchor or self.refused.get(entry.path) == entry.stamp or not self._apply(entry):
                break  # the patches after a refused one cannot apply either
            applied += 1
        if self.wants_anchor:
            self._request_anchor()
        self.listed = {e.path: e.stamp for e in files}
        self.refused = {p: s for p, s in self.refused.items() if self.listed.get(p) == s}
        return applied

    def _anchor_to_apply(self, anchors: list[PatchFile]) -> PatchFile | None:
        rec = self.receiver
        if self.wants_anchor:
            usable = [e for e in anchors if e.version >= max(self.failed_at, rec.version, 0)
                      and self.refused.get(e.path) != e.stamp]
            if usable:
                return usable[-1]
        # A restart anchor (the trainer started again, maybe at a lower version) is new since the last poll.
        for entry in reversed(anchors):
            if self.listed.get(entry.path) != entry.stamp and entry.version <= rec.version and self._is_restart(entry):
                return entry
        return None

    def _is_restart(self, entry: PatchFile) -> bool:
        try:
            with self.fs.open(entry.path, "rb") as f:
                meta = peek_metadata(f)
            return isinstance(meta, dict) and meta.get("restart") == "1"
        except Exception as e:  # OSError, PatchError, or a storage backend's own error type
            warn_once(self.warned, entry.path, "cannot read the header of %s: %s", entry.path, e)
            return False

    def _apply(self, entry: PatchFile) -> bool | None:
        """Whether the receiver applied the file; None when it could not be read (tried again at the next poll)."""
        try:
            with self.fs.open(entry.path, "rb") as f:
                blob = f.read()
        except Exception as e:  # OSError, or a storage backend's own error type: never a failed poll
            warn_once(self.warned, entry.path, "cannot read %s (retried at each poll): %s", entry.path, e)
            self.failed_at = max(self.failed_at, entry.version)
            return None
        ok = self.receiver.receive(blob)
        if not ok:
            self.failed_at = max(self.failed_at, entry.version)
            self.refused[entry.path] = entry.stamp
        return ok

    def _request_anchor(self) -> None:
        version, now = self.receiver.version, time.monotonic()
        if self.requested and self.requested[0] == version and now - self.requested[1] < self.request_every_s:
            return  # asked already: a server waiting for an anchor used to rewrite its request 100 times a second
        self.requested = (version, now)
        try:
            self.fs.makedirs(f"{self.root}/requests", exist_ok=True)
            with self.fs.open(f"{self.root}/requests/{self.name}", "wb") as f:
                f.write(str(version).encode())
        except OSError as e:
            warn_once(self.warned, f"{self.root}/requests", "cannot ask for an anchor under %s/requests: %s",
                      self.root, e)


class DistChannel:
    """One sync round over a process group: ``send`` on the trainer (rank ``src``), ``receive`` on every server.
    ``close`` (trainer) ends the servers' receive loops."""

    def __init__(self, src: int = 0, group=None, device: torch.device | str = "cpu"):
        self.src, self.group, self.device = src, group, torch.device(device)

    def send(self, blob: bytes | Patch | Framed, anchor=None) -> bool:
        """Broadcast ``blob`` (a patch goes device to device); if any server then needs an anchor, broadcast
        ``anchor`` (bytes or a patch, or a callable producing one). Returns whether an anchor was sent."""
        self.broadcast(blob)
        if not self.anyone_needs_anchor(False):
            return False
        self.broadcast(anchor() if callable(anchor) else anchor)
        if self.anyone_needs_anchor(False):
            raise RuntimeError("a server still needs an anchor after receiving one")
        return True

    def close(self) -> None:
        self.broadcast(None, closing=True)

    def receive(self, receiver: Receiver, apply=None) -> bool:
        """Take one sync round: apply the patch (``apply(blob)``, by default ``receiver.receive``: whether it was
        applied), report whether an anchor is needed, apply it if one comes. A refused patch asks for one too: the
        trainer broadcast it, so this server is now behind. False when the trainer closed the channel."""
        apply = apply or receiver.receive
        blob = self.broadcast(None)
        if blob is None:
            return False
        applied = apply(blob)
        if self.anyone_needs_anchor(receiver.needs_anchor or applied is False):
            apply(self.broadcast(None))
            self.anyone_needs_anchor(receiver.needs_anchor)
        return True

    def broadcast(self, payload: bytes | Patch | Framed | None, closing: bool = False) -> bytes | Framed | None:
        """The sender (rank ``src``) passes ``payload``, the others None; every rank returns what was sent: bytes,
        or a patch as ``Framed`` with its parts on this channel's device (moved device to device, one tensor at a
        time: NCCL on GPUs). None once the sender closed the channel.

        On the wire: [kind, number of parts], the parts' lengths, then each part; bytes are one part, a framed
        patch its header and then its tensors."""
        sending = payload is not None
        if isinstance(payload, Patch):
            payload = frame(payload)
        framed = isinstance(payload, Framed)
        if framed:
            parts = [self._tensor(payload.header), *(part.to(self.device) for part in payload.parts)]
        else:
            parts = [self._tensor(payload)] if sending else []
        head = torch.tensor([-1 if closing else int(framed), len(parts)], dtype=torch.int64, device=self.device)
        dist.broadcast(head, self.src, group=self.group)
        kind, count = head.tolist()
        if kind < 0:
            return None
        lengths = torch.tensor([part.numel() for part in parts] if sending else [0] * count, dtype=torch.int64,
                               device=self.device)
        dist.broadcast(lengths, self.src, group=self.group)
        if not sending:
            parts = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in lengths.tolist()]
        for part in parts:
            if part.numel():
                dist.broadcast(part, self.src, group=self.group)
        if sending:
            return payload
        if kind == 1:
            return Framed(parts[0].cpu().numpy().tobytes(), parts[1:])
        return parts[0].cpu().numpy().tobytes()

    def _tensor(self, blob: bytes) -> torch.Tensor:
        t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        return t.to(self.device)

    def anyone_needs_anchor(self, mine: bool) -> bool:
        flag = torch.tensor([int(mine)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
