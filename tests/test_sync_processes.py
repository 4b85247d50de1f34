"""Trainer and server as two processes, over gloo and over a local directory: after every step's sync, with a
dropped, a corrupted, a stale (older base) and an out-of-bounds patch on the way, the server's weights are
bit-identical to the trainer's, and the patches carried only changed elements."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

PEERS = os.path.join(os.path.dirname(__file__), "peers")
PEER = os.path.join(PEERS, "sync_peer.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRANSPORTS = ["dist", "dir"]


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """One launch of the trainer and the server peers, syncing over each transport in turn: the folder holding
    ``<transport>/<role>.json``."""
    out = tmp_path_factory.mktemp("sync")
    port = free_port()
    procs = []
    for rank, role in enumerate(("trainer", "server")):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, PEER, role, str(out), str(out / "sync"), *TRANSPORTS],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        output, _ = p.communicate(timeout=240 * len(TRANSPORTS))
        assert p.returncode == 0, output[-3000:]
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_process_sync_survives_faults(transport, synced):
    trainer = json.loads((synced / transport / "trainer.json").read_text())
    server = json.loads((synced / transport / "server.json").read_text())
    assert server["checksums"] == trainer["checksums"]  # bit-identical, every tensor
    assert server["weights_valid"]
    counts = server["counts"]
    # Each fault was detected (the dropped one as a missed version, or over dist as an empty message) and repaired
    # by an anchor: the stale and the out-of-bounds patch too, which leave the receiver itself needing none.
    assert counts["rejected"] >= 4 and trainer["anchors_on_request"] >= 4
    assert counts["anchors"] >= 1 + 4
    # Only changed elements travelled, and they are a fraction of the model.
    assert trainer["sent_elements"] == trainer["changed_elements"] < 0.9 * trainer["total_elements"]
