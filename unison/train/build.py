"""The run's parts, made from the config once: topology, policy, optimizer, engine (or the remote one and the weight
publisher), memory plan, rollout loop, resumed state, metrics writer. ``unison.train.loop.train`` is then the loop
alone.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass

import torch

from ..config import InvalidInputError
from ..dist.runtime import ReadyAgreement
from ..dist.tensor_parallel import BroadcastEngine, BroadcastScorer, host_ranks
from ..dist.topology import Topology, init_topology
from ..engine import Engine, EngineConfig
from ..episodes.loop import MultiTurnRolloutLoop
from ..lora import synced_params
from ..metrics import MetricsWriter, NullMetricsWriter
from ..models import load_policy, load_processor, model_device, model_dtype, stop_token_ids
from ..parity import check_parity
from ..rollout.loop import RolloutLoop, encode_prompt
from ..rollout.remote import RemoteEngine
from ..rollout.reward_config import build_reward_fns
from ..rollout.rewards import RewardScorer
from ..sync.auth import resolve_token
from ..sync.publisher import WeightPublisher
from ..sync.sharded import ShardedPublisher
from ..tasks import Task, load_task
from ..vision.messages import chat_messages
from ..vision.model import FAMILIES, is_vision_model
from ..vision.prompt import ImagePrompter
from .config import TrainConfig
from .evaluate import Evaluator
from .leak import check_packed_attention
from .memory import MemoryPlan, auto_row_tokens, choose_lending, kv_blocks_for, plan_memory
from .optimizer import MasterAdamW, build_optimizer
from .reference import ReferenceModel, build_reference
from .reporting import CompletionLog
from .resume import load_resume_state, restore, run_record
from .run_dir import check_run_dir, start_run

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything ``train()`` steps, and what it needs to step it."""
    cfg: TrainConfig
    topology: Topology
    model: torch.nn.Module
    tokenizer: object
    optimizer: MasterAdamW
    engine: Engine | RemoteEngine | BroadcastEngine
    publisher: WeightPublisher | ShardedPublisher | None  # generation on `unison serve` servers: patches go out
    rollout: RolloutLoop
    writer: MetricsWriter | NullMetricsWriter  # rank 0 writes the metrics
    plan: MemoryPlan
    row_tokens: int  # the packed training row
    pad_id: int
    lend: bool  # the engine's KV memory is lent to each training step
    record: dict  # saved with each trainer state, for a resume to check against (unison.train.resume.run_record)
    start: int  # the first step to run (after a resume, the one after the checkpoint's)
    reference: ReferenceModel | None = None  # the KL term's frozen initial policy (loss.beta > 0)
    evaluator: Evaluator | None = None  # eval.steps > 0: the held-out prompts, every eval.steps steps
    completions: CompletionLog | None = None  # log.completions_every > 0 (rank 0): sampled completions logged
    processor: object | None = None  # a vision-language model's processor (saved with each checkpoint)


def build_run(cfg: TrainConfig, task: Task | None = None) -> Run:
    """Make the run's parts from ``cfg`` (``task`` replaces the one ``cfg.data`` describes). Everything that can
    refuse the run (the output folder, the resumed checkpoint, the model's attention) does so before the first
    rollout."""
    topology = init_topology(cfg.dist.tp, cfg.dist.timeout_s, model_device(cfg.model.device))
    if topology.dp is not None and topology.tp is not None and cfg.sync.mode != "colocated":
        raise ValueError("data-parallel replicas of a tensor-parallel trainer run colocated for now "
                         "(sync.mode=colocated); replicas alone, or dist.tp alone, can generate on `unison serve` "
                         "servers")
    check_run_dir(cfg, topology.is_main, topology.scaled_out)  # fails fast: before the model loads
    saved = load_resume_state(cfg, topology.rank, topology.world) if cfg.resume else None
    seed = cfg.seed + (topology.dp.rank if topology.dp is not None else 0)  # each replica rolls out its own prompts
    random.seed(seed)
    torch.manual_seed(cfg.seed)  # the same initial state everywhere
    device = str(topology.device)
    dtype = model_dtype(cfg.model.dtype, device)
    lora = cfg.model.lora
    # A resumed LoRA run loads its base as the run started and the adapters from the checkpoint.
    model, tokenizer = load_policy(cfg.model.name_or_path if lora.enabled else cfg.resume or cfg.model.name_or_path,
                                   dtype=getattr(torch, dtype), device=device, topology=topology,
                                   chat_template=cfg.model.chat_template, lora=lora,
                                   adapter=cfg.resume if lora.enabled else "", train_vision=cfg.model.train_vision)
    # A vision-language model's processor: rows with images go through it and the tower once per prompt.
    processor = load_processor(cfg.model.name_or_path) if is_vision_model(model) else None
    images = ImagePrompter(model, processor) if processor is not None else None
    check_packed_attention(model)
    # Refuses what unison computes unlike the model does, through the training forward the run uses.
    check_parity(model, cfg.engine, topology, images=images, kernels=None if cfg.step.fused_kernels else False)
    task = task or load_task(cfg.data)
    if cfg.rewards:  # the config's reward functions replace the task's
        task = dataclasses.replace(task, reward_fns=build_reward_fns(cfg.rewards, cfg.rollout.max_new_tokens))
    _check_images(task, model, images, topology)
    optimizer = build_optimizer(model, cfg.optim, cfg.max_steps * cfg.step.num_iterations, topology)
    initial = (lambda: load_policy(cfg.model.name_or_path, dtype=getattr(torch, dtype), device=device)[0]) \
        if cfg.resume else None
    reference = build_reference(model, cfg.loss.beta, cfg.optim.placement == "host", topology.tp is not None,
                                initial=initial, adapter=cfg.model.lora.adapter)
    longest_prompt = _longest_prompt(cfg, tokenizer, task, images)  # sizes the KV pool and the packed rows
    engine, publisher = _engine(cfg, model, tokenizer, topology, seed, longest_prompt)
    colocated = cfg.sync.mode == "colocated"
    merged = engine.lora_merged.nbytes if colocated and engine.lora_merged is not None else 0
    states = engine.states.nbytes if colocated and engine.states is not None else 0
    pool = engine.pool.nbytes if colocated else 0
    lend, plan, row_tokens = choose_lending(
        cfg.memory.lend_kv, colocated and cfg.memory.lends(engine.device),
        lambda lent: _memory_plan(cfg, model, pool, lent, longest_prompt, merged, states))
    _log_plan(cfg, plan, row_tokens, lend, longest_prompt)
    stop_ids = stop_token_ids(tokenizer, model)
    asked = cfg.rollout.reward_workers != "auto"
    workers = cfg.rollout.workers_for(device) if topology.tp is None or topology.tp.is_main else 0  # rank 0 scores
    if workers and task.environment_factory is not None:  # the rewards read the live environments: here
        log.log(logging.WARNING if asked else logging.INFO, "rollout.reward_workers=%s: %s's rewards read its "
                "environments, which live in this process: they score inline", cfg.rollout.reward_workers, task.name)
        workers = 0
    rewards = RewardScorer(task.reward_fns, workers, cfg.rollout.reward_timeout_s, asked)
    scorer = BroadcastScorer(rewards, topology.tp) if topology.tp is not None else rewards
    # A task with tools or an environment rolls out multi-turn episodes (each one sample) on the same engine.
    loop_cls, episodes = RolloutLoop, {}
    if task.multi_turn:
        if cfg.eval.steps:
            raise ValueError(f"eval.steps: evaluating a multi-turn task ({task.name}) is not supported yet; set "
                             "eval.steps=0")
        # Under tensor parallelism rank 0 runs the tools; the ranks agree on their replies over a gloo group.
        loop_cls, episodes = MultiTurnRolloutLoop, {"episode_cfg": cfg.episode, "tools": task.tools,
                                                    "environment_factory": task.environment_factory,
                                                    "tp": host_ranks(topology)}
    rollout = loop_cls(engine, tokenizer, task.rows, task.reward_fns, cfg.rollout, stop_ids, seed=seed,
                       system_prompt=task.system_prompt, max_sample_tokens=row_tokens, scorer=scorer,
                       agreement=ReadyAgreement(topology.dp, cfg.rollout.samples_per_step, cfg.dist.ready_every)
                       if topology.dp is not None else None, images=images, **episodes)
    record = run_record(cfg, topology.world, task.rows)
    start = 1 if saved is None else restore(saved, optimizer, rollout, record["data"]) + 1
    engine.weights_updated(optimizer.step_count)  # a resumed run samples with its checkpoint's version
    if publisher is not None:  # the servers get the resumed step's weights as that version: its next patch applies
        log.info("initial full sync to %s: %s", cfg.sync.servers, publisher.anchor(version=optimizer.step_count))
    if topology.dp is not None and cfg.sync.mode != "colocated":
        torch.distributed.barrier(group=topology.dp.group)  # no replica asks the servers before they hold the weights
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    writer = start_run(cfg) if topology.is_main else NullMetricsWriter()
    log.info("training %s on %s (%s, %s) for %d steps; %d prompts", cfg.model.name_or_path, task.name,
             device, dtype, cfg.max_steps, len(task.rows))
    evaluator = Evaluator(cfg.eval, engine, tokenizer, task.eval_rows, task.reward_fns, cfg.rollout, stop_ids,
                          task.system_prompt, cfg.seed, images, rewards.apart()) if cfg.eval.steps else None
    completions = CompletionLog(cfg.output_dir, cfg.log.completions_every, cfg.log.completions_per_log, writer) \
        if cfg.log.completions_every and topology.is_main else None
    return Run(cfg, topology, model, tokenizer, optimizer, engine, publisher, rollout, writer, plan, row_tokens,
               pad_id, lend, record, start, reference, evaluator, completions, processor)


def _engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer, topology: Topology, seed: int, longest_prompt: int
            ) -> tuple[Engine | RemoteEngine | BroadcastEngine, WeightPublisher | ShardedPublisher | None]:
    """The colocated engine on the trainer's own weights (its KV pool sized for the rollouts in flight unless the
    engine section sizes it), or clients of `unison serve` servers and the publisher that keeps their weights the
    trainer's. Data-parallel replicas each ask the servers for their own rollouts; the first alone publishes (every
    replica holds the same weights after a step), and the next step's rollouts start after its patch is sent (the
    metrics gathered at the end of each step wait for it; each sample carries the versions the servers sampled it
    with). None for the publisher of the other replicas."""
    if cfg.sync.mode != "colocated":
        tp = topology.tp  # a tensor-parallel group: rank 0 talks to the servers, the patches come from every rank
        remote = RemoteEngine(cfg.sync.servers, cfg.sync.timeout_s, token=resolve_token(cfg.sync.token)) \
            if tp is None or tp.is_main else None
        if tp is not None:
            return BroadcastEngine(remote, tp), ShardedPublisher(cfg.sync, synced_params(model), tp)
        if topology.dp is not None and not topology.dp.is_main:
            return remote, None
        return remote, WeightPublisher(cfg.sync, synced_params(model))  # with LoRA: the adapters alone
    # The run's seed drives sampling too, unless the engine section sets its own.
    engine_cfg: EngineConfig = cfg.engine if cfg.engine.seed is not None else dataclasses.replace(cfg.engine, seed=seed)
    if engine_cfg.num_blocks == 0:
        engine_cfg = dataclasses.replace(engine_cfg, num_blocks=kv_blocks_for(
            cfg.rollout.max_concurrent_rollouts, longest_prompt, cfg.rollout.max_new_tokens, cfg.engine.block_size))
    log.info("KV pool: %d blocks of %d tokens", engine_cfg.num_blocks, engine_cfg.block_size)
    return Engine(model, engine_cfg, topology=topology, tokenizer=tokenizer), None  # the tokenizer: stop strings


def _memory_plan(cfg: TrainConfig, model: torch.nn.Module, kv_bytes: int, lend: bool, longest_prompt: int,
                 lora_merged_bytes: int = 0, state_bytes: int = 0) -> tuple[MemoryPlan, int]:
    """The memory plan and the packed row length (``step.max_tokens_per_row``, or the longest the plan fits: at
    least the longest sampled prompt plus ``rollout.max_new_tokens``)."""
    longest_sample = longest_prompt + cfg.rollout.max_new_tokens
    reference = "none" if cfg.loss.beta == 0 else "adapters_off" if cfg.model.lora.enabled else \
        "host" if cfg.optim.placement == "host" else "device"
    def plan_for(row_tokens: int) -> MemoryPlan:
        return plan_memory(model, kv_bytes, cfg.optim.placement == "gpu", lend, row_tokens, cfg.step.logprob_chunk,
                           cfg.memory.activation_checkpointing, reference=reference,
                           lora_merged_bytes=lora_merged_bytes, state_pool_bytes=state_bytes)

    row_tokens = cfg.step.max_tokens_per_row or auto_row_tokens(plan_for, longest_sample)
    return plan_for(row_tokens), row_tokens


def _log_plan(cfg: TrainConfig, plan: MemoryPlan, row_tokens: int, lend: bool, longest_prompt: int) -> None:
    log.info("\n%s\npacked rows of %d tokens%s; KV pool %s", plan.table(), row_tokens,
             "" if cfg.step.max_tokens_per_row else " (step.max_tokens_per_row=0: chosen from the plan)",
             "lent to each training step" if lend else "kept through the training step")
    if longest_prompt + cfg.rollout.max_new_tokens > row_tokens:
        log.warning("step.max_tokens_per_row=%d is shorter than the longest sampled prompt (%d tokens) plus "
                    "rollout.max_new_tokens (%d): completions of long prompts are cut at the row length",
                    row_tokens, longest_prompt, cfg.rollout.max_new_tokens)


def _longest_prompt(cfg: TrainConfig, tokenizer, task: Task, images: ImagePrompter | None = None) -> int:
    """Tokens of the longest of (up to) 256 sampled prompts and the evaluation's (image tokens included)."""
    rows = [r for r in random.Random(cfg.seed).sample(task.rows, min(256, len(task.rows))) if "prompt" in r]
    held_out = task.eval_rows[:cfg.eval.max_prompts or None] if cfg.eval.steps else []

    def length(row: dict) -> int:
        if images is not None and row.get("images"):
            return images.count_tokens(chat_messages(row["prompt"], row["images"], task.system_prompt), row["images"])
        return len(encode_prompt(tokenizer, row["prompt"], task.system_prompt))
    return max((length(r) for r in rows + held_out), default=0)


def _check_images(task: Task, model: torch.nn.Module, images: ImagePrompter | None, topology: Topology) -> None:
    """Refuse rows with images where they cannot be run exactly: a text-only model, a vision-language class unison
    does not run (``unison.vision.model.family_of`` names why), multi-turn episodes, several processes."""
    with_images = sum(bool(r.get("images")) for r in task.rows + task.eval_rows)
    if not with_images:
        return
    what = f"{task.name}: {with_images} row(s) hold images"
    if images is None:
        raise InvalidInputError(f"{what}, and {type(model).__name__} is a text-only model: train a vision-language "
                                f"model on them ({', '.join(sorted(FAMILIES))})")
    if task.multi_turn:
        raise InvalidInputError(f"{what}: multi-turn episodes with images are not supported yet")
    if topology.world > 1:
        raise InvalidInputError(f"{what}: vision-language models train in one process for now (no dist.tp, no "
                                "data-parallel replicas)")
