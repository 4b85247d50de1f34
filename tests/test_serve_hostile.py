"""`unison serve` against clients that are wrong, hostile or many: authentication, request validation, body limits,
bursts of connections, strict JSON, and training through it under load. Loopback only, tiny models."""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
import torch
from conftest import random_prompts, tiny_llama
from test_train_e2e import count_w7, run_cfg

from unison.cli import run_command
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.rollout.remote import RemoteEngine
from unison.serve import GenerationServer, ServeConfig, is_loopback, make_http_server, max_patch_bytes, serve
from unison.sync import Receiver, anchor_patch, checksum, encode, sparse_patch
from unison.sync.auth import TOKEN_ENV
from unison.tasks import Task
from unison.train.optimizer import MasterAdamW, OptimConfig

TOKEN = "s3cret-token"


@contextmanager
def serving(synced: bool = True, num_blocks: int = 256, block_size: int = 4, **options):
    """A served tiny Llama (weights: seed 1), version 0 if ``synced``; ``options`` go to ``make_handler``."""
    model = tiny_llama(seed=1)
    server = GenerationServer(Engine(model, EngineConfig(num_blocks=num_blocks, block_size=block_size, seed=0)),
                              Receiver(dict(model.named_parameters()), version=0 if synced else -1))
    server.start()
    http = make_http_server(server, timeout=60, **options)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", server
    finally:
        http.shutdown()
        http.server_close()
        server.stop()


def call(url: str, path: str, payload=None, token: str = "") -> tuple[int, dict]:
    data = None if payload is None else payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw(url: str, head: str, body: bytes = b"", timeout: float = 5.0) -> tuple[int, dict]:
    """Send exactly these bytes; the server's answer must come within ``timeout`` s (else socket.timeout)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply, "the server closed the connection without an answer"
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def post_head(path: str, length: str | None) -> str:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n" + (f"Content-Length: {length}\r\n" if length is not None else "")


def trainer_and_optimizer(steps: int = 4):
    trainer = tiny_llama(seed=0)
    return trainer, MasterAdamW(trainer.named_parameters(), OptimConfig(lr=1e-2), total_steps=steps)


def optimizer_step(trainer, opt, seed: int) -> None:
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(seed))
    trainer(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


# -- authentication ----------------------------------------------------------------------------------------------


def test_a_token_guards_every_endpoint_but_health_and_the_weights_stay():
    trainer, _ = trainer_and_optimizer()
    anchor = encode(anchor_patch(dict(trainer.named_parameters()), 5))
    with serving(token=TOKEN) as (url, server):
        before = call(url, "/checksums", token=TOKEN)
        assert before[0] == 200
        assert call(url, "/health") == (200, {"status": "ok"})
        for path, payload in (("/version", None), ("/checksums", None), ("/nope", None), ("/nope", b"{}"),
                              ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}), ("/v1/weights", anchor)):
            for sent, status in (("", 401), ("wrong", 403)):
                got, body = call(url, path, payload, token=sent)
                assert got == status and "Authorization: Bearer" in body["error"], (path, sent)
        # Refused before the body is read: a client announcing a megabyte it never sends is answered at once.
        status, body = raw(url, post_head("/v1/weights", "1000000"))
        assert status == 401
        assert call(url, "/checksums", token=TOKEN) == before and server.receiver.version == 0
        assert call(url, "/version", token=TOKEN) == (200, {"version": 0, "needs_anchor": False})
        status, body = call(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, token=TOKEN)
        assert status == 200 and len(body["choices"][0]["token_ids"]) <= 2
        assert call(url, "/v1/weights", anchor, token=TOKEN)[0] == 200 and server.receiver.version == 5


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.1.2.3", False), ("example.org", False), ("", False)])
def test_only_loopback_hosts_count_as_private(host, loopback):
    assert is_loopback(host) == loopback


def test_serve_refuses_a_public_host_without_a_token_before_loading_the_model(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    missing = f"--model.name_or_path={tmp_path / 'no-model'}"  # a load would fail with another error
    assert run_command(["--host=0.0.0.0", missing], ServeConfig, serve) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --host=0.0.0.0") and "--token" in error and TOKEN_ENV in error
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # with a token the host is accepted: the model load is what fails
    with pytest.raises(Exception) as e:
        serve(ServeConfig(host="0.0.0.0", model=dataclasses.replace(ServeConfig().model,
                                                                    name_or_path=str(tmp_path / "no-model"))))
    assert "--host" not in str(e.value)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_server_on_any_gpu_loads_the_trainers_dtype(device, monkeypatch):
    """dtype=auto on cuda:1 resolved to float32 (serve compared the device with "cuda"), so every bf16 patch and
    anchor from the trainer failed its dtype check on a server on a second GPU."""
    import unison.serve

    loaded = {}

    class Loaded(Exception):
        pass

    def fake_load(name_or_path, dtype, device, **_):
        loaded.update(dtype=dtype, device=device)
        raise Loaded

    monkeypatch.setattr(unison.serve, "load_policy", fake_load)
    with pytest.raises(Loaded):
        serve(ServeConfig(model=dataclasses.replace(ServeConfig().model, device=device)))
    assert loaded == {"dtype": torch.bfloat16, "device": device}


# -- weights --------------------------------------------------------------------------------------------------


def test_a_refused_patch_does_not_stop_completions():
    with serving() as (url, server):
        status, body = call(url, "/v1/weights", b"x")
        assert status == 400 and not body["applied"] and not body["needs_anchor"] and body["error"]
        assert call(url, "/version") == (200, {"version": 0, "needs_anchor": False})
        status, body = call(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3})
        assert status == 200 and body["weight_version"] == 0


# -- request validation ------------------------------------------------------------------------------------------

BAD_REQUESTS = [  # (body, the words the error must hold)
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "not ids"}, "prompt"),
    ({"prompt": [5, True]}, "prompt"),
    ({"prompt": [5, 6.0]}, "prompt"),
    ({"prompt": [5], "max_tokens": 3.5}, "max_tokens"),
    ({"prompt": [5], "max_tokens": True}, "max_tokens"),
    ({"prompt": [5], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5], "max_tokens": "4"}, "max_tokens"),
    ({"prompt": [5], "temperature": "hot"}, "temperature"),
    ({"prompt": [5], "temperature": -1}, "temperature"),
    ({"prompt": [5], "top_p": 0}, "top_p"),
    ({"prompt": [5], "top_p": False}, "top_p"),
    ({"prompt": [5], "top_k": -1}, "top_k"),
    ({"prompt": [5], "top_k": 2.5}, "top_k"),
    ({"prompt": [5], "top_k": 2**64}, "top_k"),  # used to overflow inside the engine step, failing everyone
    ({"prompt": [5], "n": 0}, "n must"),
    ({"prompt": [5], "n": 1.0}, "n must"),
    ({"prompt": [5], "n": 257}, "max_n"),
    ({"prompt": [5], "seed": [1]}, "seed"),
    ({"prompt": [5], "seed": {}}, "seed"),
    ({"prompt": [5], "seed": 1.5}, "seed"),
    ({"prompt": [5], "stop_token_ids": 2}, "stop_token_ids"),
    ({"prompt": [5], "stop_token_ids": [2.0]}, "stop_token_ids"),
    ({"prompt": [5], "stop_token_ids": [True]}, "stop_token_ids"),
    ({"prompt": [5], "max_token": 4}, "unknown field(s) max_token"),
    ([5, 6], "JSON object"),
    ("prompt", "JSON object"),
    (b'{"prompt": [5], "temperature": NaN}', "NaN"),
    (b'{"prompt": [5], "top_p": Infinity}', "Infinity"),
    (b'{"prompt": [5], "temperature": -Infinity}', "Infinity"),
    (b'{"prompt": [5', "not valid JSON"),
    (b'\xff\xfe\x00', "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
]


def test_every_completion_field_is_checked_at_the_boundary():
    with serving() as (url, _):
        wrong = []
        for payload, words in BAD_REQUESTS:
            status, body = call(url, "/v1/completions", payload)
            if status != 400 or words not in body.get("error", ""):
                wrong.append((payload, status, body))
        assert not wrong
        status, body = call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, "n": 256, "seed": 2**70,
                                                     "top_k": 10**12, "temperature": 0, "stop_token_ids": []})
        assert status == 200 and len(body["choices"]) == 256  # the largest of each still works


def test_a_bad_request_fails_alone_while_others_decode():
    """An unhashable seed used to raise in the engine thread and fail every request in flight."""
    with serving() as (url, server):
        long = {}
        worker = threading.Thread(target=lambda: long.update(reply=call(url, "/v1/completions", {
            "prompt": [5, 6, 7], "max_tokens": 40, "stop_token_ids": []})))
        worker.start()
        deadline = time.monotonic() + 30
        while server.engine.num_unfinished == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        for seed in ([1], {}):
            assert call(url, "/v1/completions", {"prompt": [5], "seed": seed})[0] == 400
        worker.join()
        status, body = long["reply"]
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 40


def test_an_engine_that_cannot_take_a_request_fails_only_that_request(monkeypatch):
    real_submit = Engine.submit

    def picky(self, prompt, params=None):
        if prompt == [9]:
            raise KeyError("not this one")  # any exception, not only ValueError
        return real_submit(self, prompt, params)

    monkeypatch.setattr(Engine, "submit", picky)
    with serving() as (url, _):
        status, body = call(url, "/v1/completions", {"prompt": [9]})
        assert status == 400 and "not this one" in body["error"]
        assert call(url, "/v1/completions", {"prompt": [5], "max_tokens": 2})[0] == 200


# -- bodies, connections -----------------------------------------------------------------------------------------


def test_bad_content_lengths_are_answered_not_dropped():
    with serving(max_request_bytes=1000) as (url, server):
        cap = max_patch_bytes(server.receiver.params)
        for path, length, status in (("/v1/completions", None, 411), ("/v1/weights", None, 411),
                                     ("/v1/completions", "abc", 400), ("/v1/weights", "-1", 400),
                                     ("/v1/weights", "1e3", 400), ("/v1/completions", str(10**15), 413),
                                     ("/v1/weights", str(10**15), 413), ("/v1/weights", "9" * 5000, 413),
                                     ("/v1/completions", "1001", 413),
                                     ("/v1/weights", str(cap + 1), 413)):
            got, body = raw(url, post_head(path, length))  # no body sent: an answer must not wait for one
            assert got == status and body["error"], (path, length, body)
        assert "max_request_bytes" in raw(url, post_head("/v1/completions", "1001"))[1]["error"]
        body = json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode()
        assert raw(url, post_head("/v1/completions", str(len(body))), body)[0] == 200
        assert server.receiver.version == 0 and server.receiver.counts["rejected"] == 0


def test_the_largest_patch_fits_the_weights_cap():
    params = dict(tiny_llama(seed=0, dtype=torch.bfloat16).named_parameters())
    everything = {name: torch.ones_like(p, dtype=torch.bool) for name, p in params.items()}
    assert len(encode(sparse_patch(params, everything, 0, 1))) <= max_patch_bytes(params)
    assert len(encode(anchor_patch(params, 0))) <= max_patch_bytes(params)


def test_a_half_sent_body_times_out_instead_of_holding_a_thread():
    with serving(read_timeout=0.5) as (url, _):
        t0 = time.perf_counter()
        status, body = raw(url, post_head("/v1/completions", "100"), b'{"prompt": [5')
        assert status == 408 and "stopped arriving" in body["error"] and time.perf_counter() - t0 < 3


def test_a_burst_of_connections_waits_in_the_listen_queue():
    """The default backlog of 5 reset 4-9 of 50 simultaneous clients: here 200 connect while nothing accepts."""
    model = tiny_llama(seed=1)
    server = GenerationServer(Engine(model, EngineConfig(num_blocks=16, block_size=4)),
                              Receiver(dict(model.named_parameters())))
    http, sockets = make_http_server(server), []
    try:
        for _ in range(200):  # a connection the kernel does not queue times out: its SYN is dropped
            sockets.append(socket.create_connection(http.server_address, timeout=0.5))
        threading.Thread(target=http.serve_forever, daemon=True).start()
        for s in sockets:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert all(s.recv(100).startswith(b"HTTP/1.0 200") for s in sockets)
        assert http.daemon_threads
        http.shutdown()
    finally:
        http.server_close()
        for s in sockets:
            s.close()


# -- strict JSON -----------------------------------------------------------------------------------------------


def test_nan_logprobs_travel_as_null_and_come_back_as_nan(monkeypatch):
    real_step = Engine.step

    def nan_step(self):
        return [dataclasses.replace(c, logprobs=[math.nan] * len(c.logprobs)) for c in real_step(self)]

    monkeypatch.setattr(Engine, "step", nan_step)

    def strict(name):
        raise AssertionError(f"the reply holds {name}, which is not JSON")

    with serving() as (url, _):
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"prompt": [5, 6], "max_tokens": 3, "stop_token_ids": []}).encode())
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = json.loads(reply.read(), parse_constant=strict)
        assert body["choices"][0]["logprobs"] == [None] * 3
        remote = RemoteEngine([url], timeout=60)
        remote.submit([5, 6], SamplingParams(max_new_tokens=3, stop_token_ids=()))
        completions = []
        while remote.num_unfinished:
            completions += remote.step()
        remote.close()
    assert completions[0].finish_reason == "length" and all(math.isnan(x) for x in completions[0].logprobs)


# -- under load ------------------------------------------------------------------------------------------------


def test_sixty_clients_are_all_answered_while_patches_arrive():
    trainer, opt = trainer_and_optimizer()
    params = dict(trainer.named_parameters())
    prompts = random_prompts([3 + i % 7 for i in range(60)])
    with serving(synced=False, num_blocks=1024) as (url, server):
        assert call(url, "/v1/weights", encode(anchor_patch(params, 0)))[0] == 200
        replies, patches = [None] * 60, []

        def client(i):
            replies[i] = call(url, "/v1/completions", {"prompt": prompts[i], "max_tokens": 8, "seed": i})

        def trainer_loop():
            for version in (1, 2, 3):
                optimizer_step(trainer, opt, version)
                patches.append(call(url, "/v1/weights", encode(sparse_patch(params, opt.changed_masks,
                                                                            version - 1, version)))[0])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(60)]
        threads.append(threading.Thread(target=trainer_loop))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        served = call(url, "/checksums")[1]
    assert [status for status, _ in replies] == [200] * 60 and patches == [200] * 3
    assert all(1 <= len(body["choices"][0]["token_ids"]) <= 8 for _, body in replies)
    assert server.receiver.version == 3 and served == {name: checksum(p) for name, p in params.items()}


def many_prompts() -> Task:
    """test_train_e2e's task with 200 prompts: 128 samples in flight must not be two passes over them."""
    rows = [{"prompt": " ".join(f"w{3 + (i * 11 + j) % 250}" for j in range(4 + i % 5)), "answer": "w7"}
            for i in range(200)]
    return Task("tiny", rows, [(count_w7, 1.0)])


def train_through(url: str, out, model_dir, *overrides) -> list[dict]:
    from unison.train.loop import train

    train(run_cfg(model_dir, out, "--optim.lr=1e-3", "--sync.mode=sparse", "--sync.transport=http",
                  f"--sync.servers=[{url}]", *overrides), many_prompts())
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_over_http_with_64_requests_at_once_and_a_token(tmp_path, model_dir, monkeypatch):
    """Groups of 2 with 128 samples in flight: ~64 simultaneous connections. No completion is lost, and the
    server, which checks the trainer's token on every request, ends bit-identical to the checkpoint."""
    from safetensors.torch import load_file

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    waiting, peak, real_complete = set(), [0], GenerationServer.complete

    def counted(self, prompt, params, images=None):  # how many completion requests the HTTP threads wait on at once
        future = real_complete(self, prompt, params, images)
        waiting.add(future)
        peak[0] = max(peak[0], len(waiting))
        future.add_done_callback(waiting.discard)
        return future

    monkeypatch.setattr(GenerationServer, "complete", counted)
    with serving(synced=False, num_blocks=1024, block_size=8, token=TOKEN) as (url, server):
        records = train_through(url, tmp_path / "run", model_dir, f"--sync.token={TOKEN}",
                                "--rollout.group_size=2", "--rollout.samples_per_step=16",
                                "--rollout.max_concurrent_rollouts=128")
        served = call(url, "/checksums", token=TOKEN)[1]
    assert [r["rollout/aborted"] for r in records] == [0, 0, 0] and peak[0] >= 48, peak
    assert server.receiver.version == 3 and server.receiver.counts["rejected"] == 0
    trained = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert served == {name: checksum(t) for name, t in trained.items()}


def test_a_trainer_without_the_token_is_refused_at_its_first_sync(tmp_path, model_dir, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with serving(synced=False, token=TOKEN) as (url, server):
        with pytest.raises(Exception, match="401"):
            train_through(url, tmp_path / "run", model_dir)
        assert server.receiver.version == -1 and not server.receiver.weights_valid
