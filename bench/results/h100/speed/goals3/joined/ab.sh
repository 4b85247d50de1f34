# A/B of the joined GEMMs in eager steps: build/base (HEAD's unison) against the working tree, alternating.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name --format=csv,noheader
out=$OUT/joined; mkdir -p $out
run() {  # tree name, then the command
  local tree=$1; shift
  if [[ $tree == base ]]; then PYTHONPATH=$PWD/build/base:$PWD/bench:$PWD:/tmp/site "$@"; else PYTHONPATH=$PWD/bench:$PWD:/tmp/site "$@"; fi
}
for r in 1 2; do for t in base new; do
  run $t timeout 60 python3 bench/prefill_profile.py --shape qwen3-0.6b --concurrency 64 --prompt 64 --rounds 4 --timing-only \
    --json $out/prefill_64x64_${t}_$r.json 2>&1 | grep "^round [123]" | sed "s/^/[$t $r 64x64] /"
done; done
for t in base new; do
  run $t timeout 60 python3 bench/prefill_profile.py --shape qwen3-0.6b --concurrency 256 --prompt 128 --timing-only \
    --json $out/prefill_256x128_$t.json 2>&1 | grep "^round [12]" | sed "s/^/[$t 256x128] /"
done
for t in base new; do
  run $t timeout 90 python3 bench/multiturn.py --device cuda --shape qwen3-0.6b --n 64 --prompt 256 --turns 4 --new 64 \
    --appended 32 --stagger --waits 16,64 --json $out/multiturn_$t.json > $out/multiturn_$t.out 2>&1
  python3 -c "import json, sys; [print('[$t multiturn]', r['mode'], r['prefill_wait_steps'], round(r['wall_s'], 3), r['steps'], r['eager_steps']) for r in json.load(open(sys.argv[1]))['results']]" $out/multiturn_$t.json
done
run new timeout 110 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_fused_layer_gpu.py \
  tests/test_triton_gpu.py > $out/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -2 $out/gpu_tests.log
