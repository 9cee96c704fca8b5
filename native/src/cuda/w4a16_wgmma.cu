// W4A16 GEMM for 17+ tokens on Hopper's warpgroup MMA (sm_90a only; w4a16_gemm.cu decides when
// it runs and falls back to its stream-K kernels elsewhere).
//
// Why: the stream-K kernels give each warp its own range of k, so at 17-64 tokens every warp reads
// its own 8-16 KB of staged x per KB of weights (from L2) and its B fragments out of it: 0.2-1.0x
// the speed of a dense bf16 GEMM. Here the four warps of a warpgroup hold four 16-row tiles at the
// same k, so one wgmma.m64n32k16 per k16 slice multiplies all of them with one copy of x that the
// tensor cores read from shared memory: per weight byte the loop is the decode kernel's
// (dequantization, one MMA per slice, the group scales for 32 tokens) plus 64 bytes of copies per
// thread and step.
//
// Batch invariance: a row must come out with the bits the decode kernel gives it alone. wgmma
// rounds a column's chained k16 sums exactly as mma.sync does (tools/gpu/wgmma_equiv.cu),
// the group scaling is the same fmaf chain, and a warp replays the stream-K kernel's split of its
// tile: it restarts its accumulator where that kernel's warp ranges (multiples of steps_per_warp)
// cut the tile, sums the pieces of each block in order from 0.f as the block combine does, and adds
// the two block sums of a tile that crosses a block boundary as the exchange does. So the result
// is the stream-K kernel's at any M, while a warp here walks its whole tile (no combine, no
// exchange) and a warpgroup has the K extent of four tiles.
//
// Work: one warpgroup (a block) per 4 tiles and token tile, all of K: tiles / 4 warpgroups per
// token tile, so it fills the GPU only for large N or many tokens (w4a16_gemm.cu: UseWgmma).
// Weights, scales and x go through a ring of kStages shared-memory stages (cp.async); a warp
// issues all of a step's wgmmas at once, one commit group and part buffer per scale group, and
// scales each group as it lands. A launch of up to 2 warpgroups per SM dequantizes step s + 1
// while step s's wgmmas run (two A register sets); a larger one keeps one set and 3 warpgroups per
// SM (kStages, BlocksPerSm). Its limit is issue and latency: ~2 warps per scheduler at ~2.4
// instructions per cycle per SM (Nsight), so every instruction per step counts (descriptors and
// stage indices are offsets, the piece bookkeeping a branch).
#include <algorithm>
#include <atomic>
#include <cstddef>

#include "w4a16_kernel.cuh"
#include "wgmma.cuh"

namespace kdtree {
namespace cuda {
namespace w4a16 {
namespace {

constexpr int kTileGroup = 4;  // tiles per warpgroup: wgmma's 64 rows are 4 warps' 16
constexpr int kThreads = kTileGroup * 32;
constexpr int kTokens = kWgmmaTileTokens;       // tokens per token tile: wgmma's N
constexpr int kN = kTokens / 2;                   // accumulator floats per thread
constexpr int kSliceBytes = 16 * kTokens * 2;     // B of one k16 slice, bf16: 1 KB
constexpr int kXStepBytes = 8 * kSliceBytes;      // one step's x (128 k x 32 tokens): 8 KB
// Steps in shared memory per warpgroup (up to kStages - 1 ahead of the one in use): at 2-3
// warpgroups per SM and 4 KB of weights per step, the 30-50 KB in flight per SM that the stream-K
// kernel keeps with 16 warps; 5 stages of 13 KB (+ 8 KB of first block sums) fit 3 times per SM.
// (7 stages at 2 warpgroups per SM are 1-2% slower.)
constexpr int kStages = 5;
// The kernel's two forms:
//  * dequant-ahead: two A register sets, the next step dequantized while this step's wgmmas run;
//    ~200 registers, so 2 warpgroups per SM. For launches of up to 2 warpgroups per SM, where
//    each warpgroup's own latency is the time (1.2-1.35x faster there than one set).
//  * one A set, dequantized once the step's wgmmas are done; 168 registers, 3 warpgroups per SM,
//    which hide each other's dequantization. For larger launches, where the dequant-ahead form at
//    2 per SM is 5-15% slower.
// Both put every scale group of a step in flight at once (one part buffer per group) and scale
// them as they land, instead of one group ahead.
constexpr int BlocksPerSm(bool dequant_ahead) { return dequant_ahead ? 2 : 3; }
// Copies of the staged x, warpgroup i reading copy i % copies (dispatch_policy.cc says why and how many).
int XCopies(int tile_groups) { return policy::WgmmaXCopies(tile_groups); }
static_assert(kMaxXCopies == policy::kWgmmaMaxXCopies && kTileGroup == policy::kWgmmaTileGroup && kXStepBytes == policy::kWgmmaXStepBytes,
              "the dispatch rules size this kernel's launches (dispatch_policy.h)");

// One step of a warpgroup in shared memory: the x of its token tile (B operand) and each warp's
// weights and scale block, copied straight from the packed layout (cp.async).
struct Stage {
  char x[kXStepBytes];                  // [8 slices][2 k halves][32 tokens][8 k] bf16
  uint4 w[kTileGroup][kUint4PerStep];   // warp's 1 KB: [2 row halves][32 lanes] x 16 B
  uint4 sc[kTileGroup][16];             // warp's scale block: [8 row pairs][2][4 groups] (bf16: 8 used)
};

// d (+)= a . B: the warp's 16 rows (A fragments as mma.m16n8k16 takes them) times 32 tokens of x;
// d[4 j + i] is what mma.m16n8k16's d[i] is for tokens 8 j .. 8 j + 7.
__device__ __forceinline__ void Wgmma(float (&d)[16], const uint32_t (&a)[4], uint64_t desc, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(static_cast<int>(accumulate))
      : "memory");
}

// kSilu: the SiLU epilogue (p.silu_mul), a compile-time choice so that its division and exp do not
// add registers to the plain kernel (as a run-time flag: +14 registers, a few percent slower).
template <typename S, int G, bool kDequantAhead, bool kSilu>
__global__ void __launch_bounds__(kThreads, BlocksPerSm(kDequantAhead)) W4A16WgmmaKernel(const GemmParams p, int copies) {
  PdlLaunchDependents();
  extern __shared__ __align__(1024) char smem[];
  Stage* stages = reinterpret_cast<Stage*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x * kTileGroup + warp;
  // A missing fourth tile (N not a multiple of 64 rows) streams the last tile again: its rows of
  // the wgmma are independent of the others and never stored.
  const int src_tile = min(tile, p.tiles - 1);
  const int steps = p.steps;
  constexpr int kStepsPerBlock = 4 * G / w4::kStepK;                       // steps per scale block
  // Copy cursors: where the next step's weights, scale block and x come from
  const uint4* w_next = p.qw + static_cast<int64_t>(src_tile) * steps * kUint4PerStep + lane;
  const uint4* s_next = reinterpret_cast<const uint4*>(reinterpret_cast<const S*>(p.sc) + static_cast<int64_t>(src_tile) * p.blocks * w4::kScalesPerBlock) + lane;
  const char* x_next = static_cast<const char*>(p.xs) + (static_cast<int64_t>(blockIdx.x % copies) * gridDim.y + blockIdx.y) * steps * kXStepBytes + 16 * threadIdx.x;
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  // A step's weights and scale block into this warp's part of stage `stage`: 2 + (<= 1) 16-byte
  // copies per lane; then the cursor moves on (a scale block every kStepsPerBlock steps).
  int w_step = 0;
  auto copy_w = [&](int stage) {
    if (w_step < steps) {
      const uint32_t dst = stage0 + stage * static_cast<uint32_t>(sizeof(Stage));
      CopyAsync16(dst + offsetof(Stage, w) + (warp * kUint4PerStep + lane) * 16, w_next);
      CopyAsync16(dst + offsetof(Stage, w) + (warp * kUint4PerStep + 32 + lane) * 16, w_next + 32);
      if (lane < kScaleUint4<S>) CopyAsync16(dst + offsetof(Stage, sc) + (warp * 16 + lane) * 16, s_next);
      w_next += kUint4PerStep;
      if (++w_step % kStepsPerBlock == 0) s_next += kScaleUint4<S>;
    }
  };
  // A step's x (8 KB, shared by the warpgroup): 4 16-byte copies per thread
  int x_step = 0;
  auto copy_x = [&](int stage) {
    if (x_step < steps) {
      const uint32_t dst = stage0 + stage * static_cast<uint32_t>(sizeof(Stage)) + offsetof(Stage, x) + 16 * threadIdx.x;
#pragma unroll
      for (int c = 0; c < kXStepBytes / 16 / kThreads; ++c) CopyAsync16(dst + 16 * kThreads * c, x_next + 16 * kThreads * c);
      x_next += kXStepBytes;
      ++x_step;
    }
  };
  // Weights do not depend on earlier kernels: the first stages' are in flight before the wait.
  // Uncommitted, they join x's first group, so "group s landed" still means "step s landed".
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) copy_w(s);
  PdlWait();  // the staged x is the previous kernel's
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    copy_x(s);
    CopyAsyncCommit();
  }

  const uint32_t magic = kMagic<__nv_bfloat16>;
  constexpr int kGroups = w4::kStepK / G;  // scale groups per step
  // A step's A fragments (all 8 slices, so that one fence covers them: ptxas otherwise injects one
  // wherever an A register was written after the last) and its scales, from its stage.
  auto load_step = [&](int stage, uint32_t (&a)[8][4], ScaleFrag<S>& sf) {
    const Stage& st = stages[stage];
    const uint4 w0 = st.w[warp][lane], w1 = st.w[warp][32 + lane];
#pragma unroll
    for (int v = 0; v < static_cast<int>(sizeof(S)) / 2; ++v) sf.v[v] = st.sc[warp][(sizeof(S) / 2) * g + v];
    const uint32_t lo[4] = {w0.x, w0.y, w0.z, w0.w}, hi[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        a[2 * b + s][0] = Dequant2<__nv_bfloat16>(lo[b] >> (8 * s), magic);
        a[2 * b + s][1] = Dequant2<__nv_bfloat16>(hi[b] >> (8 * s), magic);
        a[2 * b + s][2] = Dequant2<__nv_bfloat16>(lo[b] >> (8 * s + 4), magic);
        a[2 * b + s][3] = Dequant2<__nv_bfloat16>(hi[b] >> (8 * s + 4), magic);
      }
  };
  // The stage of step `step` landed, for every thread, and visible to the tensor cores; the barrier
  // also means every warp has waited for the previous step's wgmmas, so that stage can be refilled.
  auto stage_ready = [&]() {
    FenceProxyAsync();
    __syncthreads();
  };

  TileSplit split = SplitOf(p, src_tile);
  // acc[4 j + i]: tokens 8 j + 2 t + (i & 1), row g + 8 (i >> 1); part[q]: scale group q's exact
  // sums. A tile's first block sum (set at most once) waits in shared memory, [kN][kThreads].
  float acc[kN], block_sum[kN], part[kGroups][kN];
  float* first_block = reinterpret_cast<float*>(smem + kStages * sizeof(Stage)) + threadIdx.x;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    acc[i] = block_sum[i] = 0.f;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) part[q][i] = 0.f;
  }
  int f = src_tile * steps;  // this step's index in the matrix's step space
  // Dequant-ahead: software-pipelined by one step, while step s's wgmmas run the warp dequantizes
  // step s + 1 (two A register sets, the loop unrolled by 2 so that they never move); otherwise
  // a_odd is unused. Scale fragments alternate in both forms.
  uint32_t a_even[8][4], a_odd[8][4];
  ScaleFrag<S> s_even, s_odd;
  // The wgmma B descriptor of stage 0's x; a stage and a slice are fixed offsets from it (the
  // address field is bits 0-13 in 16-byte units, and no offset carries out of it: < 228 KB)
  const uint64_t desc_x = Descriptor(stage0 + offsetof(Stage, x), kTokens * 16, 8 * 16);
  int stage = 0, fill_stage = kStages - 1;  // this step's stage, the one the next copies go to
  CopyAsyncWait<kStages - 2>();
  stage_ready();
  load_step(0, a_even, s_even);
  for (int base = 0; base < steps; base += 2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int step = base + half;
      if (step >= steps) break;
      uint32_t (&a)[8][4] = half == 0 || !kDequantAhead ? a_even : a_odd;
      uint32_t (&a_next)[8][4] = half == 0 && kDequantAhead ? a_odd : a_even;
      const ScaleFrag<S>& sf = half == 0 ? s_even : s_odd;
      ScaleFrag<S>& sf_next = half == 0 ? s_odd : s_even;
      const uint64_t desc = desc_x + stage * (sizeof(Stage) >> 4);
      // group q's exact sums into part[q]: its slices chained, the first one fresh; one commit group
      auto issue_group = [&](int q) {
#pragma unroll
        for (int slice = q * G / 16; slice < (q + 1) * G / 16; ++slice)
          Wgmma(part[q], a[slice], desc + slice * (kSliceBytes >> 4), (slice * 16) % G != 0);
        WgmmaCommit();
      };
      // group q scaled into acc (its commit group landed), in order, as the decode kernel does
      auto scale_group = [&](int q) {
        const int slot = G == 32 ? q : G == 64 ? (2 * step + q) & 3 : step & 3;  // the group's slot in the scale block
        float s_lo, s_hi;
        ScalesOf<S>(sf, slot, &s_lo, &s_hi);
        ScaleGroup(acc, part[q], s_lo, s_hi);
      };
      // every group in flight while the warp moves on to the next step's stage (part[q] was last
      // read by the previous step's scaling, before the fence)
      WgmmaFence();
#pragma unroll
      for (int q = 0; q < kGroups; ++q) issue_group(q);
      if (step + 1 < steps) {
        // the next step's stage (kStages - 3 younger copy groups may still be in flight); then
        // refill the previous step's stage, whose wgmmas every warp waited for before the barrier
        CopyAsyncWait<kStages - 3>();
        stage_ready();
        copy_w(fill_stage);
        copy_x(fill_stage);
        CopyAsyncCommit();  // empty past the end: the group count stays uniform
        fill_stage = stage;
        stage = stage + 1 == kStages ? 0 : stage + 1;
        if (kDequantAhead) load_step(stage, a_next, sf_next);
      }
      // each group scaled as it lands (groups q + 1 .. kGroups - 1 may still run)
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        WaitForGroup<kGroups>(q);
        scale_group(q);
      }
      if (!kDequantAhead && step + 1 < steps) load_step(stage, a_next, sf_next);  // every wgmma of the step is done
      // the stream-K kernel's piece and block ends (outside the wgmmas)
      ReplayStepEnd(p, split, ++f, acc, block_sum, first_block, kThreads);
    }
  }
  if (tile >= p.tiles) return;
  const int row_start = (p.tile_offset + static_cast<int>(blockIdx.y)) * kTokens, rows = min(kTokens, p.M - row_start);
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    if constexpr (kSilu) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int e = 4 * j + i;
        StoreSilu(p, ReplayResult(split, e, acc, block_sum, first_block, kThreads), ReplayResult(split, e + 2, acc, block_sum, first_block, kThreads), j, i, tile, row_start, rows, g, t);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = 4 * j + i;
        StoreElement(p, ReplayResult(split, e, acc, block_sum, first_block, kThreads), j, i, tile, row_start, rows, g, t);
      }
    }
  }
}

template <typename S, int G, bool kDequantAhead, bool kSilu>
Status Launch(const GemmParams& p, int copies, dim3 grid, cudaStream_t s) {
  constexpr int kShared = kStages * sizeof(Stage) + kN * kThreads * sizeof(float);  // + the first block sums
  auto* kernel = W4A16WgmmaKernel<S, G, kDequantAhead, kSilu>;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared), "w4a16 wgmma kernel: shared memory"));
  return LaunchPdl("w4a16 wgmma kernel", kernel, grid, dim3(kThreads), kShared, s, p, copies);
}
template <typename S, int G>
Status LaunchForm(const GemmParams& p, int copies, dim3 grid, int sms, cudaStream_t s) {
  const bool dequant_ahead = static_cast<int64_t>(grid.x) * grid.y <= static_cast<int64_t>(BlocksPerSm(true)) * sms;
  if (p.silu_mul) return dequant_ahead ? Launch<S, G, true, true>(p, copies, grid, s) : Launch<S, G, false, true>(p, copies, grid, s);
  return dequant_ahead ? Launch<S, G, true, false>(p, copies, grid, s) : Launch<S, G, false, false>(p, copies, grid, s);
}

}  // namespace

bool WgmmaAvailable() {
  static std::atomic<int> known[kMaxKnownDevices];
  return DeviceRunsKernel(reinterpret_cast<const void*>(W4A16WgmmaKernel<uint16_t, 32, false, false>), known);
}

int WgmmaTileGroups(int tiles) { return policy::WgmmaTileGroups(tiles); }

size_t WgmmaStagedBytes(int steps, int tiles) { return policy::WgmmaStagedBytes(steps, tiles); }

Status LaunchW4A16Wgmma(GemmParams p, int group, int token_tiles, int sms, void* xs, cudaStream_t s) {
  p.xs = xs;
  const int64_t units = static_cast<int64_t>(token_tiles) * p.steps * (kXStepBytes / 16);
  const int copies = XCopies(WgmmaTileGroups(p.tiles));
  KDTREE_RETURN_IF_ERROR(LaunchPdl("w4a16 wgmma stage x", StageWgmmaXKernel<kTokens>, dim3(static_cast<unsigned>((units + 255) / 256)), dim3(256), 0, s, p, token_tiles,
                                   copies, static_cast<uint4*>(xs)));
  const dim3 grid(static_cast<unsigned>(WgmmaTileGroups(p.tiles)), static_cast<unsigned>(token_tiles));
  if (p.sc_f32) {
    switch (group) {
      case 32: return LaunchForm<float, 32>(p, copies, grid, sms, s);
      case 64: return LaunchForm<float, 64>(p, copies, grid, sms, s);
      default: return LaunchForm<float, 128>(p, copies, grid, sms, s);
    }
  }
  switch (group) {
    case 32: return LaunchForm<uint16_t, 32>(p, copies, grid, sms, s);
    case 64: return LaunchForm<uint16_t, 64>(p, copies, grid, sms, s);
    default: return LaunchForm<uint16_t, 128>(p, copies, grid, sms, s);
  }
}

}  // namespace w4a16
}  // namespace cuda
}  // namespace kdtree
