"""One GRPO workload through unison (colocated, its defaults) and TRL's GRPOTrainer, on the same GPU, in one run.

    python bench/grpo_step.py --json bench/results/h200/grpo_step.json   # 0.6B and 1.7B shapes; one GPU per shape
    python bench/grpo_step.py --device cpu --shapes tiny --prompts 2 --new 16 --steps 2 --trl-steps 2   # the harness

A step: ``--prompts`` prompts x G=8 samples of ``--new`` tokens (64-token random prompts, random bf16 weights of a
Qwen3 shape saved as a real checkpoint with a word-level tokenizer, temperature 1, so completions run to the cap),
random rewards (``--reward math``: math-verify on realistic completions, ``reward_cost.py``), one AdamW step at lr
1e-6. unison runs ``unison.train`` with its defaults for everything else; TRL as ``trl_grpo.py`` describes. Each
system runs in its own process on the shape's GPU, one after the other, so neither sees the other's memory; with
several GPUs the shapes run side by side, one GPU each.

Reported per system: s/step (mean over the steps after the first), generated tokens/s (completion tokens over the
generation seconds), trained tokens/s (prompt + completion tokens over the step), peak device memory (sampled from
NVML every 20 ms: everything the process holds, the KV pool included, which ``max_memory_allocated`` would miss
for unison's pool), and the split of a step: generation, training, sync (0 for both: the policy generates), other.
Step efficiency (unison): the ideal step over the measured one, the ideal being the decode roofline of
``engine.py`` (each decode step reads every weight and the live KV once at the measured copy bandwidth) plus
6 x params x trained tokens at the measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

PROMPT_TOKENS, GROUP, LR = 64, 8, 1e-6


def make_checkpoint(shape: str, path: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
    """Random weights of ``shape`` and a word-level tokenizer: word ``w<i>`` is token i, except 0-2, which are
    ``<unk>``, ``<eos>`` (ends a turn) and ``<pad>`` (special tokens must not be substrings of words). Initialising
    on a GPU (``device``) takes seconds where a 1.7B shape takes a minute and a half on the CPU."""
    model = build_shape(shape, device, dtype)
    model.config.eos_token_id, model.config.pad_token_id = 1, 2
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 2
    model.save_pretrained(path)
    # The turn is the prompt's words alone, so both systems see the same 64 tokens (TRL takes plain-text prompts
    # as they are; unison renders a chat template).
    word_tokenizer(model.config.vocab_size, "{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(
        path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def word_tokenizer(vocab: int, chat_template: str):
    """Word ``w<i>`` is token i, except 0-2: ``<unk>``, ``<eos>`` and ``<pad>``; words split on whitespace."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<pad>"] + [f"w{i}" for i in range(3, vocab)]
    tok = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = chat_template
    return fast


def build_shape(shape: str, device, dtype: torch.dtype) -> torch.nn.Module:
    """A Qwen3 shape of ``engine.py``, or ``moe:<shape>`` / ``dense:<shape>`` of ``moe_decode.py`` (a Qwen3-MoE
    shape, and the dense Qwen3 of the same active parameters)."""
    if shape.startswith("hybrid:"):  # a Qwen3.5 shape of hybrid_decode.py (gated delta-nets and attention)
        import hybrid_decode

        return hybrid_decode.build(shape.split(":", 1)[1], device, dtype, "sdpa")
    if ":" in shape:
        import moe_decode

        kind, name = shape.split(":", 1)
        return moe_decode.build(kind, name, device, dtype)
    from engine import build

    return build(shape, device, dtype, "sdpa")


def prompt_texts(vocab: int, n: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(f"w{i}" for i in torch.randint(10, vocab, (PROMPT_TOKENS,), generator=g).tolist())
            for _ in range(n)]


class DevicePeak:
    """Peak device memory in use (NVML, every 20 ms) above what was in use at the start; None without NVML."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(index), pynvml
        except Exception:  # no NVML here (the CPU)
            self._handle = None
        self.peak, self._stop = 0, threading.Event()

    def _used(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def __enter__(self):
        if self._handle is not None:
            base = self._used()

            def sample():
                while not self._stop.wait(0.02):
                    self.peak = max(self.peak, self._used() - base)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._handle is not None:
            self._thread.join()

    @property
    def gib(self) -> float | None:
        return self.peak / 2**30 if self._handle is not None else None


def run_unison(checkpoint: str, prompts: list[str], new: int, steps: int, out_dir: str,
               overrides: list[str], reward: str = "random") -> dict:
    """``reward``: "random", or "math" (``reward_cost.realistic_math``: math-verify on realistic completions, what
    a verifier costs the host)."""
    from unison.config import load_config
    from unison.tasks import Task
    from unison.train.config import TrainConfig
    from unison.train.loop import train

    rng = random.Random(0)
    if reward == "math":
        from reward_cost import realistic_math as reward_fn
    else:
        def reward_fn(prompts, completions, **_):
            return [rng.random() for _ in completions]
    task = Task("random-prompts", [{"prompt": p, "answer": ""} for p in prompts], [(reward_fn, 1.0)])
    n = len(prompts) * GROUP
    cfg = load_config(TrainConfig, None, [
        f"--output_dir={out_dir}", f"--max_steps={steps}", "--log.report_to=[none]", "--overwrite=true",
        f"--model.name_or_path={checkpoint}",
        f"--rollout.group_size={GROUP}", f"--rollout.samples_per_step={n}", f"--rollout.max_concurrent_rollouts={n}",
        f"--rollout.max_new_tokens={new}", f"--optim.lr={LR}", *overrides])
    save_error = None
    try:
        train(cfg, task)
    except RuntimeError as e:  # the final checkpoint: a 5B shape's trainer state (fp32 masters + Adam) is ~45 GB
        if not os.path.exists(os.path.join(out_dir, "checkpoint")):
            raise
        save_error = f"final checkpoint not saved: {str(e)[-200:]}"
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        every = [json.loads(line) for line in f]
    rows = every[1 if steps > 1 else 0:]  # the first step compiles and captures

    def mean(key):
        return statistics.mean(r[key] for r in rows)

    completion = mean("completion/length_mean")
    return {"s_per_step": mean("time/step_s"), "generate_s": mean("time/rollout_s"), "train_s": mean("time/train_s"),
            "completion_tokens_mean": completion, "trained_tokens": mean("train/tokens"),
            "peak_allocated_gib": max(r.get("memory/peak_gib", 0.0) for r in rows),
            "mismatch_logprob_diff_mean": mean("mismatch/logprob_diff_mean"),
            "mismatch_logprob_diff_max": max(r["mismatch/logprob_diff_max"] for r in rows),
            "step_s": [r["time/step_s"] for r in rows], "save_error": save_error,
            "reward_wait_s": mean("rollout/reward_wait_s"),
            "every_step": [{k: r.get(f"time/{k}") for k in ("step_s", "rollout_s", "train_s")} for r in every]}


def run_trl_here(checkpoint: str, prompts: list[str], new: int, steps: int, out_dir: str, overrides) -> dict:
    from trl_grpo import run_trl

    try:
        return run_trl(checkpoint, prompts, GROUP, new, LR, steps, out_dir)
    except torch.OutOfMemoryError:  # the whole step in one micro-batch does not fit: TRL's gradient accumulation
        torch.cuda.empty_cache()
        result = run_trl(checkpoint, prompts, GROUP, new, LR, steps, out_dir, micro_batch=2 * GROUP)
        return result | {"note": "the step in one micro-batch ran out of memory; micro-batches of 16 samples"}


def worker(args) -> None:
    """One system on one shape, in this process; writes its result to ``args.worker_out``."""
    from engine import machine_ceilings

    system, shape, checkpoint = args.worker
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = json.load(open(os.path.join(checkpoint, "config.json")))["vocab_size"]
    prompts = prompt_texts(vocab, args.prompts)
    result: dict = {}
    if system == "unison":
        result["ceilings"] = machine_ceilings(device)
        result["overrides"] = args.unison_set
    if device == "cuda":  # the CUDA context, outside the measured peak for both systems
        torch.zeros(1, device=device)
        torch.cuda.empty_cache()
    with DevicePeak() as peak, tempfile.TemporaryDirectory() as out_dir:
        if system == "unison":
            result |= run_unison(checkpoint, prompts, args.new, args.steps, out_dir, args.unison_set, args.reward)
            result |= {"steps": args.steps, "reward": args.reward}
        else:
            result |= run_trl_here(checkpoint, prompts, args.new, args.trl_steps, out_dir, args.unison_set)
            result |= {"steps": args.trl_steps}
    samples = args.prompts * GROUP
    result.update(peak_gib=peak.gib, sync_s=0.0,
                  other_s=result["s_per_step"] - result["generate_s"] - result["train_s"],
                  generated_tokens_per_s=samples * result["completion_tokens_mean"] / result["generate_s"],
                  trained_tokens_per_s=samples * (PROMPT_TOKENS + result["completion_tokens_mean"])
                  / result["s_per_step"])
    with open(args.worker_out, "w") as f:
        json.dump(result, f)


def ideal_step_s(shape: str, prompts: int, new: int, ceilings: dict) -> float | None:
    from engine import SHAPES, roofline

    if ceilings.get("copy_bytes_per_s") is None or shape not in SHAPES:
        return None  # (the MoE shapes: no roofline here; bench/moe_decode.py has their decode's)
    n = prompts * GROUP
    s = SHAPES[shape]
    h, layers, inter, vocab = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    params = layers * (h * s["num_attention_heads"] * s["head_dim"] * 2 + h * s["num_key_value_heads"] *
                       s["head_dim"] * 2 + 3 * h * inter) + vocab * h
    generate = n * new / roofline(shape, n, PROMPT_TOKENS, new, ceilings)
    return generate + 6 * params * n * (PROMPT_TOKENS + new) / ceilings["bf16_flops_per_s"]


def run_shape(shape: str, gpu: int | None, args, results: dict, save) -> None:
    """unison, then TRL, each in a fresh process on ``gpu``."""
    from engine import build  # noqa: F401  (fail here, not in the workers, if bench/ is not importable)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                     os.environ.get("PYTHONPATH")])))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    checkpoint = os.path.join(args.workdir, shape.replace(":", "_"))
    make_checkpoint(shape, checkpoint, torch.bfloat16, f"cuda:{gpu}" if gpu is not None else "cpu")
    entry = {"name": f"{shape}/{args.prompts * GROUP}x{args.new}/G{GROUP}", "gpu": gpu}
    for system in args.systems.split(","):
        out = os.path.join(args.workdir, f"{shape.replace(':', '_')}.{system}.json")
        cmd = [sys.executable, __file__, "--worker", system, shape, checkpoint, "--worker-out", out,
               "--prompts", str(args.prompts), "--new", str(args.new), "--steps", str(args.steps),
               "--trl-steps", str(args.trl_steps), "--reward", args.reward,
               *(f"--unison-set={o}" for o in args.unison_set)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(f"[{shape} {system}] exit {proc.returncode} after {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode:
            with open(out + ".log", "w") as f:  # the whole of it: the tail below may miss the first error
                f.write(proc.stdout + proc.stderr)
            entry[system] = {"error": (proc.stderr or proc.stdout)[-1500:], "log": out + ".log"}
            print(entry[system]["error"], flush=True)
            continue
        with open(out) as f:
            entry[system] = json.load(f)
    uni = entry.get("unison", {})
    if "s_per_step" in uni:
        ideal = ideal_step_s(shape, args.prompts, args.new, uni["ceilings"])
        uni["ideal_s_per_step"], uni["efficiency"] = ideal, ideal / uni["s_per_step"] if ideal else None
        if "s_per_step" in entry.get("trl", {}):
            entry["speedup"] = entry["trl"]["s_per_step"] / uni["s_per_step"]
    results[shape] = entry
    save()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b")
    p.add_argument("--systems", default="unison,trl")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step; G=8 samples each")
    p.add_argument("--new", type=int, default=512, help="completion tokens (the cap; random weights reach it)")
    p.add_argument("--steps", type=int, default=4, help="unison steps (the first is warm-up)")
    p.add_argument("--trl-steps", type=int, default=2, help="TRL steps (the first is warm-up)")
    p.add_argument("--unison-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a unison train setting other than its default (repeatable), e.g. step.max_tokens_per_row=8192")
    p.add_argument("--reward", default="random", choices=["random", "math"],
                   help="unison's rewards: random, or math-verify on realistic completions (reward_cost.py)")
    p.add_argument("--workdir", default="/tmp/grpo_step")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.workdir, exist_ok=True)
    shapes = args.shapes.split(",")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and not gpus:
        raise SystemExit("no CUDA device; use --device cpu")
    results: dict = {}
    out = {"device": torch.cuda.get_device_name() if gpus else "cpu",
           "workload": f"{args.prompts} prompts x G={GROUP}, {PROMPT_TOKENS}-token prompts, {args.new} new tokens, "
                       f"lr {LR:g}, random bf16 weights, rewards {args.reward}",
           "vllm": "not run: vLLM-based TRL setups need vLLM, which this machine cannot install or reach",
           "workloads": []}
    lock = threading.Lock()

    def save():  # after each shape, so a run cut short keeps what finished
        with lock:
            out["workloads"] = [results[s] for s in shapes if s in results]
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=2)

    threads = [threading.Thread(target=run_shape, args=(shape, i % gpus if gpus else None, args, results, save))
               for i, shape in enumerate(shapes)]
    for k in range(0, len(threads), max(gpus, 1)):  # one shape per GPU at a time
        for t in threads[k:k + max(gpus, 1)]:
            t.start()
        for t in threads[k:k + max(gpus, 1)]:
            t.join()
    print(f"{'workload':28s} {'system':7s} {'s/step':>7s} {'gen s':>6s} {'train s':>7s} {'gen tok/s':>9s} "
          f"{'peak GiB':>8s} {'eff':>5s}")
    for w in out["workloads"]:
        for system in ("unison", "trl"):
            r = w.get(system)
            if r is None:
                continue
            if "error" in r:
                print(f"{w['name']:28s} {system:7s} error")
                continue
            peak, eff = r.get("peak_gib"), r.get("efficiency")
            print(f"{w['name']:28s} {system:7s} {r['s_per_step']:7.2f} {r['generate_s']:6.2f} {r['train_s']:7.2f} "
                  f"{r['generated_tokens_per_s']:9.0f} {peak if peak is not None else float('nan'):8.1f} "
                  f"{eff if eff is not None else float('nan'):5.2f}")
        if "speedup" in w:
            print(f"{w['name']:28s} unison is {w['speedup']:.1f}x faster per step")


if __name__ == "__main__":
    main()
