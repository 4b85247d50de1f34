"""One side of a two-process weight sync (run by tests/test_sync_processes.py; not a test module).

    python tests/peers/sync_peer.py ROLE OUT URL TRANSPORT [TRANSPORT ...]     ROLE: trainer | server
                                                                               TRANSPORT: dist | dir

The trainer trains a bf16 tiny model for STEPS optimizer steps and syncs each step's changed elements through the
transport's Sender, with faults injected on the way (a dropped patch, corrupted bytes, a stale patch for an older
base version, an out-of-bounds index); the server starts from different weights, applies what its Source brings,
and asks for an anchor whenever it could not apply what the trainer sent (a refused patch leaves it behind, even
when the receiver itself needs no anchor for it).
Over ``dist`` the patches travel framed (tensors broadcast as they are), over ``dir`` as safetensors files.
At the end both write their parameters' checksums and counts to OUT/<transport>/<role>.json. The transports run one
after the other, each on fresh models (URL is the directory transport's folder): one launch for them all.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest and the test modules
from conftest import tiny_llama  # noqa: E402

from unison.sync import Framed, Patch, Receiver, anchor_patch, checksum, encode, frame, sparse_patch  # noqa: E402
from unison.sync.transports.directory import DirectorySender, DirectorySource  # noqa: E402
from unison.sync.transports.dist import DistSender, DistServeSyncConfig, DistSource, DistSyncConfig  # noqa: E402
from unison.train.optimizer import MasterAdamW, OptimConfig  # noqa: E402

STEPS = 8
FAULTS = {2: "drop", 4: "corrupt", 5: "base", 6: "bounds"}


def faulty(patch: Patch, kind: str | None, step: int, framed: bool) -> bytes | Framed | None:
    """The patch as the transport carries it, with the fault of this step."""
    if kind == "drop":
        return None
    if kind == "corrupt":
        if framed:  # bytes in the middle of the largest tensor
            f = frame(patch)
            parts = [part.clone() for part in f.parts]
            big = max(parts, key=lambda part: part.numel())
            big[big.numel() // 2:big.numel() // 2 + 16] = 0
            return Framed(f.header, parts)
        blob = encode(patch)
        return blob[: len(blob) // 2] + bytes(16) + blob[len(blob) // 2 + 16:]
    if kind == "base":
        patch.base_version = step - 2
    if kind == "bounds":
        name = next(iter(patch.indices))
        patch.indices[name] = patch.indices[name].clone()
        patch.indices[name][-1] = 10**9
    return frame(patch) if framed else encode(patch)


def wait_for_server(url: str, version: int, timeout: float = 30.0) -> None:
    """Until the server holds ``version``, or has polled since it was published and asked for an anchor (each
    poll leaves an acknowledgement: the version it holds and whether it wants an anchor)."""
    path = os.path.join(url, "ack")
    published = time.time()
    deadline = published + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                held, needs_anchor = f.read().split()
            if int(held) >= version and needs_anchor == "0":
                return
            if needs_anchor == "1" and os.path.getmtime(path) > published:
                return
        time.sleep(0.02)


def trainer(transport: str, out: str, url: str | None) -> dict:
    model = tiny_llama(dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=3e-3), total_steps=STEPS)
    sender = DistSender(DistSyncConfig(init_method()), 1, torch.device("cpu"), 120.0) if transport == "dist" else \
        DirectorySender(url)
    sent_elements = changed_elements = 0
    anchors = 0

    def deliver(blob, version: int, anchor: bool) -> None:
        """Put ``blob`` (as the transport carries it, maybe faulty; None: dropped) on the wire, then answer the anchor
        requests as the trainer's WeightPublisher does."""
        nonlocal anchors
        if transport == "dist":
            sender.channel.broadcast(b"" if blob is None else blob)  # a dropped patch: the server sees an empty message
        elif blob is None:
            return  # a dropped patch: nothing for the server to poll
        else:
            sender.publish(blob, version, anchor)
            wait_for_server(url, version)
        receivers = sender.needs_anchor()
        if receivers:
            anchors += sender.send_anchor(anchor_patch(params, version, to_host=sender.to_host), receivers)

    framed = transport == "dist"
    first = anchor_patch(params, 0)
    deliver(frame(first) if framed else encode(first), 0, anchor=True)  # the initial full sync
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (2, 16), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        patch = sparse_patch(params, opt.changed_masks, step - 1, step)
        sent_elements += patch.num_elements
        changed_elements += sum(int(m.sum()) for m in opt.changed_masks.values())
        deliver(faulty(patch, FAULTS.get(step), step, framed), step, anchor=False)
    if transport == "dir":
        wait_for_server(url, STEPS)
        receivers = sender.needs_anchor()
        if receivers:
            anchors += sender.send_anchor(anchor_patch(params, STEPS), receivers)
    sender.close()  # dist: ends the server's receive loop
    return {"checksums": {n: checksum(p) for n, p in params.items()}, "sent_elements": sent_elements,
            "changed_elements": changed_elements, "anchors_on_request": anchors,
            "total_elements": STEPS * sum(p.numel() for p in params.values())}


def server(transport: str, out: str, url: str | None) -> dict:
    model = tiny_llama(seed=1, dtype=torch.bfloat16)  # different weights: only the sync makes them equal
    receiver = Receiver(dict(model.named_parameters()))
    if transport == "dist":
        source = DistSource(DistServeSyncConfig(init_method(), rank=1, world_size=2), receiver, torch.device("cpu"))
        while source.thread.is_alive():  # until the trainer closes the group; its thread waits for each poll
            source.poll()
            time.sleep(0.005)
    else:
        os.makedirs(url, exist_ok=True)
        sub = DirectorySource(url, receiver)
        deadline = time.time() + 60
        while receiver.version < STEPS or receiver.needs_anchor:
            sub.poll()
            with open(os.path.join(url, ".ack"), "w") as f:
                f.write(f"{receiver.version} {int(sub.wants_anchor)}")
            os.replace(os.path.join(url, ".ack"), os.path.join(url, "ack"))
            time.sleep(0.05)
            if time.time() > deadline:
                break
    return {"checksums": {n: checksum(p) for n, p in model.named_parameters()}, "version": receiver.version,
            "counts": dict(receiver.counts), "weights_valid": receiver.weights_valid}


def init_method() -> str:
    """The process group's rendezvous, from the environment test_sync_processes.py gives both peers."""
    return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def main():
    role, out, url, *transports = sys.argv[1:]
    for transport in transports:
        result = (trainer if role == "trainer" else server)(transport, out, url if transport == "dir" else None)
        os.makedirs(os.path.join(out, transport), exist_ok=True)
        with open(os.path.join(out, transport, f"{role}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
