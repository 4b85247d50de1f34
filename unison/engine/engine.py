"""The generation engine: continuous batching over a paged KV cache, decoding from the model's own parameters.

The engine holds a reference to the training model, never a copy: an optimizer step that updates the
parameters in place is what the next engine step decodes with. Call ``weights_updated(version)`` after such a
step so that cached prompt KV computed with the old weights is never served again. It implements
``unison.engine.protocol.GenerationEngine``, as the clients of ``unison serve`` servers do.

>>> engine = Engine(model, EngineConfig(num_blocks=256, block_size=16))
>>> done = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, n=4))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from ..dist.topology import Topology
from ..vision import model as vlm
from ..vision.inputs import Segment, language_inputs
from ..vision.prompt import ImagePrompt
from . import mla, moe, parts, piece_graphs, row_graphs, state
from .attention import NO_MASK
from .backend import AttentionBackend, PagedBatch, StepLayout, TorchPagedBackend, slots_of
from .cache import BlockAllocator, KVPool, kv_widths
from .lm_head import decoder_of, lm_head_of
from .overlap import Overlap, OverlappedSteps
from .parts import check_request, engine_forward, eos_ids, fork_rows, resolve_kernels, snapshot_slots, state_pool, uncut
from .sampler import apply_repetition_penalty, sample
from .scheduler import Request, ScheduledChunk
from .seeding import SEED_RANGE, request_seed, token_seed
from .stop import StopStrings
from .types import Completion, EngineConfig, SamplingParams

log = logging.getLogger(__name__)


class Engine(OverlappedSteps):
    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None,
                 backend: AttentionBackend | None = None, topology: Topology | None = None, tokenizer=None):
        self.model = model
        self._stops = StopStrings(tokenizer) if tokenizer is not None else None  # SamplingParams.stop needs it
        self.config = config = config or EngineConfig()
        if config.num_blocks < 1:
            raise ValueError("EngineConfig.num_blocks must be >= 1 for an Engine (0 means 'sized by unison train')")
        text = model.config.get_text_config()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Decoder to the final hidden states, then the same fp32-output projection and head transform the trainer uses.
        self.lm_head = lm_head_of(model)
        self.decoder = decoder_of(model)
        # A vision-language model: requests with images put the tower's rows at their placeholders in prefill.
        self.vision = vlm.FAMILIES.get(type(model).__name__) if vlm.is_vision_model(model) else None
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_model_len = config.max_model_len or text.max_position_embeddings
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        # Under tensor parallelism (unison.dist.tensor_parallel) each rank holds the K/V of its share of the heads.
        tp = topology.tp_size if topology is not None else 1
        if kv_heads % tp:
            raise ValueError(f"{text.model_type}: {kv_heads} KV heads do not split across tensor-parallel size {tp}")
        kv_heads //= tp
        self.local_forward, self.lora_merged = engine_forward(model, config, self.device, topology)
        # One block more than the allocator hands out: the scratch block that padded graph rows write into.
        self.pool = KVPool(config.num_blocks + 1, config.block_size, kv_widths(text, tp, config.mla_cache),
                           self.dtype, self.device)
        if self.pool.has_latent:
            for module in mla.attention_modules(model):
                mla.check_module(module)
            kv_heads = 1
        # Hybrid models' conv / linear-attention / state-space layers: a state per request beside the KV.
        self.states = state_pool(model, self.pool, config.max_num_seqs + snapshot_slots(config), self.device, tp)
        self.allocator = BlockAllocator(config.num_blocks)
        # The kernels config.attention picks: a given backend replaces its attention, never its sampler.
        kernels = resolve_kernels(config.attention, self.device)
        self.backend = backend or self._default_backend(kernels, kv_heads)
        self.runner = None
        self._fused = nullcontext  # the forwards outside the graphs: the graphs' fused kernels too, on the GPU
        if config.cuda_graphs and self.backend.static_decode:
            from .graphs import DecodeRunner
            self.runner = DecodeRunner(self.decoder, self.lm_head, self.pool, self.backend,
                                       config.max_num_seqs, self.max_model_len, scratch_block=config.num_blocks,
                                       local_forward=self.local_forward, states=self.states)
            if self.device.type == "cuda":  # (in Triton's interpreter they cost more than PyTorch's ops)
                self._fused = self.runner.swaps
        # Steps with prompt chunks as graph rows (unison.engine.row_graphs), the other eager steps as graph pieces
        # (unison.engine.piece_graphs): not yet run across GPUs, nor for the models their forward does not cover.
        plain = (self.runner is not None and self.vision is None and tp == 1 and self.states is None
                 and not self.pool.has_latent and not any(map(moe.is_experts_module, model.modules())))
        self.rows = row_graphs.RowRunner(self.runner) if (
            plain and config.row_graphs and row_graphs.enabled(self.runner.use_graphs)) else None
        self.pieces = piece_graphs.PieceRunner(self.runner, config.max_batch_tokens) if (
            plain and piece_graphs.enabled(config.piece_graphs, self.runner.use_graphs)) else None
        # Prefill held for the graph steps' sake: without graphs every step is eager and holding only adds steps.
        self.scheduler = parts.scheduler_for(config, self.allocator, self.states is not None, self.runner is not None)
        self.version = 0
        self.eos_ids = eos_ids(model)
        self.generator = torch.Generator(self.device)
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()
        # The fused one-pass sampler is the Triton kernels' sampler; it keys its noise by a per-row seed.
        self._fused_sample = None
        if kernels == "triton":
            from .triton_sampler import FusedSampler
            self._fused_sample = FusedSampler(self.device, config.max_num_seqs)
        self._seed_rng = np.random.default_rng(config.seed)
        # Decode steps launched before the last one's tokens are read (unison.engine.overlap).
        self._overlap = Overlap(self.device, self.runner.max_batch) if (
            config.async_scheduling and self.runner is not None and self._fused_sample is not None
            and self.states is None) else None
        self._requests: dict[str, Request] = {}
        self._done: list[Completion] = []  # finished outside step() (aborts) or not claimed by generate()
        self._groups = 0
        self._arrivals = 0
        self._phases: dict[str, float] | None = None
        self._phase_t = 0.0
        self._counters = {"steps": 0, "graph_steps": 0, "ahead_steps": 0, "row_graph_steps": 0, "piece_graph_steps": 0,
                          "tokens_computed": 0, "tokens_generated": 0, "step_s": 0.0, "wait_s": 0.0, "kv_lent_bytes": 0,
                          "kv_dropped_tokens": 0}

    def _default_backend(self, kernels: str, kv_heads: int) -> AttentionBackend:
        if kernels == "torch":
            return TorchPagedBackend(self.config.block_size, self.device)
        from .triton_backend import TritonPagedBackend
        return TritonPagedBackend(self.config.block_size, kv_heads, self.device, self.dtype)

    # -- requests -----------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               continuable: bool = False, images: ImagePrompt | None = None) -> list[str]:
        """Queue ``params.n`` samples of one prompt. Returns their request ids (one group). ``continuable``: each
        finished sample keeps its KV for ``extend`` (a multi-turn episode) until ``release``. ``images``: a
        vision-language prompt's images through the tower (``unison.vision.prompt.ImagePrompter``), placed at its
        image placeholder tokens in prefill."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, params, self.vocab_size, self.max_model_len, self.config, self._stops is not None)
        if images is not None:
            family = self.vision or vlm.family_of(self.model)  # raises, naming the classes that take images
            images.check(prompt, vlm.image_token_id(self.model), family.mrope)
        group = f"g{self._groups}"
        self._groups += 1
        stop = frozenset(self.eos_ids if params.stop_token_ids is None else params.stop_token_ids)
        max_len = min(len(prompt) + params.max_new_tokens, self.max_model_len)
        ids = []
        for i in range(params.n):
            seed = request_seed(params.seed, i) if params.seed is not None else None
            req = Request(f"{group}-{i}", group, prompt, params, stop, max_len, self._arrivals, seed)
            req.continuable = continuable
            req.images = images
            self._arrivals += 1
            self._requests[req.request_id] = req
            self.scheduler.add(req)
            ids.append(req.request_id)
        return ids

    def extend(self, request_id: str, token_ids: list[int], params: SamplingParams | None = None) -> str:
        """Continue a finished continuable request: append ``token_ids`` (a tool's or environment's turn) and
        generate the next turn on the request's own KV, so the conversation so far is not prefilled again (the
        group's shared prompt blocks stay shared). Its next completion has the whole context so far as
        ``prompt_ids`` and only the new turn's tokens as ``token_ids``. ``params`` (n must be 1): the request's own
        when None. Returns ``request_id``. Raises KeyError for a request that is not parked, ValueError for tokens
        the engine refuses (the request stays parked)."""
        self._drain_rows_of([request_id])
        req = self.scheduler.parked.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not a finished continuable request: submit it with "
                           "continuable=True and extend it after its completion came out of step(), once per turn")
        if params is not None and params.n != 1:
            raise ValueError(f"extend continues one request: params.n must be 1, got {params.n}")
        params = params or req.params
        context = req.prompt + req.output + [int(t) for t in token_ids]
        check_request(context, params, self.vocab_size, self.max_model_len, self.config, self._stops is not None)
        self.scheduler.parked.pop(request_id)
        req.seed_offset += len(req.output)
        req.prompt, req.output, req.logprobs, req.versions = context, [], [], []
        req.prefix_hashes = None
        req.params = params
        req.stop_ids = frozenset(self.eos_ids if params.stop_token_ids is None else params.stop_token_ids)
        req.max_len = min(len(context) + params.max_new_tokens, self.max_model_len)
        self._requests[request_id] = req
        self.scheduler.resume(req)
        return request_id

    def release(self, request_ids: Iterable[str]) -> int:
        """Free the KV that finished continuable requests keep for ``extend``. Returns how many were parked."""
        request_ids = list(request_ids)
        self._drain_rows_of(request_ids)
        return sum(self.scheduler.release(request_id) for request_id in request_ids)

    def abort(self, request_ids: Iterable[str]) -> int:
        """Stop requests; each one's completion (finish_reason "abort", the tokens so far) comes out of the next
        ``step()``. Returns how many were unfinished; unknown and finished ids are ignored."""
        self._drain()
        return sum(self._abort_one(request_id) for request_id in request_ids)

    def abort_all(self) -> int:
        """Abort every request; returns how many."""
        return self.abort(list(self._requests))

    def _abort_one(self, request_id: str) -> bool:
        req = self.scheduler.remove(request_id)
        if req is None:
            return False
        self._done.append(self._complete(req, "abort"))
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # -- stepping -----------------------------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """One scheduling step: admit, prefill a chunk, decode a token for every running request. Returns the
        completions that finished in it; with ``config.async_scheduling`` a decode-only step is left in flight and
        its tokens (and completions) come in with the next call, which has launched the step after it first
        (``unison.engine.overlap``)."""
        if self.pool.released:  # (the state pool is lent with it)
            raise RuntimeError("the engine's KV memory is lent out (inside engine.lend()): step it afterwards")
        finished, self._done = self._done, []
        t0 = self._phase_t = time.perf_counter()
        hold = self.scheduler.holds()  # new prefill work left for a later step (unison.engine.scheduler)
        if self._overlap is not None and self._overlap.steps:
            ahead = self._decode_ahead(hold)  # the next step goes to the device before the one in flight is read
            finished += self._collect()
            if ahead:
                self._counters["step_s"] += time.perf_counter() - t0
                return finished
        chunks = self.scheduler.schedule(hold)
        if not chunks:
            self._counters["step_s"] += time.perf_counter() - t0
            return finished
        self._copy_states()
        self._phase("schedule")
        graph = self._graph_step(chunks)
        rows = not graph and self.rows is not None and self.rows.takes(chunks)
        logits = self.rows(chunks) if rows else self._forward(chunks, graph)
        self._counters["row_graph_steps"] += rows
        self._phase("forward")
        self.scheduler.after_forward(chunks)
        self._copy_states()
        sampling = [c.request for c in chunks if c.samples]
        forks = self.scheduler.take_forks()
        if forks:  # their prompt's KV and logits are the request's that computed it this step
            logits, sampling = fork_rows(forks, logits, sampling, self.pool, self.config.block_size)
        if sampling:
            tokens, logprobs = self._sample(logits, sampling)
            self._phase("sample")
            if graph and self._overlap is not None and self._fused_rows(sampling) and not forks:
                self._overlap.launch([(c.request, c.start) for c in chunks], tokens, logprobs)  # read next step()
                self._count(chunks, graph, 0, t0)
                return finished
            t1 = time.perf_counter()
            tokens, logprobs = tokens.tolist(), logprobs.tolist()  # the step's one wait for the device
            self._counters["wait_s"] += time.perf_counter() - t1
            for req, token, logprob in zip(sampling, tokens, logprobs, strict=True):
                reason = self._append(req, token, logprob)
                if reason is not None:
                    self.scheduler.finish(req)
                    finished.append(self._complete(req, reason))
            self._phase("finish")
        self._count(chunks, graph, len(sampling), t0)
        return finished

    def _count(self, chunks: list[ScheduledChunk], graph: bool, generated: int, t0: float) -> None:
        self._counters["steps"] += 1
        self._counters["graph_steps"] += graph
        self._counters["tokens_computed"] += sum(c.length for c in chunks)
        self._counters["tokens_generated"] += generated
        self._counters["step_s"] += time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Submit every prompt and step until all of their samples finish; completions in submission order.
        Completions of other requests that finish meanwhile are kept for the next ``step()``."""
        ids = [rid for prompt in prompts for rid in self.submit(prompt, params)]
        wanted, got, others = set(ids), {}, []
        while len(got) < len(ids):
            for c in self.step():
                (got.__setitem__(c.request_id, c) if c.request_id in wanted else others.append(c))
        self._done.extend(others)
        return [got[rid] for rid in ids]

    def weights_updated(self, version: int) -> None:
        """Call after every in-place update of the model's parameters, with their new version: tokens sampled from
        here on carry it, and prompt KV cached under the old weights is dropped (running requests keep theirs, or
        recompute it under ``inflight_policy="recompute"``)."""
        self._drain()  # a step in flight ran before the update, in stream order: its tokens are the old version's
        self.version = version
        if self.lora_merged is not None:
            self.lora_merged.refresh()
        self.scheduler.clear_prefix_cache()
        if self.config.inflight_policy == "recompute":
            self.scheduler.preempt_all()

    @contextmanager
    def lend(self) -> Iterator[int]:
        """Hand the KV pool's device memory to the caller for the ``with`` block (the training step); yields the
        bytes lent. Running requests are preempted first and recompute their KV when next scheduled (their tokens
        and logprobs are kept); the prefix cache is emptied. On exit the step's cached allocator blocks go back
        to the device so the pool can be taken again; CUDA graphs stay valid where the pool keeps its address
        (CUDA virtual memory) and are recaptured on their next use otherwise. Do not step the engine inside."""
        self._drain()
        self._counters["kv_dropped_tokens"] += self.scheduler.preempt_all()
        self.scheduler.clear_prefix_cache()
        lent = self.pool.release() + (self.states.release() if self.states is not None else 0)
        self._counters["kv_lent_bytes"] = lent
        try:
            yield lent
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            kept = self.pool.restore()
            kept = (self.states.restore() if self.states is not None else True) and kept
            if not kept and self.runner is not None:
                self.runner.reset()
                for graphs in (self.rows, self.pieces):
                    if graphs is not None:
                        graphs.reset()

    def stats(self) -> dict:
        s = self.scheduler
        return {
            **self._counters,
            "version": self.version,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_parked": len(s.parked),
            "num_free_blocks": self.allocator.num_free,
            "num_blocks": self.config.num_blocks,
            "kv_pool_gib": self.pool.nbytes / 2**30,
            "state_pool_gib": self.states.nbytes / 2**30 if self.states is not None else 0.0,
            "host_s": self._counters["step_s"] - self._counters["wait_s"],
            "graphs_captured": self.runner.num_captured if self.runner is not None else 0,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_hit_rate": s.prefix_hits / max(s.prefix_queries, 1),
        }

    # -- internals ----------------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, reqs: list[Request], index: list[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i samples output token ``index[i]`` of ``reqs[i]`` (default: the next one, ``len(output)``)."""
        penalised = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1]
        if penalised:  # on the raw logits, before either sampler
            logits = apply_repetition_penalty(logits, penalised, [reqs[i].prompt + reqs[i].output for i in penalised],
                                              [reqs[i].params.repetition_penalty for i in penalised])
        temperature = [r.params.temperature for r in reqs]
        # The fused sampler has no top-k/top-p/min-p cut: a batch with any of them samples here in PyTorch.
        if self._fused_sample is not None and all(uncut(r.params) for r in reqs):
            drawn = self._seed_rng.integers(0, SEED_RANGE, len(reqs)).tolist()
            index = index or [len(r.output) for r in reqs]
            seeds = [d if r.seed is None else token_seed(r.seed, r.seed_offset + i)
                     for r, d, i in zip(reqs, drawn, index, strict=True)]
            return self._fused_sample(logits, temperature, seeds)
        return sample(logits, temperature, [r.params.top_k for r in reqs], [r.params.top_p for r in reqs],
                      [r.generator_on(self.device) for r in reqs], self.generator, [r.params.min_p for r in reqs])

    def profile_phases(self, enable: bool = True) -> dict[str, float]:
        """Diagnostics: with ``enable``, every step synchronises the device after each phase (schedule, forward,
        sample, finish) and adds the phase's seconds to the returned dict. Slows steps down; off by default."""
        self._phases = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "finish": 0.0} if enable else None
        self._phase_t = time.perf_counter()
        return self._phases

    def _phase(self, name: str) -> None:
        if self._phases is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self._phases[name] += now - self._phase_t
        self._phase_t = now

    def _graph_step(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step runs through the decode runner (every request decoding one token)."""
        return (self.runner is not None and len(chunks) <= self.runner.max_batch
                and all(c.length == 1 and c.samples for c in chunks))

    def _forward(self, chunks: list[ScheduledChunk], graph: bool) -> torch.Tensor:
        """One forward over every scheduled token. Returns (S_sampling, V) fp32 logits of the sampling requests."""
        bs = self.config.block_size
        if graph:
            reqs = [c.request for c in chunks]
            positions = [c.start for c in chunks]
            shift = [r.images.rope_delta if r.images is not None else 0 for r in reqs] if self.vision else None
            return self.runner([r.output[-1] if r.output else r.prompt[-1] for r in reqs], positions,
                               [r.blocks[p // bs] * bs + p % bs for r, p in zip(reqs, positions, strict=True)],
                               [r.blocks for r in reqs], [r.state_slot for r in reqs], rope_shift=shift)
        tokens, positions, slots, query_start, context_len, sample_at = [], [], [], [0], [], []
        for chunk in chunks:
            req, start, end = chunk.request, chunk.start, chunk.start + chunk.length
            tokens += req.token_slice(start, end)
            positions.append(np.arange(start, end))
            slots.append(slots_of(req.blocks, start, end, bs))
            query_start.append(query_start[-1] + chunk.length)
            context_len.append(end)
            if chunk.samples:
                sample_at.append(query_start[-1] - 1)
        dev, n = self.device, len(tokens)
        host = np.concatenate([np.asarray(tokens, dtype=np.int64), *positions, *slots])
        tables = [c.request.blocks for c in chunks]
        if self.pieces is not None and self.pieces.takes(n, len(sample_at)):
            self._counters["piece_graph_steps"] += 1
            layout = StepLayout(query_start, context_len, tables, self.pieces.meta[2, :n])
            return self.pieces(host.reshape(3, n), sample_at, layout)
        # The step's tokens, positions, pool slots and sampled rows in one host-to-device copy.
        host = np.concatenate([host, np.asarray(sample_at, dtype=np.int64)])
        device = torch.from_numpy(host).to(dev, non_blocking=True)
        ids, position_ids = device[:n].view(1, n), device[n:2 * n].view(1, n)
        sample_rows = device[3 * n:]
        layout = StepLayout(query_start, context_len, tables, device[2 * n:3 * n])
        states = None if self.states is None else state.StepStates.for_chunks(
            self.states, [c.request.state_slot for c in chunks], [c.start for c in chunks],
            [c.length for c in chunks], dev)
        batch = PagedBatch.for_layout(self.pool, self.backend, layout, states)
        with torch.inference_mode(), self._fused(), self.local_forward():
            if self.vision is not None and any(c.request.images is not None for c in chunks):
                inputs = language_inputs(self.decoder, ids, [
                    Segment(query_start[i], c.start, c.length, c.request.images) for i, c in enumerate(chunks)],
                    self.vision.mrope)
            else:
                inputs = {"input_ids": ids, "position_ids": position_ids}
            hidden = self.decoder(**inputs, attention_mask=NO_MASK, paged=batch, use_cache=False,
                                  **mla.forward_kwargs(batch)).last_hidden_state[0]
            if states is not None:
                state.check_visited(states)
            return self.lm_head(hidden.index_select(0, sample_rows))

    def _copy_states(self) -> None:
        """The state copies the scheduler asked for (hybrid models): a shared prompt's state kept, or handed on."""
        for src, dst in self.scheduler.state_copies:
            self.states.copy_slot(src, dst)
        self.scheduler.state_copies.clear()

    def _append(self, req: Request, token: int, logprob: float) -> str | None:
        req.output.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.version)
        if token in req.stop_ids or (req.params.stop and self._stops.find(req.output, req.params.stop)):
            return "stop"
        if req.num_tokens >= req.max_len:
            return "length"
        return None

    def _complete(self, req: Request, reason: str) -> Completion:
        del self._requests[req.request_id]
        stop_string = self._stops.find(req.output, req.params.stop) if reason == "stop" and req.params.stop else None
        return Completion(req.request_id, req.group_id, list(req.prompt), list(req.output), list(req.logprobs),
                          reason, list(req.versions), stop_string)

