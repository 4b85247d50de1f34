"""``sync.transport=dist``: a ``torch.distributed`` process group of the trainer (rank 0) and every server (NCCL on
GPUs, gloo otherwise).

Each sync the trainer broadcasts the patch, every rank then reports (an all-reduce of flags) whether it needs an
anchor (or refused what came: it is behind), and if any does the trainer broadcasts one at once: every rank issues
the same collectives in the same order. The trainer's ``close`` ends the servers' receive loops.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..codec import Framed, Patch, frame
from ..receiver import Receiver
from .base import Inbox

log = logging.getLogger(__name__)


@dataclass
class DistSyncConfig:
    init_method: str = ""
    """The process group's rendezvous, ``tcp://host:port`` on the trainer's host (rank 0): the same on every rank."""


@dataclass
class DistServeSyncConfig:
    init_method: str = ""
    """The trainer's sync.dist.init_method (``tcp://host:port`` on the trainer's host)."""
    rank: int = 1
    """This server's rank in the group (the trainer is 0; servers 1 .. N, in the order of its sync.servers)."""
    world_size: int = 2
    """The group's size: the trainer and every server (1 + the trainer's len(sync.servers))."""


def join(init_method: str, rank: int, world_size: int, device: torch.device,
         timeout: timedelta | None = None) -> DistChannel:
    """Join the process group (blocks until every rank has) and return its channel, on ``device`` if it is a GPU."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    return DistChannel(device=device if cuda else "cpu")


class DistSender:
    """The trainer's side, rank 0 of a group with each of its ``servers`` (constructing it blocks until they have
    all joined)."""

    to_host = False  # the patch goes from where the parameters are, device to device

    def __init__(self, cfg: DistSyncConfig, servers: int, device: torch.device, timeout_s: float):
        self.channel: DistChannel | None = join(cfg.init_method, 0, 1 + servers, device, timedelta(seconds=timeout_s))

    def send(self, patch: Patch) -> int:
        framed = frame(patch)
        self.channel.broadcast(framed)
        return framed.nbytes

    def needs_anchor(self) -> list[str]:
        """The all-reduce of the servers' flags: it says whether any needs an anchor, not which."""
        return ["a server of the process group"] if self.channel.anyone_needs_anchor(False) else []

    def send_anchor(self, anchor: Patch, receivers: list[str]) -> int:
        """Broadcast ``anchor`` to every rank: the ones that asked apply it."""
        self.channel.broadcast(frame(anchor))
        if self.channel.anyone_needs_anchor(False):
            raise RuntimeError("a server still needs an anchor after receiving one")
        return 1

    def close(self) -> None:
        """End the servers' receive loops and leave the process group."""
        if self.channel is not None:
            self.channel.close()
            dist.destroy_process_group()
            self.channel = None


class DistSource:
    """A server's side: a thread of its own joins the group as rank ``cfg.rank`` and takes each sync round, handing
    the patch to the engine thread (``poll`` applies it between engine steps) and answering the need-anchor
    all-reduce once it is applied. A refused patch asks for an anchor too: the trainer broadcast it, so this server
    is now behind. The thread leaves the group when the trainer closes it."""

    def __init__(self, cfg: DistServeSyncConfig, receiver: Receiver, device: torch.device):
        self.cfg, self.receiver, self.device = cfg, receiver, device
        self.inbox = Inbox(receiver)
        self.thread = threading.Thread(target=self._run, name="unison-sync", daemon=True)
        self.thread.start()

    def poll(self) -> int:
        return self.inbox.poll()

    def _run(self) -> None:
        channel = join(self.cfg.init_method, self.cfg.rank, self.cfg.world_size, self.device)
        while self._round(channel):
            pass
        dist.destroy_process_group()
        log.info("the trainer closed the sync channel at version %d", self.receiver.version)

    def _round(self, channel: DistChannel) -> bool:
        """One sync round: the patch, the flags, the anchor if anyone asked. False once the trainer closed."""
        blob = channel.broadcast(None)
        if blob is None:
            return False
        applied = self._apply(blob)
        if channel.anyone_needs_anchor(self.receiver.needs_anchor or not applied):
            self._apply(channel.broadcast(None))
            channel.anyone_needs_anchor(self.receiver.needs_anchor)
        return True

    def _apply(self, blob: bytes | Framed) -> bool:
        """Whether the engine thread applied ``blob`` (this thread waits for it)."""
        return self.inbox.put(blob).result()["applied"]


class DistChannel:
    """The wire of a process group: ``broadcast`` from rank ``src`` (bytes, or a patch device to device) and
    ``anyone_needs_anchor`` (an all-reduce of one flag per rank)."""

    def __init__(self, src: int = 0, group=None, device: torch.device | str = "cpu"):
        self.src, self.group, self.device = src, group, torch.device(device)

    def close(self) -> None:
        """Tell the receiving ranks that the sender is done: their ``broadcast`` returns None."""
        self.broadcast(None, closing=True)

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
