"""How far apart are the engine's and the trainer's logprobs in bf16, and what is the floor?

Samples completions with the engine, then scores the same tokens four ways and compares each with an fp32
forward of the same weights (the truth): the engine's own logprobs, the trainer's packed varlen forward, and a
plain SDPA forward per sample (what two ordinary bf16 forwards of one sequence disagree by).

    python bench/logprob_floor.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.engine.lm_head import decoder_of, lm_head_fp32
from unison.models import load_policy, stop_token_ids
from unison.rollout.sample import Sample
from unison.tasks import DataConfig, load_task
from unison.train.logprobs import policy_logprobs
from unison.train.packing import pack_samples


@torch.no_grad()
def plain_logprobs(model, sample: Sample) -> torch.Tensor:
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.completion_ids)], device=model.device)
    hidden = decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
    logits = lm_head_fp32(hidden[len(sample.prompt_ids) - 1:-1], model.get_output_embeddings().weight)
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(sample.prompt_ids):, None]).squeeze(1).cpu()


def stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"mean": d.mean().item(), "max": d.max().item(), "frac_gt_0.1": (d > 0.1).float().mean().item()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model, tok = load_policy(dtype=torch.bfloat16, device=args.device)
    truth_model = copy.deepcopy(model).float()
    rows = load_task(DataConfig(size=args.prompts)).rows
    engine = Engine(model, EngineConfig(num_blocks=2048, block_size=16, seed=0))
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for r in rows]
    params = SamplingParams(max_new_tokens=args.new_tokens, n=8, stop_token_ids=stop_token_ids(tok))
    done = engine.generate(prompts, params)
    samples = [Sample(tuple(c.prompt_ids), tuple(c.token_ids), tuple(c.logprobs), tuple(c.weight_versions),
                      0.0, 0.0) for c in done]
    engine_lp = torch.cat([torch.tensor(s.engine_logprobs) for s in samples])
    truth = torch.cat([plain_logprobs(truth_model, s) for s in samples])
    plain = torch.cat([plain_logprobs(model, s) for s in samples])
    packed = []
    with torch.no_grad():
        for row in pack_samples(samples, 8192, 0):
            row = row.to(args.device)
            lp, _ = policy_logprobs(model, row)
            packed.append((lp.cpu(), row.sample_index))
    # Rows hold samples in their own order: put the trainer's logprobs back in sample order.
    per_sample = {}
    for lp, index in packed:
        start = 0
        for i in index:
            n = len(samples[i].completion_ids)
            per_sample[i] = lp[start:start + n]
            start += n
    trainer = torch.cat([per_sample[i] for i in range(len(samples))])
    result = {"tokens": int(truth.numel()), "engine_vs_trainer": stats(engine_lp, trainer),
              "engine_vs_fp32": stats(engine_lp, truth), "trainer_vs_fp32": stats(trainer, truth),
              "plain_sdpa_vs_fp32": stats(plain, truth), "plain_sdpa_vs_trainer": stats(plain, trainer)}
    for k, v in result.items():
        print(k, v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
