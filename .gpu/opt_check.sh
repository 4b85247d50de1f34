#!/usr/bin/env bash
# Issue 17 item 1 on one H200: the GPU optimizer tests, then bench/grpo_step.py --systems unison for each shape,
# the composed optimizer (this tree) and the five classes before it (_old: unison at 45375cc), alternating.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
[ -n "${TREES:-}" ] || python3 -m pytest -q -m gpu tests/test_memory_gpu.py tests/test_engine_gpu.py 2>&1 | tail -3
for shape in qwen3-0.6b qwen3-1.7b; do
  for tree in ${TREES:-new old}; do
    if [ $tree = old ]; then pp=$PWD/_old:/tmp/site; else pp=$PWD:/tmp/site; fi
    PYTHONPATH=$pp python3 bench/grpo_step.py --systems unison --shapes $shape --json $OUT/grpo_${shape}_${tree}.json \
      --workdir /tmp/g_${shape}_${tree} 2>&1 | tail -3
  done
done
