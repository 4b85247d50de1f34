"""The engine protocol (``unison.engine.protocol.GenerationEngine``) served by ``unison serve`` processes over HTTP:
disaggregated rollouts with the colocated loop unchanged.

Groups go to the servers round-robin, each as one ``/v1/completions`` request (``n`` samples) on a thread pool;
``step()`` returns the completions that came back since the last call. A request the server refuses (a prompt
longer than its context, no weights yet) or that fails in transit comes back as ``finish_reason="abort"``
completions with no tokens: counted by the rollout loop, never a crash of the run.

The trainer's memory stays its own: ``lend()`` lends nothing, and ``weights_updated(version)`` only records the
version the trainer published (the servers learn of new weights from their patches, not from this client).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass

from ..engine import Completion, SamplingParams
from ..sync.http import post_json
from ..vision.images import encode_image

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One group's ``/v1/completions`` request in flight."""

    group_id: str
    prompt: list[int]
    request_ids: list[str]
    live: set[str]  # request ids not aborted


class RemoteEngine:
    def __init__(self, urls: list[str], timeout: float = 600.0, max_parallel: int = 64, token: str = ""):
        if not urls:
            raise ValueError("sync.servers is empty: name at least one `unison serve` URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.token = token  # the servers' shared secret (unison.sync.auth), sent on every request
        self.pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="unison-remote")
        self.inflight: dict[Future, _Call] = {}
        self._aborted: list[Completion] = []  # come out of the next step()
        self._groups = 0
        self.version = 0
        self.errors = 0

    @property
    def num_unfinished(self) -> int:
        return sum(len(call.live) for call in self.inflight.values())

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *, images=None) -> list[str]:
        """``images``: a vision-language prompt's (``unison.vision.prompt.ImagePrompt``): its images travel as PNG
        data URLs, and the server runs them through its own copy of the tower."""
        params = params or SamplingParams()
        group = f"r{self._groups}"
        url = self.urls[self._groups % len(self.urls)]
        self._groups += 1
        payload = {"prompt": [int(t) for t in prompt_ids], "max_tokens": params.max_new_tokens,
                   "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "n": params.n,
                   "seed": params.seed, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
                   "stop": list(params.stop),
                   "stop_token_ids": list(params.stop_token_ids) if params.stop_token_ids is not None else None}
        if images is not None:
            payload["images"] = [encode_image(image) for image in images.images]
        future = self.pool.submit(post_json, f"{url}/v1/completions", payload, self.timeout, self.token)
        ids = [f"{group}-{i}" for i in range(params.n)]
        self.inflight[future] = _Call(group, list(prompt_ids), ids, set(ids))
        return ids

    def step(self, wait_s: float = 0.05) -> list[Completion]:
        out, self._aborted = self._aborted, []
        if not self.inflight:
            return out
        done, _ = wait(list(self.inflight), timeout=wait_s, return_when=FIRST_COMPLETED)
        for future in done:
            call = self.inflight.pop(future)
            if call.live:
                out += self._completions(call, future)
        return out

    def abort(self, request_ids: Iterable[str]) -> int:
        """Stop requests; each comes out of the next ``step()`` as an "abort" completion without tokens. A group
        still queued on the thread pool is never sent once all of its samples are aborted; one already sent cannot
        be called back (the server has no cancel endpoint): it finishes there and its aborted samples are dropped
        when it returns."""
        wanted, aborted = set(request_ids), 0
        for future, call in list(self.inflight.items()):
            for request_id in [r for r in call.request_ids if r in call.live and r in wanted]:
                call.live.discard(request_id)
                self._aborted.append(Completion(request_id, call.group_id, call.prompt, [], [], "abort", []))
                aborted += 1
            if not call.live and future.cancel():
                del self.inflight[future]
        return aborted

    def weights_updated(self, version: int) -> None:
        """The trainer published ``version``; what the servers sample with is what their completions say."""
        self.version = version

    @contextmanager
    def lend(self) -> Iterator[int]:
        """Nothing to lend: the KV memory lives on the servers."""
        yield 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _completions(self, call: _Call, future: Future) -> list[Completion]:
        """The group's samples that are still wanted; all of them aborted, without tokens, where the request was
        refused or lost."""
        try:
            choices = future.result()["choices"]
        except Exception as e:  # refused or lost: the group's samples come back aborted
            self.errors += 1
            log.warning("remote completion of %s failed: %s", call.group_id, e)
            choices = [{"token_ids": [], "logprobs": [], "finish_reason": "abort", "weight_versions": []}] * len(
                call.request_ids)
        return [Completion(request_id, call.group_id, call.prompt, c["token_ids"], _logprobs(c), c["finish_reason"],
                           c["weight_versions"], c.get("stop_string"))
                for request_id, c in zip(call.request_ids, choices, strict=False) if request_id in call.live]


def _logprobs(choice: dict) -> list[float]:
    """The server writes strict JSON, a non-finite logprob (sampled from NaN logits) as null: read back as NaN, the
    float the engine produced, so the rest of the loop sees a number and never a None."""
    return [math.nan if x is None else x for x in choice["logprobs"]]
