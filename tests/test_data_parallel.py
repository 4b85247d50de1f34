"""Data parallel over gloo: two replicas make the update one process makes on the same global batch, and the
sharded optimizer, its state on the device or in host memory, gives the same parameters as the replicated one."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_llama
from peers.dp_peer import STEPS, step_samples

from unison.dist.data_parallel import assign_owners
from unison.dist.runtime import split_ready
from unison.train.loss import LossConfig
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.step import train_step

PEERS = os.path.join(os.path.dirname(__file__), "peers")
PEER = os.path.join(PEERS, "dp_peer.py")


def test_two_replicas_equal_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, PEER, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    model = tiny_llama()  # one process, the whole global batch
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0), STEPS)
    norms = [train_step(model, opt, step_samples(step), LossConfig(), 1.0, 64, 0, 16)["optim/grad_norm"]
             for step in range(STEPS)]
    single = dict(model.named_parameters())
    assert min(norms) > 0  # the loss really trains (no token dropped by the importance-sampling bounds)
    for r in ranks:  # the summed gradient is the one-process gradient, scale included (AdamW would hide a scale)
        assert r["replicated"]["grad_norms"] == r["sharded"]["grad_norms"]
        assert r["host"]["grad_norms"] == r["sharded"]["grad_norms"]
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["uneven"]["grad_norms"], norms, strict=True))
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(r["replicated"]["grad_norms"], norms, strict=True))
    start = dict(tiny_llama().named_parameters())
    for name, p in single.items():
        for r in ranks:
            # The replicas agree exactly; with one process, up to fp32 summation order.
            assert torch.equal(r["replicated"]["params"][name], ranks[0]["replicated"]["params"][name]), name
            torch.testing.assert_close(r["replicated"]["params"][name], p.detach(), rtol=1e-5, atol=1e-6)
            # Sharding the optimizer state changes nothing, bit for bit.
            assert torch.equal(r["sharded"]["params"][name], r["replicated"]["params"][name]), name
            assert torch.equal(r["host"]["params"][name], r["sharded"]["params"][name]), name  # and host placement
            # Uneven shares of the same samples (replicas that agreed on ready counts) make the same update too,
            # up to AdamW turning fp32 summation noise into a few % of a step where a gradient is ~0 (as in the
            # tensor-parallel test); a wrong gradient or scale moves elements by a whole step (lr 1e-3).
            torch.testing.assert_close(r["uneven"]["params"][name], p.detach(), rtol=0, atol=1e-4)
    assert any(not torch.equal(p.detach(), start[n]) for n, p in single.items())  # the steps did move them


@pytest.fixture(scope="module")
def ready_peers(tmp_path_factory):
    """One two-replica launch of ``peers/ready_peer.py`` through its three reward modes: ``(folder, outputs)``,
    ``folder/<mode>/rank<r>.json`` each replica's result of a mode and ``outputs`` what the two processes printed."""
    out = tmp_path_factory.mktemp("ready")
    port = free_port()
    procs = [launch([sys.executable, os.path.join(PEERS, "ready_peer.py"), str(out), "both_score", "one_scores",
                     "none_score"], port, rank) for rank in range(2)]
    runs = [(p.returncode, log) for p in procs for log, _ in [p.communicate(timeout=300)]]
    for code, log in runs:
        assert code == 0, log[-3000:]
    return out, [log for _, log in runs]


def ready_results(folder, mode: str) -> list[dict]:
    return [json.loads((folder / mode / f"rank{r}.json").read_text()) for r in range(2)]


def test_replicas_agree_on_when_to_train(ready_peers):
    """A replica that scores samples faster trains more of each step's samples; every step has exactly
    samples_per_step between the replicas, and both took part in the same number of agreements (no hang)."""
    fast, slow = ready_results(ready_peers[0], "both_score")
    assert [a + b for a, b in zip(fast["shares"], slow["shares"], strict=True)] == [16] * 4
    assert sum(fast["shares"]) > 2 * sum(slow["shares"]) > 0
    assert fast["calls"] == slow["calls"] >= 4


def test_replicas_without_signal(ready_peers):
    """A replica whose groups carry no signal (a constant reward) trains nothing while the other supplies every
    step; when no replica has any, every one stops with the same error at an agreement, none waits for the rest."""
    folder, logs = ready_peers
    scoring, silent = ready_results(folder, "one_scores")
    assert scoring["shares"] == [16] * 4 and silent["shares"] == [0] * 4
    stopped = ready_results(folder, "none_score")
    errors = [re.findall(r"RuntimeError: (data-parallel replicas \[[\d, ]+\] can produce no samples.*)",
                         r.get("error", "")) for r in stopped]
    assert errors[0] and errors[0] == errors[1], stopped
    assert stopped[0]["calls"] == stopped[1]["calls"]  # both stopped at the same agreement
    assert any("two passes over the prompts gave no batch" in log for log in logs)  # the stuck one says why


def test_split_ready():
    assert split_ready([10, 10], 16) == [8, 8]
    assert split_ready([3, 20], 16) == [3, 13]  # short of an even share: the others make up the rest
    assert split_ready([0, 16, 4], 16) == [0, 12, 4]
    assert split_ready([7, 8], 16) is None
    for counts in ([5, 1, 30, 2], [9, 9, 9, 9], [0, 0, 40, 1]):
        shares = split_ready(counts, 24)
        assert sum(shares) == 24 and all(0 <= s <= c for s, c in zip(shares, counts, strict=True))


def test_owners_balance_the_elements():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([100, 90, 50, 40, 30, 10, 5])]
    owners = assign_owners(params, 3)
    load = [sum(p.numel() for n, p in params if owners[n] == r) for r in range(3)]
    assert sorted(owners.values()) != [0] * 7 and max(load) - min(load) <= 30


def launch(args: list[str], port: int, rank: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_replicas_train(model_dir, tmp_path):
    """Two replicas, first as `torchrun --nnodes 2` of one process each over loopback (two "nodes": LOCAL_RANK is 0
    on both, only the global rank tells them apart), then resumed as `--nproc-per-node 2`: each replica rolls out its
    share, the main rank alone writes metrics and the checkpoint, every replica its optimizer shard, and the replicas
    end with identical parameters (checked inside the run)."""
    out = tmp_path / "run"
    port = free_port()
    peer = os.path.join(PEERS, "train_peer.py")
    nodes = [launch([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                     f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", peer, model_dir,
                     str(out), "--save_every=2"], port) for node in range(2)]
    for proc in nodes:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["train/loss_tokens"] > 0 and r["optim/changed_frac"] > 0 for r in records)
    assert (out / "checkpoint" / "model.safetensors").exists()
    # Each replica saved its optimizer shard; a resumed job picks them up and finishes the run.
    ckpt = out / "checkpoint-2"
    assert {p.name for p in ckpt.glob("trainer_state-rank*.pt")} == {"trainer_state-rank0.pt", "trainer_state-rank1.pt"}
    resumed = tmp_path / "resumed"
    proc = launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
                   peer, model_dir, str(resumed), f"--resume={ckpt}"], port)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    assert [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()] == [3]


def test_a_dead_replica_fails_the_others_instead_of_hanging(model_dir, tmp_path):
    port = free_port()
    peer = os.path.join(PEERS, "train_peer.py")
    args = [sys.executable, peer, model_dir, str(tmp_path / "run"), "--max_steps=500", "--dist.timeout_s=30"]
    procs = [launch(args, port, rank) for rank in range(2)]
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 240
    while not (metrics.exists() and metrics.read_text().strip()):  # rank 0 logged a step: both are training
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail("the replicas did not both reach their first step:\n" + procs[0].communicate()[0][-3000:])
        time.sleep(0.2)
    procs[1].kill()
    start = time.time()
    log, _ = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0 and time.time() - start < 90
    assert "Error" in log  # the surviving replica says why it stopped
