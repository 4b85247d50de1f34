"""`unison serve`: a generation server around the same Engine, for disaggregated rollouts.

    unison serve --model.name_or_path=/path/to/model --port=8000 [--sync.transport=fsspec --sync.fsspec.url=/dir]

HTTP API (JSON):
- ``POST /v1/completions`` ``{"prompt": [token ids], "max_tokens": 64, "temperature": 1.0, "top_p": 1.0,
  "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "n": 1, "seed": null, "stop_token_ids": null, "stop": []}``
  returns ``{"choices": [{"token_ids", "logprobs", "finish_reason", "weight_versions", "stop_string"}],
  "weight_version": v}``: token ids in and out, each token's logprob under the distribution it was sampled from,
  the weight version that sampled it, and the stop string that ended it (null if none did).
- ``GET /health``, ``GET /version`` (``{"version": v, "needs_anchor": bool}``), ``GET /checksums`` (each
  parameter's checksum: compare with the trainer's to prove the server holds its weights).
- ``POST /v1/weights`` with a patch or an anchor (the bytes of ``unison.sync.encode``) as the body: 200 applied,
  409 not applied and an anchor needed (the trainer sends one), 400 refused with the weights as they were; the reply
  is ``{"applied", "version", "needs_anchor", "error"}``.

With a token (``--token`` or ``UNISON_SYNC_TOKEN``) every endpoint but ``GET /health`` needs
``Authorization: Bearer <token>`` (401 without, 403 wrong), checked before a body is read; without one the server
binds only a loopback host. Bodies are capped (413, unread): completion requests at ``max_request_bytes``, weights at
the largest patch the served model can have. Replies are strict JSON: a non-finite logprob is ``null``.

One thread owns the engine: it admits queued requests, applies weight updates between engine steps (never during
one), steps, and hands finished completions back to the waiting HTTP threads. Updates come from the POSTs (the
server's ``Inbox``) and from the source of ``--sync.transport`` (``unison.sync.transports``): with ``fsspec`` the
engine thread also polls ``--sync.fsspec.url``; with ``dist`` a second thread joins the trainer's process group
(``--sync.dist.*``) and hands each broadcast patch to the engine thread, answering the trainer's need-anchor
all-reduce once it is applied.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import torch

from .config import ConfigError, InvalidInputError
from .engine import Completion, Engine, EngineConfig, SamplingParams
from .lora import synced_params
from .models import ModelConfig, load_policy, load_processor, model_device, model_dtype
from .parity import check_parity
from .serve_request import RequestError, parse_completion_request, to_json
from .sync import Receiver, checksum
from .sync.auth import TOKEN_ENV, check_authorization, resolve_token
from .sync.transports import Inbox, Source, SourceConfig, build_source
from .vision.images import load_image
from .vision.model import is_vision_model
from .vision.prompt import ImagePrompter

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    renamed_keys: ClassVar[dict[str, str]] = {
        "sync_url": "--sync.transport=fsspec --sync.fsspec.url", "sync_dist": "--sync.transport=dist "
        "--sync.dist.init_method", "sync_rank": "--sync.dist.rank", "sync_world_size": "--sync.dist.world_size"}
    model: ModelConfig = field(default_factory=ModelConfig)
    host: str = "127.0.0.1"
    """The address to listen on; a host other machines can reach needs a token."""
    port: int = 8000
    """The port to listen on (0: any free one)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=4096, block_size=16))
    sync: SourceConfig = field(default_factory=SourceConfig)
    """Where patches come from besides POST /v1/weights: the trainer's sync.transport and its settings."""
    synced: bool = False
    """Serve from the loaded weights as version 0 (true), or refuse completions until an anchor arrives."""
    token: str = ""
    """The shared secret every request but ``GET /health`` must carry as ``Authorization: Bearer <token>`` (the
    trainer's sync.token); empty: ``$UNISON_SYNC_TOKEN`` if set, else none, and then only a loopback host."""
    max_n: int = 256
    """The most samples one completion request may ask for (its ``n``); more is a 400."""
    max_request_bytes: int = 16 << 20
    """The largest completion request body read; a larger one is a 413, unread. (Weight bodies are capped by the
    largest patch the served model can have.)"""

    def __post_init__(self):
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")


@dataclass(eq=False)
class _Group:
    """One completion request in the engine: the samples of one prompt, answered together in submission order."""

    future: Future
    request_ids: list[str]
    done: dict[str, Completion] = field(default_factory=dict)


class GenerationServer:
    """The engine thread and what it serves. ``source``: where patches come from besides the POSTs that ``inbox``
    takes (``unison.sync.transports.build_source``); ``images``: a vision-language model's prompter."""

    def __init__(self, engine: Engine, receiver: Receiver, source: Source | None = None,
                 images: ImagePrompter | None = None):
        self.engine = engine
        self.images = images  # a vision-language model's: requests with images go through its tower
        self.receiver = receiver
        self.inbox = Inbox(receiver)
        self.source = source
        self.sources: list[Source] = [self.inbox, *([source] if source is not None else [])]
        self.requests: queue.Queue = queue.Queue()
        self.checksum_requests: queue.Queue[Future] = queue.Queue()
        self.pending: dict[str, _Group] = {}  # request id -> its group
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="unison-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    def complete(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> Future:
        """``images``: a vision-language prompt's images (PIL), run through the tower on the engine thread."""
        future: Future = Future()
        self.requests.put((prompt, params, images, future))
        return future

    def checksums(self) -> Future:
        """Each parameter's checksum, read between engine steps, never during an update."""
        future: Future = Future()
        self.checksum_requests.put(future)
        return future

    def _loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self._iterate()
            except Exception as e:  # never leave HTTP threads waiting on a dead engine thread
                log.exception("engine step failed; failing the requests in flight")
                self._fail_inflight(f"the engine failed: {type(e).__name__}: {e}")

    def _fail_inflight(self, reason: str) -> None:
        for group in set(self.pending.values()):
            group.future.set_exception(RuntimeError(reason))
        self.pending.clear()
        self.engine.abort_all()  # their completions come out of the next step and are dropped

    def _iterate(self) -> None:
        self._apply_updates()
        self._admit()
        if self.engine.num_unfinished == 0:
            self.stopped.wait(0.005)
            return
        for completion in self.engine.step():
            group = self.pending.pop(completion.request_id, None)
            if group is None:  # aborted after a failure: its request was already answered
                continue
            group.done[completion.request_id] = completion
            if len(group.done) == len(group.request_ids):
                group.future.set_result([group.done[request_id] for request_id in group.request_ids])

    def _apply_updates(self) -> None:
        was_valid = self.receiver.weights_valid
        changed = sum(source.poll() for source in self.sources) > 0
        self._answer_checksums()
        if was_valid and not self.receiver.weights_valid:  # a patch failed its checksums after writing
            changed = True
            self._fail_inflight(f"the weights stopped matching the trainer's: {self.receiver.last_error}")
        if changed:
            self.engine.weights_updated(self.receiver.version)

    def _answer_checksums(self) -> None:
        while True:
            try:
                future = self.checksum_requests.get_nowait()
            except queue.Empty:
                return
            future.set_result({name: checksum(p) for name, p in self.receiver.params.items()})

    def _admit(self) -> None:
        while True:
            try:
                prompt, params, images, future = self.requests.get_nowait()
            except queue.Empty:
                return
            if not self.receiver.weights_valid:
                future.set_exception(RuntimeError("no weights that match the trainer's: waiting for an anchor"))
                continue
            try:
                if images:
                    if self.images is None:
                        raise ValueError(f"{type(self.engine.model).__name__} is a text-only model: it takes no images")
                    ids = self.engine.submit(prompt, params, images=self.images.from_ids(prompt, images))
                else:
                    ids = self.engine.submit(prompt, params)
            except Exception as e:  # whatever this request's fault, it fails alone
                future.set_exception(e)
                continue
            group = _Group(future, ids)
            self.pending.update(dict.fromkeys(ids, group))


def max_patch_bytes(params: dict[str, torch.Tensor]) -> int:
    """The largest body a patch of ``params`` can be: every element changed, each value with an int64 index (the
    sparse worst case; an anchor is the values alone), plus 16 MiB for the header's names and checksums."""
    return sum(p.numel() * (p.element_size() + 8) for p in params.values()) + (16 << 20)


class _Failed:
    """What ``Handler._wait`` returns once it has answered a failure itself."""


def make_handler(server: GenerationServer, timeout: float = 600.0, token: str = "", max_n: int = 256,
                 max_request_bytes: int = 16 << 20, read_timeout: float = 60.0):
    """The HTTP handler class: ``timeout`` bounds the wait for the engine thread's answer, ``read_timeout`` any
    one socket read or write (a client that stops sending its body loses the connection, not a thread for good);
    ``token`` is the shared secret ("" for none)."""
    caps = {"/v1/completions": max_request_bytes, "/v1/weights": max_patch_bytes(server.receiver.params)}
    answer_timeout = timeout  # the handler's own ``timeout`` attribute is the socket's

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout  # StreamRequestHandler sets it on the socket

        def log_message(self, fmt, *args):  # quiet: the access log is not needed
            log.debug(fmt, *args)

        def do_GET(self):
            if self.path == "/health":  # unauthenticated: a load balancer's probe carries no secret
                self._send(200, {"status": "ok"})
            elif not self._authorized():
                return
            elif self.path == "/checksums":
                checksums = self._wait(server.checksums(), 500)
                if checksums is not _Failed:
                    self._send(200, checksums)
            elif self.path == "/version":
                self._send(200, {"version": server.receiver.version, "needs_anchor": server.receiver.needs_anchor})
            else:
                self._send(404, {"error": f"no such endpoint {self.path}"})

        def do_POST(self):
            if not self._authorized():
                return
            if self.path not in caps:
                self._refuse(404, f"no such endpoint {self.path}")
                return
            body = self._read_body(caps[self.path])
            if body is None:
                return
            if self.path == "/v1/weights":
                self._weights(body)
            else:
                self._completions(body)

        def _weights(self, body: bytes) -> None:
            reply = self._wait(server.inbox.put(body), 500)
            if reply is not _Failed:
                self._send(200 if reply["applied"] else 409 if reply["needs_anchor"] else 400, reply)

        def _completions(self, body: bytes) -> None:
            try:
                prompt, params, urls = parse_completion_request(body, max_n)
                images = [load_image(url) for url in urls]
            except (RequestError, InvalidInputError) as e:
                self._send(400, {"error": str(e)})
                return
            completions = self._wait(server.complete(prompt, params, images), 400)
            if completions is _Failed:
                return
            self._send(200, {"choices": [{"token_ids": c.token_ids, "logprobs": c.logprobs,
                                          "finish_reason": c.finish_reason, "weight_versions": c.weight_versions,
                                          "stop_string": c.stop_string}
                                         for c in completions],
                             "weight_version": server.receiver.version})

        def _authorized(self) -> bool:
            status = check_authorization(self.headers.get("Authorization"), token)
            if status is not None:
                sent = "no bearer token was sent" if status == 401 else "the bearer token is wrong"
                self._refuse(status, f"{sent}: send Authorization: Bearer <token> with the server's token "
                                     f"(its --token or ${TOKEN_ENV}; the trainer's sync.token)")
            return status is None

        def _read_body(self, cap: int) -> bytes | None:
            """The request body, or None once a refusal is sent: the length is checked before a byte is read."""
            length = self.headers.get("Content-Length")
            if length is None:
                self._refuse(411, "a POST needs a Content-Length header")
                return None
            length = length.strip()
            if not (length.isascii() and length.isdigit()):
                self._refuse(400, f"Content-Length must be a byte count, got {length[:40]!r}")
                return None
            if len(length.lstrip("0")) > 18 or int(length) > cap:  # int() refuses 4,300 digits: never parse them
                self._refuse(413, f"a body of {length[:20]} bytes is over this endpoint's cap of {cap} bytes"
                                  + (" (max_request_bytes)" if self.path == "/v1/completions" else
                                     " (the largest patch the served model can have)"))
                return None
            size = int(length)
            try:
                body = self.rfile.read(size)
            except TimeoutError:
                self._refuse(408, f"the body stopped arriving: nothing for {read_timeout} s")
                return None
            if len(body) < size:  # the client closed mid-body: nobody to answer
                self.close_connection = True
                return None
            return body

        def _wait(self, future: Future, error_status: int):
            try:
                return future.result(answer_timeout)
            except TimeoutError:
                self._send(504, {"error": f"the engine thread did not answer within {answer_timeout} s"})
            except Exception as e:
                self._send(error_status, {"error": f"{type(e).__name__}: {e}"})
            return _Failed

        def _refuse(self, status: int, error: str) -> None:
            """Answer and close: the body, if any, is left unread."""
            self.close_connection = True
            self._send(status, {"error": error})

        def _send(self, status: int, payload: dict) -> None:
            body = to_json(payload)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client left before its answer
                self.close_connection = True

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # the default listen backlog of 5 reset 4-9 of 50 simultaneous connections
    daemon_threads = True  # a connection still open never holds up the process's exit


def make_http_server(server: GenerationServer, host: str = "127.0.0.1", port: int = 0,
                     **handler_options) -> ThreadingHTTPServer:
    """The HTTP front of ``server``, bound (port 0: any free one) but not yet serving; options: ``make_handler``'s."""
    return _HTTPServer((host, port), make_handler(server, **handler_options))


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def serve(cfg: ServeConfig) -> None:
    token = resolve_token(cfg.token)
    if not token and not is_loopback(cfg.host):  # before loading: a refused start costs no model load
        raise ConfigError(f"--host={cfg.host} is reachable from other machines, and without a token anyone who "
                          f"reaches the port can replace the served weights: set --token=<secret> (or "
                          f"${TOKEN_ENV}) here and the same sync.token on the trainer, or serve on --host=127.0.0.1")
    device = model_device(cfg.model.device)
    dtype = model_dtype(cfg.model.dtype, device)
    model, tokenizer = load_policy(cfg.model.name_or_path, dtype=getattr(torch, dtype), device=device,
                                   chat_template=cfg.model.chat_template, lora=cfg.model.lora)
    images = ImagePrompter(model, load_processor(cfg.model.name_or_path)) if is_vision_model(model) else None
    check_parity(model, cfg.engine, images=images)  # refuses what the engine would decode unlike the model does
    engine = Engine(model, cfg.engine, tokenizer=tokenizer)  # the tokenizer finds stop strings
    receiver = Receiver(synced_params(model), version=0 if cfg.synced else -1)  # with LoRA: the adapters alone
    server = GenerationServer(engine, receiver, build_source(cfg.sync, receiver, engine.device), images)
    server.start()
    http = make_http_server(server, cfg.host, cfg.port, token=token, max_n=cfg.max_n,
                            max_request_bytes=cfg.max_request_bytes)
    log.info("serving %s on http://%s:%d%s", cfg.model.name_or_path, cfg.host, http.server_address[1],
             "" if token else " (no token: loopback only)")
    try:
        http.serve_forever()
    finally:
        server.stop()
