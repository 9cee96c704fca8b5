#!/usr/bin/env bash
# On the GPU host, from the repository root (the payload of `node tools/gpu/bundle.mjs` in .gpu/):
#   bash .gpu/run.sh            the kernel self-test, the torch peer, the pure-read floor, then the benchmark
#   bash .gpu/run.sh profile    per-kernel times and throughput of the hot kernels under Nsight Compute
# Results go to $OUT (default /tmp).
set -u
out=${OUT:-/tmp}
xz -dc .gpu/node.xz > /tmp/node && chmod +x /tmp/node
if [ "${1:-}" = profile ]; then
  /tmp/node .gpu/profile.mjs
  KDTREE_PROFILE_SKIP_HOST=1 ncu --csv --page raw \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    /tmp/node .gpu/profile.mjs > "$out/ncu.csv"; rc=$?
  # the limiter of the M = 1 expert GEMM: pipes, stall reasons, memory
  KDTREE_PROFILE_SKIP_HOST=1 ncu --kernel-name regex:W4A16 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    /tmp/node .gpu/profile.mjs > "$out/ncu-gemm.txt" 2>&1
  exit $rc
fi
OUT=$out /tmp/node .gpu/selftest.mjs; st=$?
python3 .gpu/dense_baseline.py "$out/dense.json"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 .gpu/stream_floor.cu -o /tmp/stream_floor && /tmp/stream_floor > "$out/floor.md"
OUT=$out /tmp/node .gpu/bench.mjs "$out/dense.json"; bt=$?
exit $(( st || bt ))
