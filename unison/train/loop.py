"""`unison train`: the colocated GRPO loop. Generate, score, train, tell the engine, log; repeat."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..dist.runtime import ReadyAgreement, check_replicas_agree, init_replicas, reduce_metrics
from ..dist.tensor_parallel import (
    BroadcastScorer,
    TensorParallel,
    check_ranks_agree,
    full_state_dict,
    init_tensor_parallel,
    replicated_agree,
)
from ..engine import Engine
from ..metrics import NullMetricsWriter
from ..models import load_policy, model_device, model_dtype, stop_token_ids
from ..rollout.loop import RolloutLoop, encode_prompt
from ..rollout.remote import RemoteEngine
from ..sync.auth import resolve_token
from ..sync.publisher import WeightPublisher
from ..tasks import Task, load_task
from .checkpoint import save_hf_checkpoint, save_trainer_state
from .config import TrainConfig
from .memory import auto_row_tokens, explain_oom, kv_blocks_for, plan_memory
from .optimizer import build_optimizer
from .resume import load_resume_state, restore, run_record
from .run_dir import check_run_dir, start_run
from .step import check_packed_attention, train_step

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, task: Task | None = None) -> dict[str, float]:
    """Run ``cfg.max_steps`` GRPO steps; returns the last step's metrics.

    ``task`` (rows and reward functions) replaces the one ``cfg.data`` describes: the way to train on your own
    reward functions from Python.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = model_device(cfg.model.device)
    tp = replica = None
    if cfg.dist.tp > 1:  # the ranks of a replica hold a shard each of one model and roll out the same samples
        tp, replica = init_tensor_parallel(cfg.dist.tp, cfg.dist.timeout_s, torch.device(device).type)
        device = str(tp.device)
    else:
        replica = init_replicas(cfg.dist, torch.device(device).type)
    scaled_out = replica is not None or tp is not None  # (a sync process group, if any, comes later and is not this)
    if scaled_out and cfg.sync.mode != "colocated":
        raise ValueError("data-parallel replicas and tensor parallelism run colocated for now")
    rank, world = (dist.get_rank(), dist.get_world_size()) if scaled_out else (0, 1)  # rank names its trainer state
    main = rank == 0
    if replica is not None:
        device = str(replica.device)
    check_run_dir(cfg, main, scaled_out)  # fails fast: before the model loads
    saved = load_resume_state(cfg, rank, world) if cfg.resume else None
    seed = cfg.seed + (replica.rank if replica is not None else 0)  # each replica rolls out its own prompts
    random.seed(seed)
    torch.manual_seed(cfg.seed)  # the same initial state everywhere
    dtype = model_dtype(cfg.model.dtype, device)
    model, tokenizer = load_policy(cfg.resume or cfg.model.name_or_path, dtype=getattr(torch, dtype), device=device,
                                   tp_mesh=tp.mesh if tp is not None else None)
    check_packed_attention(model)
    task = task or load_task(cfg.data)
    # The run's seed drives sampling too, unless the engine section sets its own.
    engine_cfg = cfg.engine if cfg.engine.seed is not None else dataclasses.replace(cfg.engine, seed=seed)
    optimizer = build_optimizer(model, cfg.optim, cfg.max_steps, tp=tp, replica=replica)
    longest_prompt = _longest_prompt(cfg, tokenizer, task)  # sizes the KV pool and the packed rows
    publisher = None
    if cfg.sync.mode == "colocated":
        if engine_cfg.num_blocks == 0:
            engine_cfg = dataclasses.replace(engine_cfg, num_blocks=kv_blocks_for(
                cfg.rollout.max_concurrent_rollouts, longest_prompt, cfg.rollout.max_new_tokens,
                cfg.engine.block_size))
        engine = Engine(model, engine_cfg)
        lend, kv_bytes = cfg.memory.lends(engine.device), engine.pool.nbytes
        log.info("KV pool: %d blocks of %d tokens", engine_cfg.num_blocks, engine_cfg.block_size)
    else:  # generation on `unison serve` servers, which get the weights as patches
        engine, lend, kv_bytes = RemoteEngine(cfg.sync.servers, cfg.sync.timeout_s,
                                                   token=resolve_token(cfg.sync.token)), False, 0
        publisher = WeightPublisher(cfg.sync, dict(model.named_parameters()))

    def plan_for(row_tokens: int):
        return plan_memory(model, kv_bytes, cfg.optim.placement == "gpu", lend, row_tokens, cfg.step.logprob_chunk,
                           cfg.memory.activation_checkpointing)

    longest_sample = longest_prompt + cfg.rollout.max_new_tokens
    row_tokens = cfg.step.max_tokens_per_row or auto_row_tokens(plan_for, longest_sample)
    plan = plan_for(row_tokens)
    log.info("\n%s\npacked rows of %d tokens%s", plan.table(), row_tokens,
             "" if cfg.step.max_tokens_per_row else " (step.max_tokens_per_row=0: chosen from the plan)")
    if longest_sample > row_tokens:
        log.warning("step.max_tokens_per_row=%d is shorter than the longest sampled prompt (%d tokens) plus "
                    "rollout.max_new_tokens (%d): completions of long prompts are cut at the row length",
                    row_tokens, longest_prompt, cfg.rollout.max_new_tokens)
    stop_ids = stop_token_ids(tokenizer, model)
    rollout = RolloutLoop(engine, tokenizer, task.rows, task.reward_fns, cfg.rollout, stop_ids, seed=seed,
                          system_prompt=task.system_prompt, max_sample_tokens=row_tokens)
    if tp is not None:
        rollout.scorer = BroadcastScorer(rollout.scorer, tp)  # rewards run once, on rank 0
    if replica is not None:  # the replicas train together once their scored samples add up to a step's
        rollout.agreement = ReadyAgreement(replica, cfg.rollout.samples_per_step, cfg.dist.ready_every)
    record = run_record(cfg, world, task.rows)  # saved with each trainer state, for a resume to check against
    start = 1 if saved is None else restore(saved, optimizer, rollout, record["data"]) + 1
    if publisher is not None:  # the servers get the resumed step's weights as that version: its next patch applies
        engine.version = optimizer.step_count
        log.info("initial full sync to %s: %s", cfg.sync.servers, publisher.anchor(version=optimizer.step_count))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    writer = start_run(cfg) if main else NullMetricsWriter()
    log.info("training %s on %s (%s, %s) for %d steps; %d prompts", cfg.model.name_or_path, task.name,
             device, dtype, cfg.max_steps, len(task.rows))

    metrics: dict[str, float] = {}
    kv_dropped = 0
    bar = tqdm(range(start, cfg.max_steps + 1), desc="unison train", dynamic_ncols=True, disable=not main)
    for step in bar:
        t0 = time.perf_counter()
        try:
            samples, metrics = rollout.next_batch(trainer_version=engine.version)
            if tp is not None:
                check_ranks_agree(samples, tp)
            t1 = time.perf_counter()
            with engine.lend() if lend else nullcontext(0) as lent:
                metrics.update(train_step(model, optimizer, samples, cfg.loss, cfg.rollout.temperature,
                                          row_tokens, pad_id, cfg.step.logprob_chunk,
                                          cfg.memory.activation_checkpointing,
                                          replica.group if replica is not None else None))
        except torch.OutOfMemoryError as e:
            raise explain_oom(e, plan, f"step {step}") from e
        if publisher is None:
            engine.on_weights_updated()
        else:
            engine.version = optimizer.step_count
            metrics.update(publisher.after_step(optimizer.step_count, optimizer.changed_masks))
        t2 = time.perf_counter()
        metrics["memory/kv_lent_gib"] = lent / 2**30
        if lend:  # samples in flight when the step borrowed their KV: they recompute it before decoding on
            dropped_so_far = engine.stats()["kv_dropped_tokens"]
            metrics["engine/kv_dropped_tokens"] = float(dropped_so_far - kv_dropped)
            kv_dropped = dropped_so_far
        if model.device.type == "cuda":
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(model.device) / 2**30
            torch.cuda.reset_peak_memory_stats(model.device)
        metrics.update({"time/step_s": t2 - t0, "time/rollout_s": t1 - t0, "time/train_s": t2 - t1,
                        "train/tokens_per_s": metrics["train/tokens"] / (t2 - t1)})
        if replica is not None:
            metrics = reduce_metrics(metrics, replica)
        writer.log(step, metrics)
        if main:
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s_step=f"{metrics['time/step_s']:.1f}",
                            gen_tok_s=f"{metrics['rollout/tokens_per_s']:.0f}")
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            _save(os.path.join(cfg.output_dir, f"checkpoint-{step}"), step, rank, model, tokenizer, optimizer,
                  rollout, record, tp, scaled_out)

    if publisher is not None:
        publisher.close()
    if replica is not None:
        check_replicas_agree(model, replica)
    if tp is not None:
        replicated_agree(model, tp)
    _save(os.path.join(cfg.output_dir, "checkpoint"), cfg.max_steps, rank, model, tokenizer, optimizer, rollout,
          record, tp, scaled_out)
    if scaled_out:
        if getattr(engine, "runner", None) is not None:
            engine.runner.reset()  # the decode graphs hold the communicators' kernels: freed before them
        dist.destroy_process_group()
        log.info("rank %d left the process group", rank)
    writer.plot()
    writer.close()
    if main:
        log.info("done: %s", os.path.abspath(cfg.output_dir))
    return metrics


def _save(path: str, step: int, rank: int, model, tokenizer, optimizer, rollout: RolloutLoop, record: dict,
          tp: TensorParallel | None, scaled_out: bool) -> None:
    """The HF checkpoint (rank 0; under tensor parallelism every rank helps gather the full weights), then every
    rank's trainer state beside it, for ``resume``; ``record`` (``unison.train.resume.run_record``) says what run
    saved it."""
    t0 = time.perf_counter()
    state = full_state_dict(model) if tp is not None else None  # a collective: every rank of a replica gathers
    if rank == 0:
        save_hf_checkpoint(model, tokenizer, path, state)
    if scaled_out:
        dist.barrier()  # the directory exists before the other ranks write into it
    save_trainer_state(path, rank,
                       {**record, "step": step, "optimizer": optimizer.state_dict(), "rollout": rollout.state_dict(),
                        "python_rng": random.getstate(), "torch_rng": torch.get_rng_state()})
    log.info("rank %d saved %s in %.1f s", rank, path, time.perf_counter() - t0)


def _longest_prompt(cfg: TrainConfig, tokenizer, task: Task) -> int:
    """Tokens of the longest of (up to) 256 sampled prompts."""
    rows = [r for r in random.Random(cfg.seed).sample(task.rows, min(256, len(task.rows))) if "prompt" in r]
    return max((len(encode_prompt(tokenizer, str(r["prompt"]), task.system_prompt)) for r in rows), default=0)

