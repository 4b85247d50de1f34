"""``sync.transport=fsspec``: a directory any fsspec URL names (a local path, ``s3://...``), that the trainer writes
and the servers poll.

The trainer writes ``<version>.patch`` / ``<version>.anchor`` under a temporary name and renames it into place, so a
reader never sees half a file (its restart anchor first clears what a previous run left); a server that needs an
anchor drops a file under ``requests/``, and the trainer answers with an anchor at its next sync.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import fsspec

from ..codec import Patch, encode, peek_metadata
from ..receiver import Receiver

log = logging.getLogger(__name__)


@dataclass
class FsspecConfig:
    url: str = ""
    """The directory (any fsspec URL: a local path, ``s3://bucket/dir``) the trainer writes patches to and the
    servers poll: the same on both sides."""


class DirectorySender:
    """The trainer's side: each patch a file, each server's anchor request a file under ``requests/``."""

    to_host = True

    def __init__(self, url: str, keep: int = 16):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.keep = keep
        self.fs.makedirs(f"{self.root}/requests", exist_ok=True)
        self.warned: set[str] = set()
        self.answered = False  # the newest file is an anchor: it answers the requests read next

    def send(self, patch: Patch) -> int:
        blob = encode(patch)
        self.publish(blob, patch.version, patch.anchor, restart=patch.restart)
        return len(blob)

    def needs_anchor(self) -> list[str]:
        """The servers that asked for an anchor since the last call (their requests are consumed); none right after
        an anchor, which answers them already."""
        requests = plain_files(self.fs, f"{self.root}/requests", self.warned)
        for r in requests:
            self._remove(r["name"])
        answered, self.answered = self.answered, False
        return [] if answered else [r["name"].rsplit("/", 1)[-1] for r in requests]

    def send_anchor(self, anchor: Patch, receivers: list[str]) -> int:
        """One anchor file, for every server that asked."""
        self.send(anchor)
        return 1

    def close(self) -> None:
        """Nothing to end: the files stay for a server that starts later."""

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
        self.answered = anchor
        return path

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


class DirectorySource:
    """Applies what the trainer wrote since the receiver's version; asks for an anchor when it needs one.

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


