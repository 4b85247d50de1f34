#!/usr/bin/env bash
# Issue 4 on the GPU machine: kernel and engine tests, the kernel sweep, the engine benchmark.
#   bash bench/gpu_engine.sh [suite]    (carry .gpu/tf: the transformers wheel the image lacks)
set -uo pipefail
pip install -q --no-deps --target /tmp/site .gpu/tf/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -m gpu -x tests/test_triton_gpu.py tests/test_engine_gpu.py -s 2>&1 | tail -15
fi
if [ "${KERNEL:-1}" = 1 ]; then
  python3 bench/decode_kernel.py --json "$OUT/decode_kernel.json" 2>&1 | tail -60
fi
python3 bench/engine.py --device cuda --suite "${1:-quick}" ${BENCH_ARGS:-} --json "$OUT/engine.json" 2>&1 | tail -20
