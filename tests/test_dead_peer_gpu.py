"""A process of a two-GPU job that dies mid-run (run on the GPU machine: ``pytest -m gpu``): over NCCL the survivor
names the collective that timed out after ``dist.timeout_s`` and exits, under data parallel and under tensor parallel
(whose decode replays CUDA graphs with the all-reduces inside; the next collective torch issues is the one its
watchdog times out). torch then waits 60 s for its debug dump before it aborts the process."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch
from test_data_parallel import free_port, launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")]
PEERS = os.path.join(os.path.dirname(__file__), "peers")
PEER = os.path.join(PEERS, "train_peer.py")
TIMEOUT_S = 30


@pytest.mark.parametrize("layout", [[], ["--dist.tp=2"]], ids=["dp", "tp"])
def test_a_dead_process_fails_the_other_on_nccl(model_dir, tmp_path, layout):
    args = [sys.executable, PEER, model_dir, str(tmp_path / "run"), "--max_steps=100000",
            f"--dist.timeout_s={TIMEOUT_S}", "--rollout.max_new_tokens=64", "--step.max_tokens_per_row=128", *layout]
    port = free_port()
    procs = [launch(args, port, rank) for rank in range(2)]
    guard = threading.Timer(300, lambda: [p.kill() for p in procs])  # a hang fails the test below, not the session
    guard.daemon = True
    guard.start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size):  # a step logged: both are past start-up
        assert procs[0].poll() is None, procs[0].communicate()[0][-3000:]
        time.sleep(1)
    time.sleep(3)  # well into the run
    procs[1].kill()
    killed, named = time.time(), None
    for line in procs[0].stdout:
        if named is None and "Watchdog caught collective operation timeout" in line:
            named, work = time.time() - killed, line[line.find("WorkNCCL"):].strip()
    exited = time.time() - killed
    guard.cancel()
    print(f"{layout}: the survivor named the timed-out collective {named} s after the kill and exited "
          f"({procs[0].wait()}) after {exited:.0f} s")
    if named is not None:
        print(work)  # NumelIn=1: the heartbeat after a decode-graph replay
    assert procs[0].returncode != 0
    assert named is not None and named < TIMEOUT_S + 15
    assert exited < TIMEOUT_S + 60 + 30
