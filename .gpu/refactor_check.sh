#!/usr/bin/env bash
# Issue 17 items 2-5 on one H200: every GPU test, then bench/grpo_step.py --systems unison for each shape, this tree
# and unison before the refactor (_old: unison at 4e4f089), alternating.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
[ -n "${TREES:-}" ] || timeout ${TEST_S:-330} python3 -m pytest -q -m gpu tests/ -x -p no:cacheprovider 2>&1 | tail -${TAIL:-6}
for shape in ${SHAPES:-qwen3-0.6b qwen3-1.7b}; do
  for tree in ${TREES:-new old}; do
    if [ $tree = old ]; then pp=$PWD/_old:/tmp/site; else pp=$PWD:/tmp/site; fi
    PYTHONPATH=$pp python3 bench/grpo_step.py --systems unison --shapes $shape --json $OUT/grpo_${shape}_${tree}.json \
      --workdir /tmp/g_${shape}_${tree} 2>&1 | tail -2
  done
done
