#!/usr/bin/env bash
# The default model on one GPU, each run from configs/gpu.yaml (40 steps), the curve runs side by side on the GPU
# (their s/step is contended; the *_alone runs are not). Usage, from the repo root with unison's dependencies:
#   SET=objectives bench/train_variants.sh MODEL [OUT]   # default (dapo) beside loss.type=grpo and beta>0
#   SET=lora bench/train_variants.sh MODEL [OUT]         # LoRA r=16 at two lrs; the multi-turn sum_feedback task
# MODEL: the default model's name, or a path to its .gguf. Results (metrics, configs, logs, summary.json) under
# OUT/train_variants (OUT defaults to $OUT, else runs).
set -euo pipefail
model=$1; out=${2:-${OUT:-runs}}/train_variants; steps=${STEPS:-40}; alone=${STEPS_ALONE:-6}
mkdir -p "$out"
common=(configs/gpu.yaml --model.name_or_path="$model" --overwrite=true --log.report_to=[none])
python3 -m unison train "${common[@]}" --output_dir=/tmp/warm --max_steps=1 > "$out/warm.log" 2>&1  # converts once
run() {  # name, extra args...
  local name=$1; shift
  python3 -m unison train "${common[@]}" --output_dir=/tmp/tv_$name "$@" > "$out/$name.log" 2>&1 || echo "$name failed"
  for f in metrics.jsonl config.yaml completions.jsonl; do
    cp /tmp/tv_$name/$f "$out/$name.${f}" 2>/dev/null || true
  done
}
case ${SET:-objectives} in
  objectives)
    run dapo --max_steps=$steps &
    run grpo --max_steps=$steps --loss.type=grpo &
    run beta --max_steps=$steps --loss.beta=0.04 &
    wait
    run dapo_alone --max_steps=$alone
    run beta_alone --max_steps=$alone --loss.beta=0.04 ;;
  lora)
    lora=(--model.lora.r=16 --model.lora.alpha=32)
    run lora_lr5e-5 --max_steps=$steps "${lora[@]}" --optim.lr=5e-5 &
    run lora_lr2e-4 --max_steps=$steps "${lora[@]}" --optim.lr=2e-4 &
    run sum_feedback --max_steps=$steps --data.source=sum_feedback --episode.max_turns=3 --log.completions_every=10 &
    wait ;;
esac
python3 bench/train_variants_summary.py "$out"
