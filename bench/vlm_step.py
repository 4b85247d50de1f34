"""A vision-language GRPO step through `unison train`: a Qwen2.5-VL-3B shape on the built-in drawn-image task.

    python bench/vlm_step.py --json bench/results/h200/vlm/vlm_step.json      # one GPU
    python bench/vlm_step.py --device cpu --shape tiny --prompts 2 --new 8 --steps 2 --image-size 56   # the harness

Random bf16 weights of the shape (vision tower and language model) saved as a real checkpoint with its processor
(Qwen2.5-VL's image processor; a word-level tokenizer holding Qwen's special tokens at their ids), so completions
run to the cap. A step: ``--prompts`` count_shapes prompts (one ``--image-size`` image each: (size / 28)^2 image
tokens) x G=8 samples of ``--new`` tokens, random rewards, lr 0 (so the engine-vs-trainer mismatch is the two
computations' alone). Then the same step with the images left out of the rows (a text-only prompt of the same
words), which shows what the images cost. Each mode runs in its own process.

Reported per mode: s/step (mean over the steps after the first), its generation and training seconds, peak device
memory (NVML, every 20 ms), the mismatch (mean and max |engine - trainer| logprob over the trained tokens), the
tokens per sample, and the frozen tower's share of the parameters. The final checkpoint is not written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

import torch
from grpo_step import GROUP, DevicePeak

SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
            "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}
SHAPES = {
    # Qwen2.5-VL-3B-Instruct's config: 3.75B parameters, 0.67B of them the vision tower.
    "qwen2.5-vl-3b": dict(
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                             "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)),
    "tiny": dict(
        text=dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0])),
}
TEMPLATE = ("{% for m in messages %}<|im_start|> {% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ p['text'] }} {% endif %}{% endfor %}<|im_end|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|> {% endif %}")


def make_checkpoint(shape: str, path: str, device: str, image_size: int) -> dict:
    """Random weights of ``shape`` and its processor; returns the parameter counts."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from unison.vision.processors import allow_missing_video_processor

    allow_missing_video_processor()
    s = SHAPES[shape]
    vocab = s["text"]["vocab_size"]
    cfg = transformers.Qwen2_5_VLConfig(text_config=dict(s["text"], eos_token_id=151645, pad_token_id=151643),
                                        vision_config=s["vision"], image_token_id=151655, video_token_id=151656,
                                        vision_start_token_id=151652, eos_token_id=151645, pad_token_id=151643,
                                        tie_word_embeddings=s["text"]["tie_word_embeddings"])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 151645, 151643
    model.save_pretrained(path)
    counts = {"parameters": sum(p.numel() for p in model.parameters()),
              "vision_parameters": sum(p.numel() for p in model.model.visual.parameters())}
    del model
    words = {f"w{i}": i for i in range(vocab) if i not in SPECIALS.values()}
    words.update(SPECIALS)
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", extra_special_tokens=list(SPECIALS))
    fast.chat_template = TEMPLATE
    pixels = image_size * image_size
    images = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels)
    transformers.Qwen2_5_VLProcessor(image_processor=images, tokenizer=fast, chat_template=TEMPLATE).save_pretrained(
        path)
    if device == "cuda":
        torch.cuda.empty_cache()
    return counts


def run_mode(args) -> dict:
    """One mode in this process: `unison train` on count_shapes rows (``images`` or ``text``: their images
    dropped), random rewards, lr 0."""
    from unison.config import load_config
    from unison.tasks import DataConfig, load_task
    from unison.train import loop
    from unison.train.config import TrainConfig

    # No final checkpoint: a 3.75B shape's trainer state (fp32 masters and Adam moments) is ~45 GB, minutes of the
    # device's time to write, and not what is measured.
    loop._save = lambda run, path, step: None

    mode, checkpoint = args.worker
    task = load_task(DataConfig(source="count_shapes", size=4 * args.prompts,
                                gym={"image_size": args.image_size, "max_shapes": 6}))
    rng = random.Random(0)
    rows = task.rows if mode == "images" else [{k: v for k, v in r.items() if k != "images"} for r in task.rows]
    task = dataclasses.replace(task, rows=rows, reward_fns=[(lambda prompts, completions, **_: [
        rng.random() for _ in completions], 1.0)])
    n = args.prompts * GROUP
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        torch.cuda.empty_cache()
    with DevicePeak() as peak, tempfile.TemporaryDirectory() as out:
        cfg = load_config(TrainConfig, None, [
            f"--output_dir={out}", f"--max_steps={args.steps}", "--log.report_to=[none]", "--overwrite=true",
            f"--model.name_or_path={checkpoint}", f"--rollout.group_size={GROUP}", f"--rollout.samples_per_step={n}",
            f"--rollout.max_concurrent_rollouts={n}", f"--rollout.max_new_tokens={args.new}", "--optim.lr=0.0",
            *(["--model.device=cpu"] if args.device == "cpu" else [])])
        loop.train(cfg, task)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f][1 if args.steps > 1 else 0:]  # the first compiles and captures

    def mean(key):
        return statistics.mean(r[key] for r in rows)

    return {"mode": mode, "s_per_step": mean("time/step_s"), "generate_s": mean("time/rollout_s"),
            "train_s": mean("time/train_s"), "peak_gib": peak.gib,
            "peak_allocated_gib": max(r.get("memory/peak_gib", 0.0) for r in rows),
            "mismatch_logprob_diff_mean": mean("mismatch/logprob_diff_mean"),
            "mismatch_logprob_diff_max": max(r["mismatch/logprob_diff_max"] for r in rows),
            "tokens_per_sample": mean("train/tokens") / mean("train/samples"),
            "completion_tokens_mean": mean("completion/length_mean"), "step_s": [r["time/step_s"] for r in rows]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--modes", default="images,text")
    p.add_argument("--json", default="")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        with open(args.worker_out, "w") as f:
            json.dump(run_mode(args), f)
        return
    from engine import commit

    results = {"shape": args.shape, "prompts": args.prompts, "group": GROUP, "new_tokens": args.new,
               "image_size": args.image_size, "steps": args.steps, "commit": commit(),
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "model")
        results |= make_checkpoint(args.shape, checkpoint, args.device, args.image_size)
        for mode in args.modes.split(","):
            out = os.path.join(tmp, f"{mode}.json")
            forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                         if k in ("device", "prompts", "new", "steps", "image_size")]
            subprocess.run([sys.executable, __file__, *forwarded, "--worker", mode, checkpoint, "--worker-out", out],
                           check=True)
            with open(out) as f:
                results["modes"][mode] = json.load(f)
    print(f"{'mode':8} {'s/step':>7} {'gen s':>6} {'train s':>7} {'peak GiB':>8} {'mismatch mean':>13} "
          f"{'max':>7} {'tok/sample':>10}")
    for mode, r in results["modes"].items():
        peak = r["peak_gib"] if r["peak_gib"] is not None else r["peak_allocated_gib"]
        print(f"{mode:8} {r['s_per_step']:7.2f} {r['generate_s']:6.2f} {r['train_s']:7.2f} {peak:8.1f} "
              f"{r['mismatch_logprob_diff_mean']:13.4f} {r['mismatch_logprob_diff_max']:7.3f} "
              f"{r['tokens_per_sample']:10.1f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
