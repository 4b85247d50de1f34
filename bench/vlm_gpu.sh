#!/usr/bin/env bash
# Issue 25 on the GPU machine (carry .whl: transformers 5.24, pillow; ../shared/tools/gpu-wheels.sh):
#   bash bench/vlm_gpu.sh tests    # tests/test_vlm_gpu.py, then the CPU VLM tests on this machine's GPU torch
#   bash bench/vlm_gpu.sh step     # bench/vlm_step.py: a Qwen2.5-VL-3B-shape GRPO step, images and text alone
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/vlm"
python3 -c "import torch, transformers, PIL; print(torch.__version__, transformers.__version__, PIL.__version__)"
case "${1:-tests}" in
  tests) timeout "${LIMIT:-300}" python3 -m pytest -q -x -s -p no:cacheprovider tests/test_vlm_gpu.py \
           ${MORE_TESTS:-} 2>&1 | grep -v "^\[transformers" | tail -30 ;;
  step) (cd bench && UNISON_COMMIT=${UNISON_COMMIT:-} timeout "${LIMIT:-500}" python3 vlm_step.py \
           --json "$OUT/vlm/vlm_step.json" ${STEP_ARGS:-} 2>&1 | grep -v "^\[transformers\|Loading weights\|Writing" | tail -30) ;;
esac
