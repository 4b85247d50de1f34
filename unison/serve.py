"""`unison serve`: a generation server around the same Engine, for disaggregated rollouts.

    unison serve --model.name_or_path=/path/to/model --port=8000 [--sync_url=/shared/dir]

HTTP API (JSON):
- ``POST /v1/completions`` ``{"prompt": [token ids], "max_tokens": 64, "temperature": 1.0, "top_p": 1.0,
  "top_k": 0, "n": 1, "seed": null, "stop_token_ids": null}`` returns ``{"choices": [{"token_ids", "logprobs",
  "finish_reason", "weight_versions"}], "weight_version": v}``: token ids in and out, each token's logprob
  under the distribution it was sampled from, and the weight version that sampled it.
- ``GET /health``, ``GET /version`` (``{"version": v, "needs_anchor": bool}``), ``GET /checksums`` (each
  parameter's checksum: compare with the trainer's to prove the server holds its weights).
- ``POST /v1/weights`` with a patch or an anchor (the bytes of ``unison.sync.encode``) as the body.

One thread owns the engine: it admits queued requests, applies queued weight updates between engine steps (never
during one), steps, and hands finished completions back to the waiting HTTP threads. With ``sync_url`` the same
thread also polls that directory for patches. With ``sync_dist`` a second thread joins the trainer's process group
(rank ``sync_rank``) and hands each broadcast patch to the engine thread, answering the trainer's need-anchor
all-reduce once it is applied.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .engine import Engine, EngineConfig, SamplingParams
from .sync import Receiver, checksum
from .sync.codec import Framed
from .sync.transport import DirectorySubscriber
from .train.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=4096, block_size=16))
    sync_url: str = ""
    """A directory (any fsspec URL) the trainer publishes patches to; empty: updates come by POST only."""
    synced: bool = False
    """Serve from the loaded weights as version 0 (true), or refuse completions until an anchor arrives."""
    sync_dist: str = ""
    """The trainer's process group (``tcp://host:port``, its sync.url with sync.transport=dist); empty: none."""
    sync_rank: int = 1
    """This server's rank in that group (the trainer is 0; servers 1 .. N, in the order of its sync.servers)."""
    sync_world_size: int = 2


class GenerationServer:
    def __init__(self, engine: Engine, receiver: Receiver, sync_url: str = ""):
        self.engine = engine
        self.receiver = receiver
        self.subscriber = DirectorySubscriber(sync_url, receiver) if sync_url else None
        self.requests: queue.Queue = queue.Queue()
        self.updates: queue.Queue = queue.Queue()
        self.pending: dict[str, tuple[Future, list, int]] = {}  # request id -> (future, completions, expected)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="unison-engine", daemon=True)

    def start(self, dist_init: dict | None = None) -> None:
        self.thread.start()
        if dist_init is not None:
            threading.Thread(target=self._dist_loop, args=(dist_init,), name="unison-sync", daemon=True).start()

    def _dist_loop(self, init: dict) -> None:
        import torch.distributed as dist

        from .sync.transport import DistChannel

        cuda = self.engine.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", **init)
        channel = DistChannel(device=self.engine.device if cuda else "cpu")
        while channel.receive(self.receiver, apply=lambda blob: self.update(blob).result()):
            pass
        dist.destroy_process_group()
        log.info("the trainer closed the sync channel at version %d", self.receiver.version)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    def complete(self, prompt: list[int], params: SamplingParams) -> Future:
        future: Future = Future()
        self.requests.put((prompt, params, future))
        return future

    def checksums(self) -> Future:
        future: Future = Future()
        self.updates.put((None, future))
        return future

    def update(self, blob: bytes | Framed) -> Future:
        future: Future = Future()
        self.updates.put((blob, future))
        return future

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self._iterate()
            except Exception as e:  # never leave HTTP threads waiting on a dead engine thread
                log.exception("engine step failed; failing the requests in flight")
                for future, _, _ in self.pending.values():
                    future.set_exception(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
                self.pending.clear()
                self.engine.abort_all()  # their completions come out of the next step and are dropped

    def _iterate(self) -> None:
        self._apply_updates()
        self._admit()
        if self.engine.num_unfinished == 0:
            self.stopped.wait(0.005)
            return
        for completion in self.engine.step():
            group = completion.request_id.rsplit("-", 1)[0]
            if group not in self.pending:  # aborted after a failure: its request was already answered
                continue
            future, done, expected = self.pending[group]
            done.append(completion)
            if len(done) == expected:
                del self.pending[group]
                future.set_result(sorted(done, key=lambda c: int(c.request_id.rsplit("-", 1)[1])))

    def _apply_updates(self) -> None:
        changed = False
        while True:
            try:
                blob, future = self.updates.get_nowait()
            except queue.Empty:
                break
            if blob is None:  # a checksum request: answered between engine steps, never during an update
                future.set_result({name: checksum(p) for name, p in self.receiver.params.items()})
                continue
            ok = self.receiver.receive(blob)
            changed |= ok
            future.set_result(ok)
        if self.subscriber is not None:
            changed |= self.subscriber.poll() > 0
        if changed:
            self.engine.on_weights_updated()
            self.engine.version = self.receiver.version

    def _admit(self) -> None:
        while True:
            try:
                prompt, params, future = self.requests.get_nowait()
            except queue.Empty:
                return
            if self.receiver.needs_anchor:
                future.set_exception(RuntimeError("no weights yet: waiting for an anchor from the trainer"))
                continue
            try:
                ids = self.engine.submit(prompt, params)
            except ValueError as e:
                future.set_exception(e)
                continue
            self.pending[ids[0].rsplit("-", 1)[0]] = (future, [], len(ids))


def make_handler(server: GenerationServer, timeout: float = 600.0):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet: the access log is not needed
            log.debug(fmt, *args)

        def _send(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/checksums":
                self._send(200, server.checksums().result(timeout))
            elif self.path == "/version":
                self._send(200, {"version": server.receiver.version, "needs_anchor": server.receiver.needs_anchor})
            else:
                self._send(404, {"error": f"no such endpoint {self.path}"})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/v1/weights":
                ok = server.update(body).result(timeout)
                self._send(200 if ok else 409, {"applied": ok, "version": server.receiver.version,
                                                "needs_anchor": server.receiver.needs_anchor,
                                                "error": None if ok else server.receiver.last_error})
                return
            if self.path != "/v1/completions":
                self._send(404, {"error": f"no such endpoint {self.path}"})
                return
            try:
                req = json.loads(body)
                prompt = req["prompt"]
                if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                    raise ValueError("prompt must be a list of token ids")
                stop = req.get("stop_token_ids")
                params = SamplingParams(max_new_tokens=int(req.get("max_tokens", 64)),
                                        temperature=float(req.get("temperature", 1.0)),
                                        top_p=float(req.get("top_p", 1.0)), top_k=int(req.get("top_k", 0)),
                                        n=int(req.get("n", 1)), seed=req.get("seed"),
                                        stop_token_ids=tuple(stop) if stop is not None else None)
                completions = server.complete(prompt, params).result(timeout)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError, RuntimeError) as e:
                self._send(400, {"error": f"{type(e).__name__}: {e}"})
                return
            self._send(200, {"choices": [{"token_ids": c.token_ids, "logprobs": c.logprobs,
                                          "finish_reason": c.finish_reason, "weight_versions": c.weight_versions}
                                         for c in completions],
                             "weight_version": server.receiver.version})

    return Handler


def serve(cfg: ServeConfig) -> None:
    from .models import load_policy, model_device, model_dtype

    device = model_device(cfg.model.device)
    dtype = model_dtype(cfg.model.dtype, device)
    model, _ = load_policy(cfg.model.name_or_path, dtype=getattr(torch, dtype), device=device)
    engine = Engine(model, cfg.engine)
    receiver = Receiver(dict(model.named_parameters()), version=0 if cfg.synced else -1)
    server = GenerationServer(engine, receiver, cfg.sync_url)
    server.start({"init_method": cfg.sync_dist, "rank": cfg.sync_rank, "world_size": cfg.sync_world_size}
                 if cfg.sync_dist else None)
    http = ThreadingHTTPServer((cfg.host, cfg.port), make_handler(server))
    log.info("serving %s on http://%s:%d", cfg.model.name_or_path, cfg.host, http.server_address[1])
    try:
        http.serve_forever()
    finally:
        server.stop()
