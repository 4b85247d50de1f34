"""How patches travel: a directory any fsspec URL names (a local path, ``s3://...``), or a ``torch.distributed``
process group that the trainer and the servers share (gloo on CPU, NCCL on GPU).

Directory: the trainer writes ``<version>.patch`` / ``<version>.anchor`` under a temporary name and renames it
into place, so a reader never sees half a file; a server that needs an anchor drops a file under
``requests/``, and the trainer answers with an anchor at its next sync. Process group: each sync the trainer
broadcasts the patch, every rank then reports (an all-reduce of flags) whether it needs an anchor, and if any
does the trainer broadcasts one at once: every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import uuid

import fsspec
import torch
import torch.distributed as dist

from .codec import Framed, Patch, frame
from .receiver import Receiver


class DirectoryPublisher:
    def __init__(self, url: str, keep: int = 16):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.keep = keep
        self.fs.makedirs(f"{self.root}/requests", exist_ok=True)

    def publish(self, blob: bytes, version: int, anchor: bool) -> str:
        path = f"{self.root}/{version:010d}.{'anchor' if anchor else 'patch'}"
        tmp = f"{self.root}/.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(blob)
        self.fs.mv(tmp, path)
        self._prune()
        return path

    def anchor_requested(self) -> bool:
        """Whether a server asked for an anchor since the last call (the requests are consumed)."""
        requests = self.fs.ls(f"{self.root}/requests", detail=False)
        for r in requests:
            self.fs.rm(r)
        return bool(requests)

    def _prune(self) -> None:
        files = sorted(p for p in self.fs.ls(self.root, detail=False) if p.endswith((".patch", ".anchor")))
        anchors = [p for p in files if p.endswith(".anchor")]
        keep = set(files[-self.keep:]) | set(anchors[-1:])  # the newest anchor always stays
        for p in files:
            if p not in keep:
                self.fs.rm(p)


class DirectorySubscriber:
    """Applies what the publisher wrote since the receiver's version; asks for an anchor when it needs one."""

    def __init__(self, url: str, receiver: Receiver, name: str = "server"):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.receiver = receiver
        self.name = name
        self.failed_at = -1  # the version of the last rejected file: only a newer anchor can repair that

    def poll(self) -> int:
        """Apply every new file in order; returns how many were applied."""
        entries = []
        try:
            listing = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:  # nothing published yet
            return 0
        for p in listing:
            stem, _, kind = p.rsplit("/", 1)[-1].partition(".")
            if kind in ("patch", "anchor") and stem.isdigit():
                entries.append((int(stem), kind == "anchor", p))
        entries.sort()
        applied = 0
        rec = self.receiver
        if rec.needs_anchor:
            anchors = [e for e in entries if e[1] and e[0] >= max(self.failed_at, rec.version, 0)]
            if not anchors or not self._apply(anchors[-1]):
                self._request_anchor()
                return applied
            applied += 1
        for entry in entries:
            if not entry[1] and entry[0] > rec.version:
                if not self._apply(entry):
                    self._request_anchor()
                    break
                applied += 1
        return applied

    def _apply(self, entry) -> bool:
        version, _, path = entry
        with self.fs.open(path, "rb") as f:
            ok = self.receiver.receive(f.read())
        if not ok:
            self.failed_at = max(self.failed_at, version)
        return ok

    def _request_anchor(self) -> None:
        self.fs.makedirs(f"{self.root}/requests", exist_ok=True)
        with self.fs.open(f"{self.root}/requests/{self.name}", "wb") as f:
            f.write(str(self.receiver.version).encode())


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
        """Take one sync round: apply the patch (``apply(blob)``, by default ``receiver.receive``), report whether an
        anchor is needed, apply it if one comes. False when the trainer closed the channel."""
        apply = apply or receiver.receive
        blob = self.broadcast(None)
        if blob is None:
            return False
        apply(blob)
        if self.anyone_needs_anchor(receiver.needs_anchor):
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
