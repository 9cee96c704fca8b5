// What the warpgroup-MMA (wgmma) W4A16 kernels share (sm_90a only): the staged x in wgmma's
// B-operand order, shared-memory descriptors, commit-group waits, and the replay of the stream-K
// kernel's split of a tile (w4a16_gemm.cu), which keeps their results bit-identical to it.
#pragma once
#include "w4a16_kernel.cuh"
#include "wgmma_ops.cuh"

namespace kdtree {
namespace cuda {
namespace w4a16 {
namespace {

// Copies of the staged x a launch may ask for (StageWgmmaXKernel).
constexpr int kMaxXCopies = 8;

// The staged B operand, per token tile of kTileTokens and step: [slice 2 b + s][k half kb][tokens]
// [8 k], bf16: wgmma's no-swizzle core matrices (8 tokens x 16 bytes), so a step is one contiguous
// copy. Slice element kk = 8 kb + e of slice (b, s) is the k that the packed codes give MMA k index
// kk (w4a16_layout.h: lane t's nibbles are k = 32 b + 8 t + 4 s + {0, 1} and + {2, 3}):
// k = 128 step + 32 b + 8 (e >> 1) + 4 s + 2 kb + (e & 1). Zero past K and past the tile's rows.
// `copies` identical copies follow each other (readers spread over them).
template <int kTileTokens>
__global__ void StageWgmmaXKernel(const GemmParams p, int chunk_tiles, int copies, uint4* xs) {
  PdlWait();  // x is the previous kernel's, and the previous GEMM may still read xs
  PdlLaunchDependents();
  constexpr int kStepUnits = w4::kStepK * kTileTokens * 2 / 16;  // 16-byte units per step
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t units = static_cast<int64_t>(p.steps) * kStepUnits;  // per token tile
  if (i >= units * chunk_tiles) return;
  const int tt = static_cast<int>(i / units), u = static_cast<int>(i % units);
  const int step = u / kStepUnits, slice = (u / (2 * kTileTokens)) % 8, b = slice >> 1, s = slice & 1;
  const int kb = (u / kTileTokens) & 1, token = u % kTileTokens;
  const int row_start = (p.tile_offset + tt) * kTileTokens, rows = min(kTileTokens, p.M - row_start);
  uint32_t v[4] = {0u, 0u, 0u, 0u};
  if (token < rows) {
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x) + static_cast<int64_t>(row_start + token) * p.K;
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {
      const int k = 128 * step + 32 * b + 8 * e2 + 4 * s + 2 * kb;  // a bf16 pair: K is even
      if (k < p.K) v[e2] = *reinterpret_cast<const uint32_t*>(x + k);
    }
  }
  const uint4 value = make_uint4(v[0], v[1], v[2], v[3]);
#pragma unroll
  for (int c = 0; c < kMaxXCopies; ++c)
    if (c < copies) xs[c * units * chunk_tiles + i] = value;
}

// Of `groups` (<= 4) commit groups issued in order, waits for group q (q compile-time once unrolled).
template <int kGroups>
__device__ __forceinline__ void WaitForGroup(int q) {
  static_assert(kGroups >= 1 && kGroups <= 4, "a step has 1, 2 or 4 scale groups");
  switch (kGroups - 1 - q) {
    case 3: WgmmaWait<3>(); break;
    case 2: WgmmaWait<2>(); break;
    case 1: WgmmaWait<1>(); break;
    default: WgmmaWait<0>(); break;
  }
}
// Where the stream-K kernel cuts a tile, and how it combines the pieces (w4a16_gemm.cu:
// BlockRange, CombineSplitTiles): pieces end at multiples of steps_per_warp, blocks at multiples
// of steps_per_block; a tile in one piece is stored as its accumulator, otherwise each block's
// pieces are summed from 0.f in order and two blocks' sums added.
struct TileSplit {
  int f_end;       // the tile's end in the matrix's step space
  int piece_end;   // the current piece's end
  int block_end;   // the current block's end
  bool whole;      // one piece
  bool two_blocks;
};
__device__ __forceinline__ TileSplit SplitOf(const GemmParams& p, int tile) {
  const int f0 = tile * p.steps, f1 = f0 + p.steps;
  const int piece = p.by_steps_per_warp.Div(f0), block = f0 / p.steps_per_block;
  TileSplit t;
  t.f_end = f1;
  t.piece_end = min(f1, (piece + 1) * p.steps_per_warp);
  t.block_end = (block + 1) * p.steps_per_block;
  t.whole = t.piece_end == f1;
  t.two_blocks = t.block_end < f1;
  return t;
}

// A scale group's exact sums (part, a kN-float wgmma accumulator) scaled into acc: elements 4 j + i
// hold row g (i < 2, scale s_lo) or g + 8 (s_hi), as the decode kernel's fmaf chain does.
template <int kN>
__device__ __forceinline__ void ScaleGroup(float (&acc)[kN], const float (&part)[kN], float s_lo, float s_hi) {
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {
    acc[4 * j + 0] = fmaf(part[4 * j + 0], s_lo, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(part[4 * j + 1], s_lo, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(part[4 * j + 2], s_hi, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(part[4 * j + 3], s_hi, acc[4 * j + 3]);
  }
}
// After a step of the tile (f: the next step's index in the matrix's step space): where the stream-K
// kernel ends a piece, acc is folded into the block sum and restarts; where it ends a block inside
// the tile, the block sum waits in first_block[i * stride] (shared memory) and restarts.
template <int kN>
__device__ __forceinline__ void ReplayStepEnd(const GemmParams& p, TileSplit& split, int f, float (&acc)[kN], float (&block_sum)[kN], float* first_block, int stride) {
  if (__builtin_expect(f == split.piece_end && !split.whole, 0)) {  // a warp-uniform branch, not selects: rare
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      block_sum[i] += acc[i];
      acc[i] = 0.f;
    }
    if (f == split.block_end && f < split.f_end) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        first_block[i * stride] = block_sum[i];
        block_sum[i] = 0.f;
      }
    }
    split.piece_end = min(split.f_end, f + p.steps_per_warp);
  }
}
// Element i of the tile's result: one piece, one block's sum, or two blocks' sums added.
template <int kN>
__device__ __forceinline__ float ReplayResult(const TileSplit& split, int i, const float (&acc)[kN], const float (&block_sum)[kN], const float* first_block, int stride) {
  return split.whole ? acc[i] : split.two_blocks ? first_block[i * stride] + block_sum[i] : block_sum[i];
}

}  // namespace
}  // namespace w4a16
}  // namespace cuda
}  // namespace kdtree
