"""`unison train`: the colocated GRPO loop. Generate, score, train, tell the engine, log; repeat."""

from __future__ import annotations

import gc
import logging
import os
import random
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..dist.runtime import check_replicas_agree, reduce_metrics
from ..dist.tensor_parallel import check_ranks_agree, full_state_dict, replicated_agree
from ..tasks import Task
from .build import Run, build_run
from .checkpoint import prune_checkpoints, save_hf_checkpoint, save_lora_checkpoint, save_trainer_state
from .config import TrainConfig
from .memory import explain_oom
from .step import train_step

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, task: Task | None = None) -> dict[str, float]:
    """Run ``cfg.max_steps`` GRPO steps; returns the last step's metrics.

    ``task`` (rows and reward functions) replaces the one ``cfg.data`` describes: the way to train on your own
    reward functions from Python.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = build_run(cfg, task)
    engine, optimizer, topology = run.engine, run.optimizer, run.topology
    metrics: dict[str, float] = {}
    kv_dropped = 0
    frozen = False
    bar = tqdm(range(run.start, cfg.max_steps + 1), desc="unison train", dynamic_ncols=True,
               disable=not topology.is_main)
    for step in bar:
        t0 = time.perf_counter()
        try:
            samples, metrics = run.rollout.next_batch(trainer_version=engine.version)
            if topology.tp is not None:
                check_ranks_agree(samples, topology.tp)
            t1 = time.perf_counter()
            with engine.lend() if run.lend else nullcontext(0) as lent:
                metrics.update(train_step(run.model, optimizer, samples, cfg.loss, cfg.rollout.temperature,
                                          run.row_tokens, run.pad_id, cfg.step.logprob_chunk,
                                          cfg.memory.activation_checkpointing, topology, reference=run.reference,
                                          num_iterations=cfg.step.num_iterations,
                                          max_completion_length=cfg.rollout.max_new_tokens,
                                          scale_rewards=cfg.rollout.scale_rewards,
                                          kernels=None if cfg.step.fused_kernels else False))
        except torch.OutOfMemoryError as e:
            raise explain_oom(e, run.plan, f"step {step}") from e
        engine.weights_updated(optimizer.step_count)
        if run.publisher is not None:
            metrics.update(run.publisher.after_step(optimizer.step_count, optimizer.changed_masks))
        t2 = time.perf_counter()
        metrics["memory/kv_lent_gib"] = lent / 2**30
        if run.lend:  # samples in flight when the step borrowed their KV: they recompute it before decoding on
            dropped_so_far = engine.stats()["kv_dropped_tokens"]
            metrics["engine/kv_dropped_tokens"] = float(dropped_so_far - kv_dropped)
            kv_dropped = dropped_so_far
        metrics.update(_timing_and_memory(run, t0, t1, t2, metrics["train/tokens"]))
        if run.evaluator is not None and run.evaluator.due(step, cfg.max_steps):
            metrics.update(run.evaluator.run(run.rollout.land))  # rollouts in flight land with the loop
        if topology.dp is not None:
            metrics = reduce_metrics(metrics, topology.dp)
        run.writer.log(step, metrics)
        if run.completions is not None:
            run.completions.after_step(step, samples)
        if topology.is_main:
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", s_step=f"{metrics['time/step_s']:.1f}",
                            gen_tok_s=f"{metrics['rollout/tokens_per_s']:.0f}")
        if step == run.start:
            _freeze_heap()
            frozen = True
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            _save(run, os.path.join(cfg.output_dir, f"checkpoint-{step}"), step)
            if cfg.save_total_limit and topology.is_main:
                prune_checkpoints(cfg.output_dir, cfg.save_total_limit)
    _finish(run)
    if frozen:
        gc.unfreeze()  # a caller that trains again in this process (a sweep) does not keep this run's heap
    return metrics


def _freeze_heap() -> None:
    """After the first step (model, data set, compiled kernels, captured graphs: the run's long-lived objects),
    collect once and move what survives out of the garbage collector's reach (``gc.freeze``). Python's full
    collections walk every tracked object: ~0.4M of them, 211-322 ms each on the H200 host, about one step in five
    of a 0.6B run (``bench/rollout_steps.py``); frozen, that heap is not walked again (13 ms). Frozen even where
    something in the process froze a few objects before (the H200 host's Python had 375: the loop once left such a
    process alone, and so never froze there); the thaw at the end thaws those too, which only puts them back in the
    collector's oldest generation."""
    gc.collect()
    gc.freeze()


def _timing_and_memory(run: Run, t0: float, t1: float, t2: float, train_tokens: float) -> dict[str, float]:
    metrics = {"time/step_s": t2 - t0, "time/rollout_s": t1 - t0, "time/train_s": t2 - t1,
               "train/tokens_per_s": train_tokens / (t2 - t1)}
    device = run.model.device
    if device.type == "cuda":
        metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return metrics


def _finish(run: Run) -> None:
    """After the last step: close the sync channel, check that the ranks still agree, save the final checkpoint
    (``save_final``), leave the process group, plot the metrics."""
    cfg, topology = run.cfg, run.topology
    if run.publisher is not None:
        run.publisher.close()
    if topology.dp is not None:
        check_replicas_agree(run.model, topology.dp)
    if topology.tp is not None:
        replicated_agree(run.model, topology.tp)
    if cfg.save_final:
        _save(run, os.path.join(cfg.output_dir, "checkpoint"), cfg.max_steps)
    if topology.scaled_out:
        if getattr(run.engine, "runner", None) is not None:
            run.engine.runner.reset()  # the decode graphs hold the communicators' kernels: freed before them
        dist.destroy_process_group()
        log.info("rank %d left the process group", topology.rank)
    run.rollout.scorer.close()  # its reward workers, if any
    run.writer.plot()
    run.writer.close()
    if topology.is_main:
        log.info("done: %s", os.path.abspath(cfg.output_dir))


def _save(run: Run, path: str, step: int) -> None:
    """The HF checkpoint (rank 0; under tensor parallelism every rank helps gather the full weights), then every
    rank's trainer state beside it, for ``resume``; the run's ``record`` says what run saved it."""
    t0 = time.perf_counter()
    topology = run.topology
    lora = run.cfg.model.lora
    adapters_only = (lambda name: ".lora_" in name) if lora.enabled and not lora.save_merged else None
    # A collective: every tp rank gathers (a LoRA run's adapters alone, unless it saves merged weights too).
    state = full_state_dict(run.model, adapters_only) if topology.tp is not None else None
    if topology.is_main and lora.enabled:  # the adapters in PEFT's format (and, on request, merged weights)
        save_lora_checkpoint(run.model, run.processor or run.tokenizer, path, lora, run.cfg.model.name_or_path, state)
    elif topology.is_main:
        save_hf_checkpoint(run.model, run.processor or run.tokenizer, path, state)
    if topology.scaled_out:
        dist.barrier()  # the directory exists before the other ranks write into it
    save_trainer_state(path, topology.rank,
                       {**run.record, "step": step, "optimizer": run.optimizer.state_dict(),
                        "rollout": run.rollout.state_dict(), "python_rng": random.getstate(),
                        "torch_rng": torch.get_rng_state()})
    log.info("rank %d saved %s in %.1f s", topology.rank, path, time.perf_counter() - t0)
