#!/usr/bin/env bash
# Issue 19 on the GPU machine (carry .whl: transformers 5.24, fla-core, einops; ../shared/tools/gpu-wheels.sh):
#   bash bench/hybrid_gpu.sh tests     # the hybrid GPU tests and the engine GPU tests they touch
#   bash bench/hybrid_gpu.sh decode    # bench/hybrid_decode.py: Qwen3.5-2B shape beside Qwen3-1.7B, 64 and 256 requests
#   bash bench/hybrid_gpu.sh step      # a GRPO step through unison train on the Qwen3.5 shape at lr 0
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/hybrid"
python3 -c "import torch, transformers, triton, fla; print(torch.__version__, transformers.__version__, triton.__version__, fla.__version__)"
case "${1:-tests}" in
  tests) timeout "${LIMIT:-300}" python3 -m pytest -q -m gpu -x -s -p no:cacheprovider tests/test_hybrid_gpu.py \
           ${MORE_TESTS:-} 2>&1 | grep -v "^\[transformers" | tail -40 ;;
  decode) (cd bench && timeout "${LIMIT:-280}" python3 hybrid_decode.py --device cuda \
           --json "$OUT/hybrid/hybrid_decode.json" 2>&1 | grep -v "^\[transformers" | tail -20) ;;
  step) (cd bench && timeout "${LIMIT:-500}" python3 grpo_step.py --systems unison --shapes hybrid:qwen3.5-2b,qwen3-1.7b \
           --unison-set optim.lr=0.0 --steps 3 --json "$OUT/hybrid/hybrid_grpo_step.json" 2>&1 \
           | grep -v "^\[transformers" | tail -20) ;;
esac
