#!/usr/bin/env bash
# Issue 23 on the GPU machine (carry .whl: transformers 5.24; ../shared/tools/gpu-wheels.sh; the TRL runs also take
# trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0, which the image lacks;
# the tests' SmolVLM processor num2words==0.5.14, the vision extra's):
#   bash bench/speed_gpu.sh profile   # engine_profile (0.6B at 256 and 64) and train_profile (0.6B, 1.7B)
#   bash bench/speed_gpu.sh engine    # bench/engine.py: 0.6B at 256 and 64 (unison alone), for each flag set of
#                                     # VARIANTS (default "-": as is), e.g. VARIANTS="- --no-fused-layers"
#   bash bench/speed_gpu.sh kernel    # bench/decode_kernel.py --suite short: the decode attention kernel's tiles,
#                                     # grid order and splits at a GRPO rollout's contexts, in graphs of 28 layers
#   bash bench/speed_gpu.sh grpo      # bench/grpo_step.py --systems unison, both shapes: the defaults, then each of
#                                     # SETS (default: step.fused_kernels=false memory.lend_kv=always), one at a time
#   bash bench/speed_gpu.sh decode    # bench/decode_linear.py, then bench/engine.py at 0.6B x 64 and 256: as is,
#                                     # with synchronous steps (--no-async), with cuBLAS's projections
#   bash bench/speed_gpu.sh tests     # the GPU tests of the engine's and the trainer's kernels
#   bash bench/speed_gpu.sh rollout   # bench/rollout_steps.py at 0.6B, then
#                                     # bench/grpo_step.py with TRL in the same run (SHAPES, default 0.6B)
#   bash bench/speed_gpu.sh timeline  # where the time goes: bench/train_timeline.py (0.6B), bench/rollout_steps.py
#                                     # (0.6B), bench/step_timeline.py (0.6B at 256)
#   bash bench/speed_gpu.sh goals     # issue 23's goals side by side, first thing on a fresh machine (~500 s with
#                                     # TRL, near a call's 600 s: speed/goals ran it as two calls of 248 and 255 s):
#                                     # bench/grpo_step.py with TRL both shapes, bench/engine.py at 256 with
#                                     # transformers' continuous batching and at 64, train_profile both shapes
#   bash bench/speed_gpu.sh host      # the training row's launches and host time (bench/train_launches.py at the 0.6B
#                                     # width and chunk), then train_profile at 0.6B over row lengths (ROWS)
#   bash bench/speed_gpu.sh attention # Nsight Compute's sections for the decode attention kernel at a GRPO rollout's
#                                     # shape (64 sequences x 352 keys, 0.6B heads, the engine's default tiles)
#   bash bench/speed_gpu.sh rope      # the one-launch attention (unison/engine/rope_decode.py): its GPU tests and
#                                     # bench/rope_parity_{kernel,engine}.py, then decode_step_kernels.py and
#                                     # rollout_steps.py (0.6B) with UNISON_ROPE_DECODE=0 and =1, then sampler_parts.py
#   bash bench/speed_gpu.sh rows      # prompt chunks as graph rows (unison/engine/row_graphs.py, on by default):
#                                     # its GPU tests and the engine's, then UNISON_ROW_GRAPHS=0 and =1 alternating:
#                                     # bench/prefill_profile.py at 8 x 64 (a GRPO rollout's prompts), rollout_steps.py
#                                     # (0.6B: its first step) and multiturn.py (staggered, the default hold)
#   bash bench/speed_gpu.sh graphmem  # bench/graph_memory.py: the memory the decode and row graphs hold after a run
#                                     # through every batch size, and a decode step at 256 and 64 (0.6B)
#   bash bench/speed_gpu.sh idle      # bench/gpu_idle.py: the device's idle time in engine.py's run at 256 and 64
#                                     # (0.6B), prefill and decode phases apart: is the decode at 256 host-bound?
#   bash bench/speed_gpu.sh rewards   # bench/grpo_step.py (0.6B, unison): random rewards, then math-verify's
#                                     # (reward_cost.realistic_math) inline and in REWARD_WORKERS (default 2) processes
#                                     # (carry math-verify==0.9.0 latex2sympy2_extended==1.11.0
#                                     # antlr4-python3-runtime==4.13.2: the image lacks them)
#   bash bench/speed_gpu.sh decode256 # bench/engine.py at 256 requests DECODE_RUNS times (4) at each of BUDGETS (token
#                                     # budgets a step, default 8192), then bench/step_timeline.py at each: the prefill
#                                     # steps' host time, which moves that goal's runs (speed/goals4)
#   bash bench/speed_gpu.sh pieces    # eager steps as graph pieces (unison/engine/piece_graphs.py): its GPU tests,
#                                     # then prefill_profile.py (256 x 128) and engine.py at 256 and 64 with
#                                     # UNISON_PIECE_GRAPHS=0 and =1 alternating, step_timeline.py at 256
#   bash bench/speed_gpu.sh suite     # every GPU test (pytest -m gpu) in one run: suite.log, the slowest 25
#   bash bench/speed_gpu.sh pieceprofile # bench/prefill_profile.py profiled (256 x 128, 8192-token steps), with
#                                     # UNISON_PIECE_GRAPHS=0 then =1: the step's kernels and host operators each way
#   bash bench/speed_gpu.sh multiturn # bench/multiturn.py at 0.6B, staggered turns, engine.prefill_wait_steps 16,
#                                     # 64 (the default) and 128 (speed/multiturn ran 0, 16, 64), then
#                                     # bench/loop_overlap.py (the episode loop on the overlapped engine) with the
#                                     # replies in the background and with --blocking, then bench/swap_cost.py (the
#                                     # eager step's kernel swaps on this host)
# Results under $OUT/speed/<TAG> (TAG defaults to "run"). BASE=build/base runs that tree's unison instead (an A/B:
# `rm -rf build/base && mkdir -p build/base && git archive <commit> unison | tar -x -C build/base`, carry build).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=${BASE:+$PWD/$BASE:}$PWD:/tmp/site
out=${OUT:-/tmp/out}/speed/${TAG:-run}; mkdir -p "$out"
quiet() { grep -v "^\[transformers\|Loading weights\|Writing" | tail -"${1:-40}"; }
for mode in "${@:-profile}"; do
  case "$mode" in
    profile)  # PROFILE: which of engine / train (default both)
      (cd bench
       if [[ "${PROFILE:-engine train}" == *engine* ]]; then
         for c in 256 64; do
           python3 engine_profile.py --shape qwen3-0.6b --concurrency $c --json "$out/engine_profile_0.6b_$c.json" \
             2>&1 | quiet 50
         done
       fi
       if [[ "${PROFILE:-engine train}" == *train* ]]; then
         python3 train_profile.py --shape qwen3-0.6b --rows 8192 16384 --json "$out/train_profile_0.6b.json" 2>&1 | quiet 30
         python3 train_profile.py --shape qwen3-1.7b --rows 8192 16384 --json "$out/train_profile_1.7b.json" 2>&1 | quiet 4
       fi) ;;
    engine)
      (cd bench
       for c in 256 64; do
         for v in ${VARIANTS:--}; do
           [[ $v == - ]] && v=""
           python3 engine.py --device cuda --shape qwen3-0.6b --concurrency $c --prompt 128 --new 256 ${v//,/ } \
             --json "$out/engine_0.6b_${c}${v//[-,]/_}.json" 2>&1 | grep "tok/s (" | sed "s/^/[${v:-default}] /"
         done
       done) ;;
    kernel)
      (cd bench && python3 decode_kernel.py --suite short --json "$out/decode_kernel_short.json" 2>&1 | quiet 8) ;;
    grpo)
      for shape in qwen3-0.6b qwen3-1.7b; do
        python3 bench/grpo_step.py --systems unison --shapes $shape --json "$out/grpo_${shape}_default.json" \
          --workdir /tmp/speed_$shape 2>&1 | tail -1
        for set in ${SETS:-step.fused_kernels=false memory.lend_kv=always}; do
          python3 bench/grpo_step.py --systems unison --shapes $shape --unison-set "$set" \
            --json "$out/grpo_${shape}_${set//[=.]/_}.json" --workdir /tmp/speed_${shape}_${set//[=.]/_} 2>&1 | tail -1
        done
      done ;;
    decode)  # VARIANTS_64 / VARIANTS_256: the bench/engine.py flags run at each concurrency ("-" alone: as is)
      (cd bench
       [[ -n ${ROWS-x} ]] && python3 decode_linear.py --rows ${ROWS:-1 16 64 128} --json "$out/decode_linear.json" 2>&1 \
         | quiet 16
       for c in 64 256; do
         var=VARIANTS_$c
         for v in ${!var:-- --no-async --no-fused-projections}; do
           [[ $v == - ]] && v=""
           python3 engine.py --device cuda --shape qwen3-0.6b --concurrency $c --prompt 128 --new 256 ${v//,/ } \
             --json "$out/engine_0.6b_${c}${v//[-,]/_}.json" 2>&1 | grep "tok/s (" | sed "s/^/[${v:-default}] /"
         done
       done) ;;
    rollout)
      python3 bench/rollout_steps.py --shape qwen3-0.6b --steps 5 --json "$out/rollout_steps_0.6b.json" 2>&1 \
        | grep -A12 "^rollout  total"
      for shape in ${SHAPES:-qwen3-0.6b}; do
        python3 bench/grpo_step.py --systems unison,trl --shapes $shape --steps 5 --unison-set save_final=false \
          --json "$out/grpo_${shape}_trl.json" --workdir /tmp/speed_$shape 2>&1 | tail -3
      done ;;
    timeline)
      (cd bench
       python3 train_timeline.py --shape qwen3-0.6b --rows 8192 --json "$out/train_timeline_0.6b.json" \
         --trace "$out/train_trace_0.6b.json.gz" 2>&1 | quiet 45
       python3 rollout_steps.py --shape qwen3-0.6b --steps 5 --json "$out/rollout_steps_0.6b.json" 2>&1 | quiet 30
       python3 step_timeline.py --shape qwen3-0.6b --concurrency 256 --json "$out/step_timeline_0.6b_256.json" 2>&1 \
         | quiet 30) ;;
    host)
      python3 bench/train_launches.py --device cuda --width 1024 --vocab 151936 --chunk 1024 --prompt 64 \
        --completion 512 --json "$out/train_launches.json" 2>&1 | grep -A12 '"forward"'
      (cd bench && python3 train_profile.py --shape qwen3-0.6b --rows ${ROWS:-16384 20480 24576 40960} --kernels on \
        --json "$out/train_profile_0.6b_rows.json" 2>&1 | quiet 8) ;;
    goals)  # GOALS_PARTS: "grpo" (with TRL), "rest" (engine, train_profile) or both (default; two calls: one each)
      if [[ "${GOALS_PARTS:-grpo rest}" == *grpo* ]]; then
        python3 bench/grpo_step.py --systems unison,trl --shapes qwen3-0.6b,qwen3-1.7b --steps 5 --trl-steps 2 \
          --unison-set save_final=false --json "$out/grpo_step.json" --workdir /tmp/goals 2>&1 | grep -A3 "^workload"
        cp /tmp/goals/*.log "$out/" 2>/dev/null  # a failed worker's whole output
      fi
      [[ "${GOALS_PARTS:-grpo rest}" == *rest* ]] && (cd bench
       python3 engine.py --device cuda --shape qwen3-0.6b --concurrency 256 --prompt 128 --new 256 --transformers \
         --json "$out/engine_0.6b_256.json" 2>&1 | grep -A2 "^workload"
       python3 engine.py --device cuda --shape qwen3-0.6b --concurrency 64 --prompt 128 --new 256 \
         --json "$out/engine_0.6b_64.json" 2>&1 | grep "tok/s ("
       for shape in qwen3-0.6b qwen3-1.7b; do
         python3 train_profile.py --shape $shape --rows 24576 --kernels on --json "$out/train_profile_$shape.json" 2>&1 \
           | grep "^optimizer alone"
       done) ;;
    rewards)  # what a verifier costs a GRPO step on this host, and what reward workers give back
      i=0
      for run in ${REWARD_RUNS:-"random,0" "math,0" "math,${REWARD_WORKERS:-2}"}; do
        IFS=, read -r reward workers <<< "$run"
        i=$((i + 1))
        python3 bench/grpo_step.py --systems unison --shapes qwen3-0.6b --steps ${REWARD_STEPS:-5} --reward $reward \
          --unison-set save_final=false --unison-set rollout.reward_workers=$workers \
          --json "$out/grpo_step_${i}_${reward}_w$workers.json" --workdir /tmp/rewards 2>&1 | grep -A2 "^workload"
      done ;;
    graphmem)  # what the captured graphs hold (bench/graph_memory.py, 0.6B, 256 requests); GRAPHMEM_BASE=1 runs
               # build/base's unison (an older tree, carried: see BASE below) first, in the same call
      for tree in ${GRAPHMEM_BASE:+$PWD/build/base} ""; do
        (cd bench && PYTHONPATH=${tree:+$tree:}$PYTHONPATH python3 graph_memory.py --shape qwen3-0.6b \
          --json "$out/graph_memory${tree:+_base}.json" 2>&1 | tail -3)
      done ;;
    attention)  # why the kernel reads K/V at ~3.2 of the ~4.3 TB/s a copy reaches (speed/goals/probe)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      cat > /tmp/ncu_decode.py <<'PY'
import sys
import torch
sys.path.insert(0, "bench")
from decode_kernel import DIM, PAGE, pools
from unison.engine.triton_attention import paged_decode
(layers, q, tables, lens) = pools(64, 352, 1)
k, v = layers[0]
for _ in range(4):
    paged_decode(q, k, v, tables, lens, PAGE, DIM**-0.5)
torch.cuda.synchronize()
PY
      timeout 240 "$NCU" --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --csv --page details python3 /tmp/ncu_decode.py > "$out/ncu_decode_64x352.csv" \
        2> "$out/ncu_decode.err"
      echo "ncu rc=$?"; tail -3 "$out/ncu_decode.err"
      python3 -c "import csv,sys; [print(r['Section Name'][:24], '|', r['Metric Name'][:48], '|', r['Metric Value'], \
        r['Metric Unit']) for r in csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith('=='))]" \
        "$out/ncu_decode_64x352.csv" | head -90 ;;
    rope)  # ROPE_PARTS: which of "tests kernels rollout sampler" (default all)
      if [[ "${ROPE_PARTS:-tests}" == *tests* ]]; then
        timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_rope_decode.py \
          "tests/test_fused_layer_gpu.py::test_engine_with_the_one_launch_attention_equals_the_two_launches" \
          "tests/test_triton_gpu.py::test_decode_kernel_on_gpu" > "$out/gpu_tests.log" 2>&1
        echo "tests rc=$?"; tail -3 "$out/gpu_tests.log"
        timeout 100 python3 bench/rope_parity_kernel.py 2>&1 | tail -2 | tee "$out/rope_parity_kernel.out"
        timeout 150 python3 bench/rope_parity_engine.py 2>&1 | grep "requests differ" | tee "$out/rope_parity_engine.out"
      fi
      for on in 0 1; do
        [[ "${ROPE_PARTS:-kernels}" == *kernels* ]] || continue
        mkdir -p "$out/rope$on"
        UNISON_ROPE_DECODE=$on CTX=300 OUT="$out/rope$on" timeout 120 python3 bench/decode_step_kernels.py \
          > "$out/decode_step_rope$on.out" 2>&1; grep "PDL=" "$out/decode_step_rope$on.out"
      done
      for on in 1 0; do
        [[ "${ROPE_PARTS:-rollout}" == *rollout* ]] || continue
        UNISON_ROPE_DECODE=$on timeout 150 python3 bench/rollout_steps.py --shape qwen3-0.6b --steps 3 \
          --json "$out/rollout_rope$on.json" > "$out/rollout_rope$on.out" 2>&1
        echo "UNISON_ROPE_DECODE=$on"; grep -A6 "^rollout  total" "$out/rollout_rope$on.out" | grep -v "host ms"
        grep "train_s of" "$out/rollout_rope$on.out"
      done
      [[ "${ROPE_PARTS:-sampler}" == *sampler* ]] && timeout 90 python3 bench/sampler_parts.py \
        --json "$out/sampler_parts.json" | tail -24 ;;
    idle)  # where the device waits in engine.py's run (bench/gpu_idle.py: torch.profiler's device intervals), at
           # IDLE_CONCURRENCY (default "256 64"): prefill and decode phases' idle time and gaps
      for c in ${IDLE_CONCURRENCY:-256 64}; do
        timeout 150 python3 bench/gpu_idle.py --concurrency $c --json "$out/gpu_idle_$c.json" 2>&1 | quiet 3
      done ;;
    decode256)  # decode at 256 requests, repeated (the goal whose runs vary): engine.py DECODE_RUNS times (default 4)
                # at each token budget of BUDGETS (default 8192), alternating, then step_timeline.py once at each
      (cd bench
       for r in $(seq ${DECODE_RUNS:-4}); do
         for t in ${BUDGETS:-8192}; do
           python3 engine.py --device cuda --shape qwen3-0.6b --concurrency 256 --prompt 128 --new 256 \
             --max-batch-tokens $t --json "$out/engine_256_${t}_$r.json" 2>&1 | grep "tok/s (" | sed "s/^/[$t #$r] /"
         done
       done
       for t in ${BUDGETS:-8192}; do
         python3 step_timeline.py --shape qwen3-0.6b --concurrency 256 --max-batch-tokens $t \
           --json "$out/step_timeline_256_$t.json" 2>&1 | quiet 3
       done) ;;
    pieces)  # eager steps as graph pieces (unison/engine/piece_graphs.py): PIECES_PARTS, which of "tests prefill
             # engine at64 timeline" (default all): its GPU tests and the engine's, then UNISON_PIECE_GRAPHS=0 and =1
             # alternating: bench/prefill_profile.py at 256 x 128 (steps of 8192 tokens), engine.py at 256 and 64,
             # then step_timeline.py at 256 with the pieces; PIECES_RUNS the order (default "0 1 0 1"),
             # PIECES_TESTS the test files
      if [[ "${PIECES_PARTS:-tests}" == *tests* ]]; then
        timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider -s \
          ${PIECES_TESTS:-tests/test_piece_graphs_gpu.py tests/test_row_graphs_gpu.py tests/test_engine_gpu.py} \
          > "$out/pieces_gpu_tests.log" 2>&1
        echo "tests rc=$?"; grep "mean |engine" "$out/pieces_gpu_tests.log"; tail -2 "$out/pieces_gpu_tests.log"
      fi
      for on in ${PIECES_RUNS:-0 1 0 1}; do
        [[ "${PIECES_PARTS:-prefill}" == *prefill* ]] && (cd bench && UNISON_PIECE_GRAPHS=$on timeout 90 python3 \
          prefill_profile.py --shape qwen3-0.6b --concurrency 256 --prompt 128 --rounds 3 --timing-only \
          --json "$out/prefill_256x128_pieces$on.json" 2>&1 | grep "^round [12]" | sed "s/^/[pieces=$on] /")
      done
      for on in ${PIECES_RUNS:-0 1 0 1}; do
        [[ "${PIECES_PARTS:-engine}" == *engine* ]] && (cd bench && UNISON_PIECE_GRAPHS=$on python3 engine.py \
          --device cuda --shape qwen3-0.6b --concurrency 256 --prompt 128 --new 256 \
          --json "$out/engine_256_pieces${on}_$RANDOM.json" 2>&1 | grep "tok/s (" | sed "s/^/[pieces=$on 256] /")
      done
      for on in 0 1; do
        [[ "${PIECES_PARTS:-at64}" == *at64* ]] && (cd bench && UNISON_PIECE_GRAPHS=$on python3 engine.py \
          --device cuda --shape qwen3-0.6b --concurrency 64 --prompt 128 --new 256 \
          --json "$out/engine_64_pieces$on.json" 2>&1 | grep "tok/s (" | sed "s/^/[pieces=$on 64] /")
      done
      [[ "${PIECES_PARTS:-timeline}" == *timeline* ]] && (cd bench && UNISON_PIECE_GRAPHS=1 python3 step_timeline.py \
        --shape qwen3-0.6b --concurrency 256 --json "$out/step_timeline_256_pieces.json" 2>&1 | quiet 3) ;;
    multiturn)
      timeout 300 python3 bench/multiturn.py --device cuda --shape qwen3-0.6b --n 64 --prompt 256 --turns 4 --new 64 \
        --appended 32 --stagger --waits ${WAITS:-16,64,128} --json "$out/multiturn_staggered.json" > "$out/multiturn.out" 2>&1
      echo "multiturn rc=$?"; python3 -c "import json, sys; [print(r['mode'], r['prefill_wait_steps'], round(r['wall_s'], 3),
        r['steps'], r['eager_steps']) for r in json.load(open(sys.argv[1]))['results']]" "$out/multiturn_staggered.json"
      for flags in "" --blocking; do  # the episode loop itself: steps launched ahead, wall time
        timeout 200 python3 bench/loop_overlap.py --shape qwen3-0.6b --episodes 64 --turns 4 --new 128 --batches 3 \
          $flags --json "$out/loop_overlap${flags:+_blocking}.json" 2>&1 | quiet 8
      done
      (cd bench && python3 swap_cost.py --json "$out/swap_cost.json" | tail -4) ;;
    rows)  # ROWS_PARTS: which of "tests prefill rollout multiturn" (default all) or "crossover"; WAITS: multiturn.py's
           # holds (64); CROSSOVER_SHAPES: row_steps.py's shapes for "crossover" (default qwen3-4b: ROW_TOKEN_PARAMS
           # allows it 384 rows, unmeasured; 8B's 256 measured in speed/rows/crossover_8b, ~20 s with this grid)
      if [[ "${ROWS_PARTS:-}" == *crossover* ]]; then
        for s in ${CROSSOVER_SHAPES:-qwen3-4b}; do
          (cd bench && timeout 400 python3 row_steps.py --shape $s --n 8 16 64 --lengths 16 32 64 --contexts 64 1024 \
            --json "$out/row_steps_$s.json" 2>&1 \
            | grep -v "^\[transformers\|Loading" | tail -40)
        done
      fi
      if [[ "${ROWS_PARTS:-tests}" == *tests* ]]; then
        UNISON_ROW_GRAPHS=1 timeout 240 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_row_graphs_gpu.py \
          tests/test_engine_gpu.py tests/test_fused_layer_gpu.py > "$out/rows_gpu_tests.log" 2>&1
        echo "tests rc=$?"; grep "mean |engine" "$out/rows_gpu_tests.log"; tail -2 "$out/rows_gpu_tests.log"
      fi
      for on in 0 1 0 1; do
        [[ "${ROWS_PARTS:-prefill}" == *prefill* ]] && (cd bench && UNISON_ROW_GRAPHS=$on timeout 60 python3 \
          prefill_profile.py --shape qwen3-0.6b --concurrency 8 --prompt 64 --rounds 4 --timing-only \
          --json "$out/prefill_8x64_rows$on.json" 2>&1 | grep "^round [123]" | sed "s/^/[rows=$on] /")
      done
      for on in 0 1; do
        [[ "${ROWS_PARTS:-rollout}" == *rollout* ]] || continue
        UNISON_ROW_GRAPHS=$on timeout 150 python3 bench/rollout_steps.py --shape qwen3-0.6b --steps 3 \
          --json "$out/rollout_rows$on.json" > "$out/rollout_rows$on.out" 2>&1
        echo "UNISON_ROW_GRAPHS=$on"; grep -A6 "^rollout  total" "$out/rollout_rows$on.out" | grep -v "host ms"
      done
      for on in 0 1; do
        [[ "${ROWS_PARTS:-multiturn}" == *multiturn* ]] || continue
        UNISON_ROW_GRAPHS=$on timeout 150 python3 bench/multiturn.py --device cuda --shape qwen3-0.6b --n 64 --prompt 256 \
          --turns 4 --new 64 --appended 32 --stagger --waits ${WAITS:-64} --json "$out/multiturn_rows$on.json" \
          > "$out/multiturn_rows$on.out" 2>&1
        python3 -c "import json, sys; [print('rows=$on', r['mode'], r['prefill_wait_steps'], round(r['wall_s'], 3),
          r['steps'], r['eager_steps'], r['row_graph_steps']) for r in json.load(open(sys.argv[1]))['results']]" "$out/multiturn_rows$on.json"
      done ;;
    suite)  # every GPU test (-m gpu) in one run, SUITE_LIMIT seconds (default 420): the log and the slowest tests
      timeout ${SUITE_LIMIT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs --durations=25 tests \
        > "$out/suite.log" 2>&1
      echo "suite rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.log" | tail -12 ;;
    pieceprofile)  # one 8192-token prefill step (256 x 128) under torch.profiler and cProfile, the pieces off then on
      for on in 0 1; do
        (cd bench && UNISON_PIECE_GRAPHS=$on timeout 120 python3 prefill_profile.py --shape qwen3-0.6b \
          --concurrency 256 --prompt 128 --rounds 3 --json "$out/prefill_profile_pieces$on.json" \
          > "$out/prefill_profile_pieces$on.out" 2>&1; echo "[pieces=$on] rc=$? $(grep -o '"full_step_ms_median.*' \
          "$out/prefill_profile_pieces$on.out" | tail -1)")
      done ;;
    tests)
      timeout "${LIMIT:-300}" python3 -m pytest -q -x -s -p no:cacheprovider ${TESTS:-tests/test_fused_train_gpu.py \
        tests/test_triton_gpu.py tests/test_engine_gpu.py tests/test_fused_layer_gpu.py} 2>&1 | tee "$out/tests.log" \
        | quiet 40 ;;
  esac
done
