"""`unison serve` in-process: completions over HTTP from a server whose weights arrive as patches."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs, tiny_llama
from test_train_e2e import run_cfg, task

from unison.engine import Engine, EngineConfig
from unison.serve import GenerationServer, make_handler
from unison.sync import Receiver, anchor_patch, encode, sparse_patch
from unison.sync.transports import DirectorySender, DirectorySource
from unison.train.optimizer import MasterAdamW, OptimConfig


@pytest.fixture
def served():
    model = tiny_llama(seed=1)  # not the trainer's weights: only the sync makes them so
    server = GenerationServer(Engine(model, EngineConfig(num_blocks=128, block_size=4, seed=0)),
                              Receiver(dict(model.named_parameters())))
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, timeout=60))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    server.stop()


def call(url: str, path: str, payload=None) -> tuple[int, dict]:
    data = None if payload is None else payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_follow_the_trainers_patches(served):
    trainer = tiny_llama(seed=0)
    params = dict(trainer.named_parameters())
    opt = MasterAdamW(trainer.named_parameters(), OptimConfig(lr=1e-2), total_steps=2)
    prompt = random_prompts([7])[0]
    assert call(served, "/health") == (200, {"status": "ok"})
    status, body = call(served, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 400 and "anchor" in body["error"]  # no weights yet

    assert call(served, "/v1/weights", encode(anchor_patch(params, 0)))[0] == 200
    assert call(served, "/version")[1] == {"version": 0, "needs_anchor": False}
    status, body = call(served, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                    "stop_token_ids": []})
    ref = trainer.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                           pad_token_id=0)
    assert status == 200 and body["choices"][0]["token_ids"] == ref[0, len(prompt):].tolist()

    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    trainer(ids, labels=ids).loss.backward()
    opt.step()
    status, body = call(served, "/v1/weights", encode(sparse_patch(params, opt.changed_masks, 0, 1)))
    assert status == 200 and body["version"] == 1
    status, body = call(served, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "n": 2, "seed": 3,
                                                    "stop_token_ids": []})
    assert status == 200 and body["weight_version"] == 1
    for choice in body["choices"]:
        assert choice["weight_versions"] == [1] * 10
        ref = teacher_forced_logprobs(trainer, prompt, choice["token_ids"])
        assert (ref - torch.tensor(choice["logprobs"])).abs().max() < 1e-4  # the server holds the new weights

    # A patch for the wrong base version is refused and says why; a malformed request is a 400.
    status, body = call(served, "/v1/weights", encode(sparse_patch(params, opt.changed_masks, 5, 6)))
    assert status == 409 and body["needs_anchor"] and "does not apply" in body["error"]
    status, body = call(served, "/v1/completions", {"prompt": "not ids"})
    assert status == 400 and "token ids" in body["error"]


@pytest.mark.parametrize("transport", ["http", "fsspec"])
def test_train_with_remote_generation(transport, tmp_path, model_dir):
    """`unison train` with sync.mode=sparse: rollouts come from a `unison serve` server that starts with other
    weights; the initial anchor and each step's sparse patch keep it bit-identical to the trainer."""
    from safetensors.torch import load_file

    from unison.sync import checksum
    from unison.train.loop import train

    model = tiny_llama(seed=1)
    directory = str(tmp_path / "patches")
    receiver = Receiver(dict(model.named_parameters()))
    if transport == "fsspec":
        DirectorySender(directory)  # the directory exists before the server polls it
    server = GenerationServer(Engine(model, EngineConfig(num_blocks=256, block_size=8, seed=0)), receiver,
                              DirectorySource(directory, receiver) if transport == "fsspec" else None)
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, timeout=60))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        out = tmp_path / "run"
        train(run_cfg(model_dir, out, "--optim.lr=1e-3", "--sync.mode=sparse", f"--sync.transport={transport}",
                      f"--sync.servers=[{url}]", f"--sync.fsspec.url={directory}"), task())
    finally:
        http.shutdown()
        server.stop()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["sync/elements_frac"] <= 1 and r["sync/bytes"] > 0 for r in records)
    assert all(r["reward/mean"] is not None for r in records)
    if transport == "fsspec" and server.receiver.version < 3:  # the last patch, at the server's next poll
        server.source.poll()
    assert server.receiver.version == 3 and server.receiver.counts["rejected"] == 0
    trained = load_file(str(out / "checkpoint" / "model.safetensors"))
    served = dict(model.named_parameters())
    assert all(checksum(served[name]) == checksum(t) for name, t in trained.items())


def test_train_with_a_served_process_over_torch_distributed(tmp_path, model_dir):
    """`unison serve` as its own process, joined to the trainer's gloo process group: the trainer broadcasts
    each step's patch; afterwards the server's /checksums equal the trainer's final weights."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from transformers import AutoTokenizer

    from unison.sync import checksum
    from unison.train.loop import train

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    other = tmp_path / "server_model"  # the same architecture, other weights
    tiny_llama(seed=1).save_pretrained(other)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(other)
    http_port, dist_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "unison", "serve", f"--model.name_or_path={other}",
                             f"--port={http_port}", "--engine.num_blocks=256", "--engine.block_size=8",
                             "--sync.transport=dist", f"--sync.dist.init_method=tcp://127.0.0.1:{dist_port}",
                             "--sync.dist.rank=1", "--sync.dist.world_size=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{http_port}"
    try:
        for _ in range(600):
            try:
                if call(url, "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        out = tmp_path / "run"
        train(run_cfg(model_dir, out, "--optim.lr=1e-3", "--sync.mode=sparse", "--sync.transport=dist",
                      f"--sync.servers=[{url}]", f"--sync.dist.init_method=tcp://127.0.0.1:{dist_port}"), task())
        status, version = call(url, "/version")
        status, served = call(url, "/checksums")
    finally:
        proc.terminate()
        log, _ = proc.communicate(timeout=30)
    assert version == {"version": 3, "needs_anchor": False}, log[-2000:]
    from safetensors.torch import load_file

    trained = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert served == {name: checksum(t) for name, t in trained.items()}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["sync/elements_frac"] < 1 for r in records)  # fp32: all but untouched embedding rows change


def test_an_engine_failure_fails_the_requests_not_the_server(served, monkeypatch):
    """A step that raises fails the requests in flight with the error; the server keeps serving."""
    trainer = tiny_llama(seed=0)
    assert call(served, "/v1/weights", encode(anchor_patch(dict(trainer.named_parameters()), 0)))[0] == 200
    real_step = Engine.step
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real_step(self)

    monkeypatch.setattr(Engine, "step", flaky)
    status, body = call(served, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6})
    assert status == 400 and "injected" in body["error"]
    status, body = call(served, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "stop_token_ids": []})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 6
