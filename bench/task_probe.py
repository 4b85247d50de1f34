"""Which task can the default policy learn from? Sample it on candidate tasks and prompt formats.

For each candidate: ``--prompts`` questions x ``--group`` samples each (plain transformers ``generate``,
left padding, sampling at each of ``--temperatures`` with top_k=0 and top_p=1 as the engine samples), then per
candidate: how often an answer is found (strict first line / ``<answer>`` tags / unison's extraction),
exact-answer success under each, the mean shaped reward (unison's reward functions with the task's
weights), its spread within groups (GRPO learns nothing from a group whose rewards are all equal) and
the completion length. Prints a table and writes JSON to ``bench/results/task_probe_<host>.json``.

    python bench/task_probe.py                          # all candidates, ~1 min each on 2 CPU threads
    python bench/task_probe.py --only basic_arithmetic --temperatures 0.7
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from unison.models import DEFAULT_MODEL, load_policy, stop_token_ids
from unison.tasks import DataConfig, chat_prompt, load_task
from unison.tasks.gym import ANSWER_FORMAT, gym_row
from unison.tasks.rewards import _TAGGED, extract_answer

FORMATS = {
    # what the earlier probe used: the first line must be the answer
    "bare": "Give only the final answer.",
    "tags+42": "Reply with the final answer in <answer></answer> tags, for example <answer>42</answer>.",
    "tags+N": "Reply with the final answer in <answer></answer> tags, like <answer>N</answer>.",
    "answer-line": "End your reply with a line 'Answer: <the number>'.",
    "default": ANSWER_FORMAT,  # unison's: "Put the final answer in <answer></answer> tags."
}
TERSE = "You are a calculator. Reply with the answer only, inside <answer></answer> tags."
SHOWN = "Reply with the result in <answer></answer> tags. Example: Calculate 2 + 3. -> <answer>5</answer>"
SYSTEM_NAMES = {None: "", TERSE: "+terse system", SHOWN: "+example system"}

PLUS = {"operators": ("+",)}
CANDIDATES = [  # (task, reasoning-gym settings over unison's preset, prompt format, system prompt)
    # prompt formats, on one-digit sums
    ("basic_arithmetic", PLUS, "bare", None),
    ("basic_arithmetic", PLUS, "tags+42", None),
    ("basic_arithmetic", PLUS, "tags+N", None),
    ("basic_arithmetic", PLUS, "answer-line", None),
    ("basic_arithmetic", PLUS, "default", None),
    ("basic_arithmetic", PLUS, "default", TERSE),
    ("basic_arithmetic", PLUS, "default", SHOWN),
    # tasks at unison's presets (unison.tasks.gym.PRESETS), unison's format
    ("basic_arithmetic", {}, "default", None),
    ("chain_sum", {}, "default", None),
    ("products", {}, "default", None),
    ("leg_counting", {}, "default", None),
    ("spell_backward", {}, "default", None),
    ("word_sequence_reversal", {}, "default", None),
]



def first_line(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip().rstrip(".")


def probe(model, tokenizer, source, gym, fmt, system, temperature, args) -> dict:
    task = load_task(DataConfig(source=source, size=args.prompts, seed=args.seed, gym=gym, system_prompt=system))
    rows = [gym_row(r, FORMATS[fmt]) for r in task.rows]
    texts = [chat_prompt(tokenizer, r["prompt"], task.system_prompt) for r in rows for _ in range(args.group)]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    stops = stop_token_ids(tokenizer, model)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    gen = out[:, enc.input_ids.shape[1]:]
    lengths = [_length(ids, stops) for ids in gen.tolist()]
    completions = tokenizer.batch_decode(gen, skip_special_tokens=True)
    expanded = [r for r in rows for _ in range(args.group)]
    rewards = task.score(completions, expanded)
    scorer = task.reward_fns[0][0].score  # the exact-answer reward's scorer (the task's own)
    strict = [scorer(first_line(c), r) >= 1.0 for c, r in zip(completions, expanded, strict=True)]
    tagged = [bool(_TAGGED.findall(c)) for c in completions]
    tag_ok = [t and scorer(extract_answer(c), r) >= 1.0 for t, c, r in zip(tagged, completions, expanded,
                                                                         strict=True)]
    found = [extract_answer(c) is not None for c in completions]
    robust_ok = [f and scorer(extract_answer(c), r) >= 1.0 for f, c, r in zip(found, completions, expanded,
                                                                            strict=True)]
    groups = [rewards[i:i + args.group] for i in range(0, len(rewards), args.group)]
    stds = [statistics.pstdev(g) for g in groups]
    return {
        "task": source, "gym": gym, "format": fmt + SYSTEM_NAMES[system], "n": len(completions),
        "temperature": temperature,
        "strict_first_line": _mean(strict), "tags_found": _mean(tagged), "tags_correct": _mean(tag_ok),
        "answer_found": _mean(found), "correct": _mean(robust_ok),
        "reward_mean": _mean(rewards), "group_std_mean": _mean(stds),
        "groups_with_spread": _mean([s > 1e-6 for s in stds]),
        "mean_tokens": _mean(lengths), "truncated": _mean([n >= args.max_new_tokens for n in lengths]),
        "gen_seconds": round(seconds, 1),
        "examples": [{"prompt": expanded[i]["prompt"], "answer": expanded[i]["answer"],
                      "completion": completions[i], "reward": rewards[i]} for i in range(0, len(completions), 7)],
    }


def _length(ids: list[int], stops: list[int]) -> int:
    for i, t in enumerate(ids):
        if t in stops:
            return i + 1
    return len(ids)


def _mean(xs) -> float:
    xs = [float(x) for x in xs]
    return round(sum(xs) / len(xs), 3) if xs else 0.0


COLUMNS = ["strict_first_line", "tags_found", "tags_correct", "answer_found", "correct", "reward_mean",
           "group_std_mean", "groups_with_spread", "mean_tokens", "truncated", "gen_seconds"]


def print_table(results: list[dict]) -> None:
    head = ["task (settings)", "format", "T", *COLUMNS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        name = r["task"] + (" " + ",".join(f"{k}={v}" for k, v in r["gym"].items()) if r["gym"] else "")
        print("| " + " | ".join([name, r["format"], str(r["temperature"]), *(str(r[c]) for c in COLUMNS)]) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--only", default="", help="run candidates whose task name contains this")
    p.add_argument("--format", default="", help="run candidates with this prompt format only")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="1.0,0.7", help="comma-separated sampling temperatures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(args.model)
    tokenizer.padding_side = "left"
    results = []
    for temperature in map(float, args.temperatures.split(",")):
        for source, gym, fmt, system in CANDIDATES:
            if args.only not in source or (args.format and fmt != args.format):
                continue
            torch.manual_seed(args.seed)  # each row reproducible on its own
            results.append(probe(model, tokenizer, source, gym, fmt, system, temperature, args))
            r = results[-1]
            print(f"T={temperature} {source} {gym} {r['format']}: correct {r['correct']} reward "
                  f"{r['reward_mean']} spread {r['groups_with_spread']} ({r['gen_seconds']} s)", flush=True)
    print_table(results)
    out = Path(args.out or Path(__file__).parent / "results" / f"task_probe_{platform.machine()}_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"config": config, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
