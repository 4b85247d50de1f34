"""The two sides of a weight transport: the trainer's ``Sender``, a server's ``Source``.

Each sync is one round on the trainer (``WeightPublisher`` keeps the policy: sparse or full, when to anchor)::

    nbytes = sender.send(patch)                  # every receiver gets the patch, or can read it
    receivers = sender.needs_anchor()            # who asked for an anchor, or refused what came
    if receivers:
        sender.send_anchor(anchor, receivers)    # at once: a process group's ranks wait for it

and on a server the engine thread calls ``source.poll()`` between engine steps, never during one. A source
applies what arrived itself, through the receiver it was built with, rather than handing a patch back: every
transport acts on each outcome (the HTTP reply, the directory's refused files, the process group's need-anchor
all-reduce).
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Future
from typing import Protocol

from ..codec import Framed, Patch
from ..receiver import Receiver

log = logging.getLogger(__name__)


class Sender(Protocol):
    to_host: bool
    """Whether patches are built from host copies (False: the transport carries the parameters' own tensors)."""

    def send(self, patch: Patch) -> int:
        """Deliver ``patch`` to every receiver (``patch.restart``: the run's first anchor); returns its bytes on the
        wire."""

    def needs_anchor(self) -> list[str]:
        """The receivers that need an anchor after the last ``send``: they asked for one, or refused what came."""

    def send_anchor(self, anchor: Patch, receivers: list[str]) -> int:
        """Deliver ``anchor`` to ``receivers``; returns how many anchors went out."""

    def close(self) -> None:
        """End the run's sync: the receivers that wait for the next round stop waiting."""


class Source(Protocol):
    def poll(self) -> int:
        """Apply what arrived since the last poll, on the calling thread; returns how many patches were applied."""


class Inbox:
    """Patches other threads hand over (an HTTP handler, the process group's receive thread), applied in order when
    the engine thread polls. Each ``put`` returns a future of the receiver's reply right after that patch
    (``{"applied", "version", "needs_anchor", "error"}``), or of the exception that applying it raised."""

    def __init__(self, receiver: Receiver):
        self.receiver = receiver
        self.queue: queue.Queue[tuple[bytes | Framed, Future]] = queue.Queue()

    def put(self, blob: bytes | Framed) -> Future:
        future: Future = Future()
        self.queue.put((blob, future))
        return future

    def poll(self) -> int:
        applied = 0
        while True:
            try:
                blob, future = self.queue.get_nowait()
            except queue.Empty:
                return applied
            try:
                ok = self.receiver.receive(blob)
            except Exception as e:  # the receiver's own checks raise nothing: answer this patch, keep serving
                log.exception("applying a weight update failed")
                future.set_exception(e)
                continue
            applied += ok
            future.set_result(self._reply(ok))  # read now: the next patch changes the receiver

    def _reply(self, applied: bool) -> dict:
        r = self.receiver
        return {"applied": applied, "version": r.version, "needs_anchor": r.needs_anchor,
                "error": None if applied else r.last_error}
