#!/usr/bin/env bash
# On the GPU host, from the repository root (the payload of `node tools/gpu/bundle.mjs` in .gpu/):
#   bash .gpu/run.sh            the kernel self-test (first its precondition: wgmma rounds as mma.sync, wgmma_equiv.cu;
#                               it stops with exit 2 where that fails), the torch peers (dense bf16, int4), the
#                               pure-read floor, then the benchmark
#   bash .gpu/run.sh engine     the engine's exactness suite on cuda, its benchmark and transformers' (engine-*.mjs, hf_peer.py)
#   bash .gpu/run.sh nccl       NCCL on one GPU (nccl-check.mjs): version, a world-1 communicator, collectives captured
#                               in a graph, tp-1 decode over NCCL == plain, per-layer all-reduce times; JSON on stdout
#   bash .gpu/run.sh profile    per-kernel times and throughput of the hot kernels under Nsight Compute
#   bash .gpu/run.sh ddtree-phases   the cluster DDTree build's phases (ddtree_phases.cu, built here from
#                               native/src with nvcc): the expansion and a part's pass alone, block 0's clock
#                               at each phase of a launch, the empty-cluster floor; $OUT/ddtree-phases.md
#   bash .gpu/run.sh ab         same-run A/B: the self-test of this binary, then the benchmark of it and
#                               of every other build in .gpu/v*/kdtree_cuda.node, interleaved, twice;
#                               with AB_NCU=<kernel regex> also each build's Nsight kernel times
#                               (profile.mjs, cold caches) in $OUT/ncu-<build>.txt
#                               KDTREE_BENCH_ONLY=gemm limits every benchmark to the W4A16 and MoE figures,
#                               =float to the bf16-weight gemm,
#                               KDTREE_BENCH_ONLY=attention to the MLA and DDTree ones, =ddtree to the one-launch DDTree builds, =small to the small ops,
#                               KDTREE_BENCH_MS=512,2048 the W4A16 rows to those token counts;
#                               $OUT/ab-table.txt has them side by side (ab_table.py)
# Results go to $OUT (default /tmp). An A/B variant is another build of the addon, e.g. with a macro,
# in a fresh build directory (`cmake-js compile` keeps an existing directory's CMAKE_CUDA_FLAGS):
#   rm -rf /tmp/vb-x && (cd packages/cuda && node node_modules/cmake-js/bin/cmake-js compile --directory ../../native \
#     --out /tmp/vb-x --config Release --CDKDTREE_VERSION=0.1.0 --CDKDTREE_CUDA=ON "--CDCMAKE_CUDA_FLAGS=-DNAME") \
#   && mkdir -p .gpu/vx && cp /tmp/vb-x/Release/kdtree_cuda.node .gpu/vx/
set -u
out=${OUT:-/tmp}
mkdir -p "$out"
xz -dc .gpu/node.xz > /tmp/node && chmod +x /tmp/node
if [ "${1:-}" = nccl ]; then
  NCCL_NVLS_ENABLE=0 OUT=$out /tmp/node .gpu/nccl-check.mjs
  exit $?
fi
if [ "${1:-}" = engine ]; then
  # the engine: its exactness suite on cuda, then its benchmark and transformers' in the same run
  OUT=$out /tmp/node .gpu/engine-check.mjs > "$out/engine-check.log" 2>&1; ec=$?
  tail -3 "$out/engine-check.log"
  OUT=$out /tmp/node .gpu/engine-bench.mjs > "$out/engine-bench.log" 2>&1; eb=$?
  tail -40 "$out/engine-bench.log"
  python3 .gpu/hf_peer.py "$out/hf-peer.json" "${KDTREE_HF_EXPERTS:-384,64}" > "$out/hf-peer.log" 2>&1; hp=$?
  tail -5 "$out/hf-peer.log"
  exit $(( ec || eb || hp ))
fi
if [ "${1:-}" = ddtree-phases ]; then
  nvcc -std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I native/include -I native/src \
    -DKDTREE_DDTREE_PHASES .gpu/ddtree_phases.cu native/src/common/dispatch_policy.cc -o /tmp/ddtree_phases \
    && /tmp/ddtree_phases > "$out/ddtree-phases.md"; rc=$?
  cat "$out/ddtree-phases.md"
  exit $rc
fi
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
if [ "${1:-}" = ab ]; then
  OUT=$out /tmp/node .gpu/selftest.mjs > "$out/selftest.log" 2>&1; st=$?
  tail -1 "$out/selftest.log"
  [ $st -eq 2 ] && exit 2  # its precondition failed (the line above)
  peers=()  # the torch peers' JSON, for the W4A16 table (only an A/B with the W4A16 figures has them)
  if [ -z "${KDTREE_BENCH_ONLY:-}" ] || [ "$KDTREE_BENCH_ONLY" = gemm ] || [ "$KDTREE_BENCH_ONLY" = float ]; then
    python3 .gpu/dense_baseline.py "$out/dense.json" > /dev/null
    python3 .gpu/int4_peer.py "$out/int4.json" > /dev/null
    peers=("$out/dense.json" "$out/int4.json")
  fi
  variants=(.gpu)
  for d in .gpu/v*/; do
    [ -f "$d/kdtree_cuda.node" ] || continue
    for f in bench.mjs profile.mjs kdtree_cpu.node kdtree_cpu.json kdtree_cuda.json; do [ -f "$d/$f" ] || cp ".gpu/$f" "$d/"; done
    variants+=("${d%/}")
  done
  for r in 1 2; do
    for d in "${variants[@]}"; do
      name=$(basename "$d"); [ "$d" = .gpu ] && name=new
      mkdir -p "$out/$name-$r"
      OUT="$out/$name-$r" /tmp/node "$d/bench.mjs" "${peers[@]}" > "$out/$name-$r.log" 2>&1
      echo "bench $name (round $r): rc=$?"
    done
  done
  python3 .gpu/ab_table.py "$out" > "$out/ab-table.txt"
  if [ -n "${AB_NCU:-}" ]; then
    for d in "${variants[@]}"; do
      name=$(basename "$d"); [ "$d" = .gpu ] && name=new
      KDTREE_PROFILE_SKIP_HOST=1 ncu --kernel-name "regex:$AB_NCU" --metrics gpu__time_duration.sum /tmp/node "$d/profile.mjs" > "$out/ncu-$name.txt" 2>&1
      echo "ncu $name: rc=$?"
    done
  fi
  exit $st
fi
OUT=$out /tmp/node .gpu/selftest.mjs; st=$?
[ $st -eq 2 ] && exit 2  # its precondition failed (the message above): nothing else is worth measuring
python3 .gpu/dense_baseline.py "$out/dense.json"
python3 .gpu/int4_peer.py "$out/int4.json"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 .gpu/stream_floor.cu -o /tmp/stream_floor && /tmp/stream_floor > "$out/floor.md"
OUT=$out /tmp/node .gpu/bench.mjs "$out/dense.json" "$out/int4.json"; bt=$?
exit $(( st || bt ))
