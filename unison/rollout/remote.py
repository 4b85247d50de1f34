"""The part of the Engine interface the rollout loop uses (``submit``, ``step``), served by ``unison serve``
processes over HTTP: disaggregated rollouts with the colocated loop unchanged.

Groups go to the servers round-robin, each as one ``/v1/completions`` request (``n`` samples) on a thread pool;
``step()`` returns the completions that came back since the last call. A request the server refuses (a prompt
longer than its context, no weights yet) or that fails in transit comes back as ``finish_reason="abort"``
completions with no tokens: counted by the rollout loop, never a crash of the run.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from ..engine import Completion, SamplingParams
from ..sync.http import post_json

log = logging.getLogger(__name__)


class RemoteEngine:
    def __init__(self, urls: list[str], timeout: float = 600.0, max_parallel: int = 64, token: str = ""):
        if not urls:
            raise ValueError("sync.servers is empty: name at least one `unison serve` URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.token = token  # the servers' shared secret (unison.sync.auth), sent on every request
        self.pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="unison-remote")
        self.inflight: dict[Future, tuple[str, list[int], int]] = {}
        self._groups = 0
        self.version = 0
        self.errors = 0

    @property
    def num_unfinished(self) -> int:
        return sum(n for _, _, n in self.inflight.values())

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[str]:
        params = params or SamplingParams()
        group = f"r{self._groups}"
        url = self.urls[self._groups % len(self.urls)]
        self._groups += 1
        payload = {"prompt": [int(t) for t in prompt_ids], "max_tokens": params.max_new_tokens,
                   "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "n": params.n,
                   "seed": params.seed,
                   "stop_token_ids": list(params.stop_token_ids) if params.stop_token_ids is not None else None}
        future = self.pool.submit(post_json, f"{url}/v1/completions", payload, self.timeout, self.token)
        self.inflight[future] = (group, list(prompt_ids), params.n)
        return [f"{group}-{i}" for i in range(params.n)]

    def step(self, wait_s: float = 0.05) -> list[Completion]:
        if not self.inflight:
            return []
        done, _ = wait(list(self.inflight), timeout=wait_s, return_when=FIRST_COMPLETED)
        out = []
        for future in done:
            group, prompt, n = self.inflight.pop(future)
            try:
                choices = future.result()["choices"]
            except Exception as e:  # refused or lost: the group's samples come back aborted
                self.errors += 1
                log.warning("remote completion of %s failed: %s", group, e)
                choices = [{"token_ids": [], "logprobs": [], "finish_reason": "abort", "weight_versions": []}] * n
            out += [Completion(f"{group}-{i}", group, prompt, c["token_ids"], _logprobs(c), c["finish_reason"],
                               c["weight_versions"]) for i, c in enumerate(choices)]
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _logprobs(choice: dict) -> list[float]:
    """The server writes strict JSON, a non-finite logprob (sampled from NaN logits) as null: read back as NaN, the
    float the engine produced, so the rest of the loop sees a number and never a None."""
    return [math.nan if x is None else x for x in choice["logprobs"]]
