// W4A16 GEMM for prefill-sized token counts on Hopper's warpgroup MMA (sm_90a only; w4a16_gemm.cu
// decides when it runs).
//
// Why: the 32-token `wgmma` kernel (w4a16_wgmma.cu) dequantizes every weight once per 32 tokens in
// the warps that also run the MMAs and scale each group's sums, so at 512-2048 tokens it issues
// ~180 instructions per warp and 64 x 32 x 128 MACs, one dependent chain per step (0.3-0.4x of a
// dense bf16 GEMM). Here the work is split by kind, over 128 tokens:
//  * a producer warpgroup loads a step's codes into registers (kLookahead steps ahead), copies the
//    step's x and scales into a shared-memory stage (cp.async), and dequantizes the codes once into
//    the stage as wgmma's A operand (bf16 core matrices);
//  * two consumer warpgroups, 64 tokens each, run wgmma.m64n64k16 with A and B from shared memory
//    and scale each group's exact sums into their accumulators, a step's groups in pairs.
// Stages pass between them through mbarriers (full: the producer's 128 threads wrote it; empty:
// the consumers' 256 threads are done with it), so neither side waits on a block barrier.
// 18432x7168 at 2048 tokens runs at ~340 TFLOPS, 0.46x of dense bf16 (docs/benchmarks/cuda.md).
// The x copies stay cp.async by all 128 producer threads: one bulk copy (TMA) per step is ~10%
// slower. The kernel is latency-bound, not bandwidth-bound (L2 35% and DRAM 5% busy under
// Nsight), and what bounds the pairs is the scaling: a consumer's group is 131k MACs for the
// tensor pipe and 4096 fmaf for the FP32 pipe (half the time at the peak rates of 2048 and 128 per
// SM and clock), and each group's fmaf wait for its wgmma; a consumer-only loop of these pairs
// runs 3.3x slower with the scaling than without it.
//
// Batch invariance: the bits are the stream-K kernel's. The A operand holds, at every MMA k index,
// the code the register fragments of the other kernels hold there (and x is staged in that order),
// so every k16 slice sums the same products; wgmma rounds chained slices as mma.sync does
// (tools/gpu/wgmma_equiv.cu); the group scaling is the same fmaf chain; and each consumer warp replays the stream-K
// split of its tile (wgmma.cuh: SplitOf), as the 32-token kernel does.
#include <algorithm>
#include <cstddef>

#include "w4a16_kernel.cuh"
#include "wgmma.cuh"

namespace kdtree {
namespace cuda {
namespace w4a16 {
namespace {

constexpr int kRows = 64;                          // rows per block: 4 tiles of 16
constexpr int kTokens = kPrefillTileTokens;        // tokens per block (token tile)
constexpr int kConsumers = 2;                      // consumer warpgroups
constexpr int kConsumerTokens = kTokens / kConsumers;  // wgmma N of a consumer: 64
constexpr int kN = kConsumerTokens / 2;            // accumulator floats per consumer thread: 32
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kSliceA = 2 * kRows * 16;            // A of one k16 slice: [2 k halves][64 rows][8 k] bf16, 2 KB
constexpr int kSliceX = 2 * kTokens * 16;          // B of one k16 slice: [2 k halves][128 tokens][8 k] bf16, 4 KB
constexpr int kLookahead = 4;                      // steps of codes in flight per producer thread (8 regs each)

template <typename S>
struct Stage {
  char a[8 * kSliceA];          // dequantized codes, [8 slices][2 k halves][64 rows][8 k] bf16
  char x[8 * kSliceX];          // staged x, [8 slices][2 k halves][128 tokens][8 k] bf16
  uint4 sc[4][kScaleUint4<S>];  // each tile's scale block
};
// Stages of the ring: as many as fit beside the first block sums (32 KB) in 227 KB: 4 with bf16
// scales (48.5 KB each), 3 with f32 (49 KB). The fourth is slack between producer and consumers
// (with the groups issued in pairs, 3 and 4 stages measure within noise of each other).
template <typename S>
constexpr int kStages = sizeof(S) == 2 ? 4 : 3;
// Steps whose x copies are in flight ahead of the one being dequantized. The producer waits for
// the consumers to release step s + kXAhead - kStages before it publishes step s; they release a
// step once its own groups are done, so any kXAhead < kStages is deadlock-free (when they released
// it only after issuing the next step's first group, kStages - 1 deadlocked). 2 is slower than 1
// with 4 stages: the slack stage is worth more.
constexpr int kXAhead = 1;
template <typename S>
struct Shared {
  Stage<S> stage[kStages<S>];
  float first_block[kN][kConsumers * 128];  // a tile's first block sum, per consumer thread
  uint64_t full[kStages<S>], empty[kStages<S>];
};

// d (+)= A . B for one k16 slice, both operands in shared memory; d[4 j + i] is what
// mma.m16n8k16's d[i] is for tokens 8 j .. 8 j + 7 of the warp's 16 rows.
__device__ __forceinline__ void WgmmaSS(float (&d)[kN], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
      "%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate))
      : "memory");
}

// Blocks: `row_groups` groups of 64 rows per token tile, walked in bands of `band` row groups of
// every token tile, so that the token tiles of a band's weights run together and read them from L2.
struct PrefillMap {
  int row_groups, token_tiles, band;
};

// kSilu: the SiLU epilogue (p.silu_mul), compile-time as in the warpgroup kernel.
template <typename S, int G, bool kSilu>
__global__ void __launch_bounds__(kThreads, 1) W4A16PrefillKernel(const GemmParams p, PrefillMap map) {
  static_assert(w4::kStepK / G % 2 == 0, "the consumers take a step's scale groups in pairs");
  constexpr int kStages = w4a16::kStages<S>;
  static_assert(kXAhead >= 1 && kXAhead < kStages, "see kXAhead");
  using Stage = w4a16::Stage<S>;
  PdlLaunchDependents();
  extern __shared__ __align__(1024) char smem_raw[];
  Shared<S>& sh = *reinterpret_cast<Shared<S>*>(smem_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int band_start = static_cast<int>(blockIdx.x) / (map.band * map.token_tiles) * map.band;
  const int width = min(map.band, map.row_groups - band_start);
  const int in_band = static_cast<int>(blockIdx.x) - band_start * map.token_tiles;
  const int token_tile = in_band / width, row_group = band_start + in_band % width;
  const int steps = p.steps;
  constexpr int kGroups = w4::kStepK / G;
  constexpr int kStepsPerBlock = 4 * G / w4::kStepK;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      BarrierInit(&sh.full[s], 128);
      BarrierInit(&sh.empty[s], kConsumers * 128);
    }
  }
  __syncthreads();
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(&sh.stage[0]));

  if (warp < 4) {
    // Producer: warp w streams tile 4 row_group + w (a missing tile streams the last one again;
    // its rows are never stored).
    const int src_tile = min(row_group * 4 + warp, p.tiles - 1);
    const uint4* w_src = p.qw + static_cast<int64_t>(src_tile) * steps * kUint4PerStep + lane;
    const uint4* s_src = reinterpret_cast<const uint4*>(reinterpret_cast<const S*>(p.sc) + static_cast<int64_t>(src_tile) * p.blocks * w4::kScalesPerBlock) + lane;
    const char* x_src = static_cast<const char*>(p.xs) + static_cast<int64_t>(token_tile) * steps * (8 * kSliceX) + 16 * threadIdx.x;
    uint4 codes[kLookahead][2];
#pragma unroll
    for (int r = 0; r < kLookahead; ++r)
      if (r < steps) {
        codes[r][0] = LoadStream(w_src + r * kUint4PerStep);
        codes[r][1] = LoadStream(w_src + r * kUint4PerStep + 32);
      }
    PdlWait();  // the staged x is the previous kernel's
    // a step's x (32 KB: 16 copies per thread) and its tile's scale block into stage `stage`
    auto copy_step = [&](int step, int stage) {
      const uint32_t dst = stage0 + stage * static_cast<uint32_t>(sizeof(Stage));
      const char* xs = x_src + static_cast<int64_t>(step) * (8 * kSliceX);
#pragma unroll
      for (int c = 0; c < 8 * kSliceX / 16 / 128; ++c) CopyAsync16(dst + offsetof(Stage, x) + 16 * threadIdx.x + 16 * 128 * c, xs + 16 * 128 * c);
      if (lane < kScaleUint4<S>) CopyAsync16(dst + offsetof(Stage, sc) + (warp * kScaleUint4<S> + lane) * 16, s_src + static_cast<int64_t>(step / kStepsPerBlock) * kScaleUint4<S>);
    };
#pragma unroll
    for (int step = 0; step < kXAhead; ++step) {
      if (step < steps) copy_step(step, step);
      CopyAsyncCommit();
    }
    const uint32_t magic = kMagic<__nv_bfloat16>;
    for (int base = 0; base < steps; base += kLookahead) {
#pragma unroll
      for (int r = 0; r < kLookahead; ++r) {
        const int step = base + r;
        if (step >= steps) break;
        const int stage = step % kStages;
        // step + kXAhead's copies, once the consumers are done with that stage's last use
        const int next = step + kXAhead;
        if (next < steps) {
          const int next_stage = next % kStages;
          if (next >= kStages) BarrierWait(&sh.empty[next_stage], (next / kStages - 1) & 1);
          copy_step(next, next_stage);
        }
        CopyAsyncCommit();  // empty at the end: the group count stays uniform
        // this step's codes -> bf16 at their MMA k index (w4a16_wgmma.cu's register fragments):
        // word b of row half h holds row g + 8 h at k = 32 b + 8 t + {0..7}; its pairs (k, k + 1)
        // of slice s = 2 b + s' go to k half 0 and (k + 2, k + 3) to k half 1, at element 2 t.
        char* a = sh.stage[stage].a + (warp * 16 + g) * 16 + 4 * t;
        const uint32_t lo[4] = {codes[r][0].x, codes[r][0].y, codes[r][0].z, codes[r][0].w};
        const uint32_t hi[4] = {codes[r][1].x, codes[r][1].y, codes[r][1].z, codes[r][1].w};
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            char* slice = a + (2 * b + s) * kSliceA;
            *reinterpret_cast<uint32_t*>(slice) = Dequant2<__nv_bfloat16>(lo[b] >> (8 * s), magic);
            *reinterpret_cast<uint32_t*>(slice + 8 * 16) = Dequant2<__nv_bfloat16>(hi[b] >> (8 * s), magic);
            *reinterpret_cast<uint32_t*>(slice + kRows * 16) = Dequant2<__nv_bfloat16>(lo[b] >> (8 * s + 4), magic);
            *reinterpret_cast<uint32_t*>(slice + kRows * 16 + 8 * 16) = Dequant2<__nv_bfloat16>(hi[b] >> (8 * s + 4), magic);
          }
        if (step + kLookahead < steps) {
          codes[r][0] = LoadStream(w_src + (step + kLookahead) * kUint4PerStep);
          codes[r][1] = LoadStream(w_src + (step + kLookahead) * kUint4PerStep + 32);
        }
        CopyAsyncWait<kXAhead>();  // this step's copies landed (the next ones may still be in flight)
        FenceProxyAsync();  // visible to the tensor cores
        BarrierArrive(&sh.full[stage]);
      }
    }
    return;
  }

  // Consumers: warpgroup c (tokens 64 c ..) of the block; warp cw holds tile 4 row_group + cw.
  PdlWait();  // they write y, which an earlier kernel may read
  const int c = warp / 4 - 1, cw = warp & 3, ct = threadIdx.x - 128;
  const int tile = row_group * 4 + cw;
  TileSplit split = SplitOf(p, min(tile, p.tiles - 1));
  const uint64_t desc_a = Descriptor(stage0 + offsetof(Stage, a), kRows * 16, 8 * 16);
  const uint64_t desc_x = Descriptor(stage0 + offsetof(Stage, x) + c * kConsumerTokens * 16, kTokens * 16, 8 * 16);
  float acc[kN], block_sum[kN], part[2][kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i] = block_sum[i] = part[0][i] = part[1][i] = 0.f;
  float* first_block = &sh.first_block[0][ct];
  // Each step's scale groups go in pairs: groups q and q + 1 of a step into part[0] and part[1]
  // (their slices chained, the first one fresh; one commit group each), then each scaled as soon as
  // it lands. The other consumer warpgroup keeps the tensor cores busy while this one scales.
  // Why not one group always in flight (issue q + 1, then scale q)? ptxas then sees the scaling
  // read accumulators inside another wgmma's pipeline stage and serializes every wgmma of the
  // kernel (warning C7514; C7518 with the waits in a branch; build-native.mjs fails such a build):
  // the tensor pipe runs 32% busy, and the pairs are ~15% faster.
  int f = min(tile, p.tiles - 1) * steps;
  for (int step = 0; step < steps; ++step) {
    const int stage = step % kStages;
    BarrierWait(&sh.full[stage], (step / kStages) & 1);
    ScaleFrag<S> sf;
#pragma unroll
    for (int v = 0; v < static_cast<int>(sizeof(S)) / 2; ++v) sf.v[v] = sh.stage[stage].sc[cw][(sizeof(S) / 2) * g + v];
    const uint64_t stage_offset = stage * (sizeof(Stage) >> 4);
#pragma unroll
    for (int q0 = 0; q0 < kGroups; q0 += 2) {
      WgmmaFence();  // part[] was last read by the previous pair's scaling
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int slice = (q0 + h) * G / 16; slice < (q0 + h + 1) * G / 16; ++slice)
          WgmmaSS(part[h], desc_a + stage_offset + slice * (kSliceA >> 4), desc_x + stage_offset + slice * (kSliceX >> 4), (slice * 16) % G != 0);
        WgmmaCommit();
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h == 0) WgmmaWait<1>();
        else WgmmaWait<0>();
        const int q = q0 + h, slot = G == 32 ? q : (2 * step + q) & 3;
        float s_lo, s_hi;
        ScalesOf<S>(sf, slot, &s_lo, &s_hi);
        ScaleGroup(acc, part[h], s_lo, s_hi);
      }
    }
    BarrierArrive(&sh.empty[stage]);  // every wgmma of the step is done and its scales are read
    // the stream-K kernel's piece and block ends
    ReplayStepEnd(p, split, ++f, acc, block_sum, first_block, kConsumers * 128);
  }
  if (tile >= p.tiles) return;
  const int row_start = (p.tile_offset + token_tile) * kTokens + c * kConsumerTokens, rows = min(kConsumerTokens, p.M - row_start);
  if (rows <= 0) return;
#pragma unroll
  for (int j = 0; j < kConsumerTokens / 8; ++j) {
    if constexpr (kSilu) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int e = 4 * j + i;
        StoreSilu(p, ReplayResult(split, e, acc, block_sum, first_block, kConsumers * 128), ReplayResult(split, e + 2, acc, block_sum, first_block, kConsumers * 128), j, i, tile,
                  row_start, rows, g, t);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = 4 * j + i;
        StoreElement(p, ReplayResult(split, e, acc, block_sum, first_block, kConsumers * 128), j, i, tile, row_start, rows, g, t);
      }
    }
  }
}

template <typename S, int G, bool kSilu>
Status Launch(const GemmParams& p, int token_tiles, int sms, cudaStream_t s) {
  PrefillMap map;
  map.row_groups = static_cast<int>((p.tiles + 3) / 4);
  map.token_tiles = token_tiles;
  // a band's blocks of every token tile: about one wave (one block per SM)
  map.band = std::max(1, std::min(map.row_groups, (sms + token_tiles - 1) / token_tiles));
  constexpr int kShared = sizeof(Shared<S>);
  auto* kernel = W4A16PrefillKernel<S, G, kSilu>;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared), "w4a16 prefill kernel: shared memory"));
  const dim3 grid(static_cast<unsigned>(map.row_groups * token_tiles));
  return LaunchPdl("w4a16 prefill kernel", kernel, grid, dim3(kThreads), kShared, s, p, map);
}

}  // namespace

// f32 scales at group 32 need 8 more registers per consumer thread than the kernel has (it spilled).
bool PrefillSupports(int group, bool sc_f32) { return policy::PrefillSupports(group, sc_f32); }

size_t PrefillStagedBytes(int steps) { return static_cast<size_t>(steps) * 8 * kSliceX; }

Status LaunchW4A16Prefill(GemmParams p, int group, int token_tiles, int sms, void* xs, cudaStream_t s) {
  p.xs = xs;
  const int64_t units = static_cast<int64_t>(token_tiles) * p.steps * (8 * kSliceX / 16);
  KDTREE_RETURN_IF_ERROR(LaunchPdl("w4a16 prefill stage x", StageWgmmaXKernel<kTokens>, dim3(static_cast<unsigned>((units + 255) / 256)), dim3(256), 0, s, p, token_tiles, 1,
                                   static_cast<uint4*>(xs)));
  if (p.silu_mul) {
    if (p.sc_f32) return Launch<float, 64, true>(p, token_tiles, sms, s);
    return group == 32 ? Launch<uint16_t, 32, true>(p, token_tiles, sms, s) : Launch<uint16_t, 64, true>(p, token_tiles, sms, s);
  }
  if (p.sc_f32) return Launch<float, 64, false>(p, token_tiles, sms, s);
  return group == 32 ? Launch<uint16_t, 32, false>(p, token_tiles, sms, s) : Launch<uint16_t, 64, false>(p, token_tiles, sms, s);
}

}  // namespace w4a16
}  // namespace cuda
}  // namespace kdtree
