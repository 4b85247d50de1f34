#!/usr/bin/env bash
# A change measured on one H200: every GPU test, then bench/grpo_step.py --systems unison for each shape, this
# tree ("new") and unison before the change ("old": the unison/ folder of the base commit unpacked into _old/, e.g.
# `git archive 4e4f089 unison | tar -x -C _old`), alternating. TREES=new or TREES=old skips the tests.
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
