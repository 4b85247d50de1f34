#!/usr/bin/env bash
# Issue 23 on the GPU machine (carry .whl: transformers 5.24): the projection probe (bench/proj_probe.py) at 64 rows
# on the 0.6B shape's four projections and at 256 rows on q/k/v and gate/up; Nsight Compute's memory counters for
# fused_linear's kernel and cuBLAS's on the q/k/v shape at 64 rows; engine_profile at 64 requests.
# Results under $OUT/probe.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
out=${OUT:-/tmp/out}/probe; mkdir -p "$out"
cd bench
for step in ${STEPS:-probe ncu profile}; do
  case $step in
    probe)
      python3 proj_probe.py --rows 64 --json "$out/proj_probe_64.json" 2>&1 | grep -v "^  not timed" | tail -12
      python3 proj_probe.py --rows 256 --shapes qkv gate_up --json "$out/proj_probe_256.json" 2>&1 \
        | grep -v "^  not timed" | tail -4 ;;
    ncu)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      cat > /tmp/ncu_target.py <<'PY'
import torch, torch.nn.functional as F
from unison.engine import fused_linear
x = torch.randn(64, 1024, device="cuda").bfloat16()
w = torch.randn(4096, 1024, device="cuda").bfloat16()
for _ in range(3):
    fused_linear.linear(x, w); F.linear(x, w)
torch.cuda.synchronize()
PY
      timeout 240 "$NCU" --clock-control none --launch-skip 2 --launch-count 4 --csv --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 /tmp/ncu_target.py > "$out/ncu_qkv_64.csv" 2> "$out/ncu.err"
      echo "ncu rc=$?"; tail -3 "$out/ncu.err"
      python3 -c "import csv,sys; [print(r['ID'], r['Kernel Name'][:40], r['Metric Name'], r['Metric Value']) for r in csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith('=='))]" "$out/ncu_qkv_64.csv" | tail -40 ;;
    profile)
      python3 engine_profile.py --shape qwen3-0.6b --concurrency 64 --json "$out/engine_profile_0.6b_64.json" 2>&1 \
        | grep -v "^\[transformers\|Loading weights" | tail -30 ;;
  esac
done
