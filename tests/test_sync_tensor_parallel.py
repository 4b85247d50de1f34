"""Disaggregated generation from a tensor-parallel trainer: after an anchor and sparse patches built from two ranks'
shards (a gloo group), a server's receiver holds every tensor of the trainer bit for bit, the replicated and tied
root-level ones included, each patch verified against the trainer's checksums of the whole tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_tensor_parallel import PEERS, free_port, qwen3_dir, run_two_ranks  # noqa: F401  (the fixture)
from transformers import AutoModelForCausalLM

from unison.sync.receiver import Receiver
from unison.sync.transports.directory import DirectorySource


def test_receiver_holds_the_sharded_trainers_weights(qwen3_dir, tmp_path):  # noqa: F811
    patches, out = tmp_path / "patches", tmp_path / "out"
    patches.mkdir()
    out.mkdir()
    trainer, _ = run_two_ranks("tp_sync_peer.py", qwen3_dir, str(patches), out=out)  # rank 0 sent the patches
    sparse = [m for m in trainer["metrics"][1:] if "sync/elements_frac" in m]
    assert len(sparse) == 4 and all(0 < m["sync/elements_frac"] <= 1 for m in sparse)
    assert sparse[0]["sync/elements_frac"] < 0.9  # bf16: the step changed some elements, and only those travelled

    server = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.bfloat16)
    start = {n: p.detach().clone() for n, p in server.named_parameters()}
    params = dict(server.named_parameters())
    receiver = Receiver(params)
    source = DirectorySource(str(patches), receiver)
    assert source.poll() == 1 + 4 and receiver.version == 4  # the anchor, then each step's patch
    whole = trainer["params"]
    assert set(params) <= set(whole)
    for name, p in params.items():
        assert torch.equal(p.detach(), whole[name]), name
    # Column- and row-wise shards and the replicated, tied root-level embedding (the head) moved, and arrived (the
    # norms' ones stay 1 in bf16 at this lr; they arrived equal too).
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        assert not torch.equal(start[name], whole[name]), name


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_parallel_training_with_a_served_generator(qwen3_dir, tmp_path, layout):  # noqa: F811
    """`torchrun --nproc-per-node 2 -m unison train --sync.mode=sparse` against a `unison serve` server (other weights
    at first), with `--dist.tp=2` (rank 0 alone asks the server for the rollouts, both ranks train on them, the patches
    are built from both ranks' shards) and as two data-parallel replicas (each asks for its own rollouts, the first
    publishes): the patches keep the server bit-identical to the trainer's final checkpoint."""
    import threading
    from http.server import ThreadingHTTPServer

    from safetensors.torch import load_file

    from unison.engine import Engine, EngineConfig
    from unison.models import load_policy
    from unison.serve import GenerationServer, make_handler
    from unison.sync import checksum
    from unison.sync.transports import DirectorySender

    model, _ = load_policy(qwen3_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # other weights: only the sync makes them the trainer's
    directory = str(tmp_path / "patches")
    DirectorySender(directory)  # the directory exists before the server polls it
    receiver = Receiver(dict(model.named_parameters()))
    server = GenerationServer(Engine(model, EngineConfig(num_blocks=256, block_size=8, seed=0)), receiver,
                              DirectorySource(directory, receiver))
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, timeout=60))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    out = tmp_path / "run"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
             os.path.join(PEERS, "train_peer.py"), qwen3_dir, str(out), *(["--dist.tp=2"] if layout == "tp" else []),
             "--max_steps=2",
             "--sync.mode=sparse", "--sync.transport=fsspec", f"--sync.fsspec.url={directory}",
             f"--sync.servers=[http://127.0.0.1:{http.server_address[1]}]"],
            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        if server.receiver.version < 2:  # the last patch, at the server's next poll
            server.source.poll()
    finally:
        http.shutdown()
        server.stop()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 < r["sync/elements_frac"] <= 1 and r["reward/mean"] is not None for r in records)
    # Every trained completion token was sampled by the server: both replicas' (their counts are summed) or rank 0's.
    assert server.engine.stats()["tokens_generated"] >= sum(r["train/loss_tokens"] for r in records) > 0
    assert server.receiver.version == 2 and server.receiver.counts["rejected"] == 0
    trained = load_file(str(out / "checkpoint" / "model.safetensors"))
    served = dict(model.named_parameters())
    assert set(served) <= set(trained)
    assert all(checksum(served[name]) == checksum(trained[name]) for name in served)
