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


def test_replicas_agree_on_when_to_train(tmp_path):
    """A replica that scores samples faster trains more of each step's samples; every step has exactly
    samples_per_step between the replicas, and both took part in the same number of agreements (no hang)."""
    for code, out in run_ready_peers(tmp_path, "both_score"):
        assert code == 0, out[-3000:]
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert [a + b for a, b in zip(fast["shares"], slow["shares"], strict=True)] == [16] * 4
    assert sum(fast["shares"]) > 2 * sum(slow["shares"]) > 0
    assert fast["calls"] == slow["calls"] >= 4


def run_ready_peers(tmp_path, mode: str) -> list[tuple[int, str]]:
    tmp_path.mkdir(exist_ok=True)
    port = free_port()
    procs = [launch([sys.executable, os.path.join(PEERS, "ready_peer.py"), str(tmp_path), mode],
                    port, rank) for rank in range(2)]
    return [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=300)]]


def test_replicas_without_signal(tmp_path):
    """A replica whose groups carry no signal (a constant reward) trains nothing while the other supplies every
    step; when no replica has any, every one stops with the same error at an agreement, none waits for the rest."""
    for code, out in run_ready_peers(tmp_path / "one", "one_scores"):
        assert code == 0, out[-3000:]
    scoring, silent = (json.loads((tmp_path / "one" / f"rank{r}.json").read_text()) for r in range(2))
    assert scoring["shares"] == [16] * 4 and silent["shares"] == [0] * 4
    runs = run_ready_peers(tmp_path / "none", "none_score")
    errors = [re.findall(r"RuntimeError: (data-parallel replicas \[[\d, ]+\] can produce no samples.*)", out)
              for _, out in runs]
    assert all(code != 0 for code, _ in runs) and errors[0] and errors[0] == errors[1], runs[0][1][-3000:]
    assert any("two passes over the prompts gave no batch" in out for _, out in runs)  # the stuck one says why


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
    """`torchrun --nproc-per-node 2`: each replica rolls out its share, rank 0 writes metrics and the checkpoint,
    and the replicas end with identical parameters (checked inside the run)."""
    out = tmp_path / "run"
    port = free_port()
    peer = os.path.join(PEERS, "train_peer.py")
    proc = launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
                   peer, model_dir, str(out), "--save_every=2"], port)
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
    time.sleep(15)  # both are training by now
    procs[1].kill()
    start = time.time()
    log, _ = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0 and time.time() - start < 90
    assert "Error" in log  # the surviving replica says why it stopped
