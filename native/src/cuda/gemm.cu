// GEMM with 16-bit float weights as the checkpoint stores them: y[M, N] = x[M, K] . W^T, W [N, K]
// bf16 (x bf16 or f32) or f16 (x f16), f32 sums. These are the layers a Kimi K2 checkpoint keeps
// in bf16 (attention projections, shared experts, dense layer 0, lm_head), so at decode the kernel
// is a weight stream of 2 bytes per weight and the design follows the W4A16 decode kernel:
//  * W rows are the 16-row M side of mma.m16n8k16 and tokens the 8-wide N side.
//  * No packing: a lane reads 8 consecutive k of weight rows g and g + 8 (two 16-byte loads, a
//    warp's load is 16 rows x 64 contiguous bytes) and the same 8 k of its token's x row. The MMA
//    sums over k, so k may be permuted as long as A and B agree: a lane's k 8t + 4h + {0, 1, 2, 3}
//    of a 32-k chunk fill MMA h's k slots {2t, 2t + 1, 2t + 8, 2t + 9}. f32 x is split into three
//    bf16 planes (hi + mid + lo = x to 24 bits), three MMAs on the same weights.
//  * Batch invariance: K is cut into `ranges` of equal chunk counts, chosen from N, K and the
//    device only. A range's partial is its chunks' MMAs in order from zero; an output is the sum of
//    its ranges' partials from range 0 up. Every form below computes exactly that, so an output's
//    bits do not depend on M, on the token tile or on the form.
//  * Split form (decode and verify): a block's warps take consecutive ranges of one 16-row tile,
//    so every SM streams weights even when N has few tiles; the partials meet in shared memory,
//    or, for a tile cut across blocks, in global work space, where the block that finishes last
//    (a counter per tile) sums them.
//  * Rows form (many token tiles): a block's 8 warps take 8 adjacent tiles and walk all ranges,
//    each keeping its running sum; they read the same x at about the same time (from L1), and no
//    work space is needed.
//  * Tiled form (16-bit x, 17+ tokens, many 64-row groups): the split form reads x once per 16-row
//    tile, 4x the weight bytes at 64 tokens, all from L2. Here a block of 4 warps stages 64 weight
//    rows and the token tile's x through a shared-memory ring (cp.async) and each warp walks all
//    ranges of its tile as the rows form does, so x comes from L2 once per 64 rows (lm_head at 64
//    tokens about twice as fast as the rows form). Its variant with a block
//    per range (tiled-split, for N with few groups: q_a_proj, layer 0's MLP) stores its ranges'
//    partials for a small kernel to sum.
//  * Wgmma form (16-bit x, 128+ tokens, sm_90a; gemm_wgmma.cu): 128 weight rows x 128 tokens per
//    block on the warpgroup MMA, x staged in its operand order, a copy warpgroup feeding two MMA
//    warpgroups (lm_head at 512-2048 tokens about twice as fast as the tiled form).
#include <algorithm>
#include <functional>
#include <type_traits>

#include "gemm_kernel.cuh"

namespace kdtree {
namespace cuda {
namespace {

using gemm::kChunkK;
using gemm::kTileRows;
using gemm::Params;
using gemm::StoreOut;

constexpr int kBlockWarps = 8;
constexpr int kMinRangeChunks = 4;  // the shortest range (128 k): a warp's stream of 16 x 256 bytes
#ifndef KDTREE_GEMM_WARPS_PER_SM
#define KDTREE_GEMM_WARPS_PER_SM 32
#endif
constexpr int kWarpsPerSm = KDTREE_GEMM_WARPS_PER_SM;     // what the split aims to fill at M <= 8
// Split-form work space per launch: token tiles are launched in chunks that fit.
constexpr size_t kWorkSpaceMax = size_t{64} << 20;
constexpr int kMaxGridY = 65535;

template <typename X>
using MmaType = typename std::conditional<std::is_same<X, __half>::value, __half, __nv_bfloat16>::type;
template <typename X>
constexpr int kPlanes = std::is_same<X, float>::value ? 3 : 1;
// Chunks whose loads a warp issues before it uses the first (the plan's load_ahead: dispatch_policy.cc's
// GemmLoadAhead): 4 KB of weights in flight per warp, fewer as the x fragments grow (at most 32
// registers of them), so that the 64-token instances keep two blocks per SM; 8 KB for one token
// tile of 16-bit x (decode).
template <typename X, int NT>
constexpr int kLoadAhead = policy::GemmShallowLoadAhead(NT, kPlanes<X>);
template <typename X, int NT>
constexpr bool kDeepInstance = NT == 1 && kPlanes<X> == 1;  // the one tile shape with a deep instance too

// A lane's B fragments of one token for one chunk: plane p (lo, mid, hi for f32 x), MMA h, regs
// {b0, b1} = its k 8t + 4h + {0, 1} and {2, 3}.
template <typename X>
struct XFrag {
  uint32_t r[kPlanes<X>][4];
};

template <typename X>
__device__ __forceinline__ XFrag<X> LoadX(const Params& p, int token, int k0, bool valid) {
  XFrag<X> f;
  if constexpr (std::is_same<X, float>::value) {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.x) + static_cast<int64_t>(token) * p.K + k0);
    const float4 a = valid ? LoadActivation(src) : make_float4(0.f, 0.f, 0.f, 0.f), b = valid ? LoadActivation(src + 1) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const Bf16Planes s = SplitPair(v[2 * i], v[2 * i + 1]);
      f.r[0][i] = s.lo;
      f.r[1][i] = s.mid;
      f.r[2][i] = s.hi;
    }
  } else {
    const uint4 v = valid ? LoadActivation(reinterpret_cast<const uint4*>(static_cast<const X*>(p.x) + static_cast<int64_t>(token) * p.K + k0)) : make_uint4(0u, 0u, 0u, 0u);
    f.r[0][0] = v.x;
    f.r[0][1] = v.y;
    f.r[0][2] = v.z;
    f.r[0][3] = v.w;
  }
  return f;
}

// One range's partial for one 16-row tile and NT token tiles of 8: acc[j] = the lane's C fragment
// of token tile j (rows g, g + 8; tokens 2t, 2t + 1), the range's chunks summed in order from zero.
// With `wait` the warp waits for the previous kernel (PdlWait) after issuing its first weight
// loads and before its first x load: weights are not written by the kernels a GEMM follows, so the
// first kAhead KB of them stream in while that kernel drains (as the W4A16 kernel fills its ring).
template <typename W, typename X, int NT, int kAhead>
__device__ __forceinline__ void RangePartial(const Params& p, int tile, int token0, int range, bool wait, float (&acc)[NT][4]) {
  using A = MmaType<X>;
  static_assert(std::is_same<A, W>::value, "the weights' type is the MMA's");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row_a = tile * kTileRows + g, row_b = row_a + 8;
  const bool valid_a = row_a < p.N, valid_b = row_b < p.N;
  const int64_t row_units = p.K / 8;  // 16-byte units per weight row
  const uint4* wa = p.w + (valid_a ? row_a : 0) * row_units + t;
  const uint4* wb = p.w + (valid_b ? row_b : 0) * row_units + t;
  const int c_begin = range * p.range_chunks, c_end = min(c_begin + p.range_chunks, p.chunks);
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  bool fresh = true;
  for (int c = c_begin; c < c_end; c += kAhead) {
    uint4 w[kAhead][2];
    XFrag<X> xf[kAhead][NT];
#pragma unroll
    for (int d = 0; d < kAhead; ++d) {
      const int k0 = (c + d) * kChunkK + 8 * t;
      const bool k_ok = c + d < c_end && k0 < p.K;
      const int64_t unit = static_cast<int64_t>(c + d) * (kChunkK / 8);
      w[d][0] = k_ok && valid_a ? LoadStream(wa + unit) : make_uint4(0u, 0u, 0u, 0u);
      w[d][1] = k_ok && valid_b ? LoadStream(wb + unit) : make_uint4(0u, 0u, 0u, 0u);
    }
    if (wait) {
      PdlWait();
      wait = false;
    }
#pragma unroll
    for (int d = 0; d < kAhead; ++d) {
      const int k0 = (c + d) * kChunkK + 8 * t;
      const bool k_ok = c + d < c_end && k0 < p.K;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int token = token0 + 8 * j + g;
        xf[d][j] = LoadX<X>(p, token, k0, k_ok && token < p.M);
      }
    }
#pragma unroll
    for (int d = 0; d < kAhead; ++d) {
      if (c + d >= c_end) break;
      const uint32_t wr[2][4] = {{w[d][0].x, w[d][0].y, w[d][0].z, w[d][0].w}, {w[d][1].x, w[d][1].y, w[d][1].z, w[d][1].w}};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t a[4] = {wr[0][2 * h], wr[1][2 * h], wr[0][2 * h + 1], wr[1][2 * h + 1]};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int pl = 0; pl < kPlanes<X>; ++pl) Mma<A>(acc[j], a, xf[d][j].r[pl][2 * h], xf[d][j].r[pl][2 * h + 1], fresh && pl == 0);
        }
        fresh = false;
      }
    }
  }
  if (wait) PdlWait();  // an empty range (none are): still ordered after the previous kernel
}

// Output elements e0, e0 + step, ... of a tile: its ranges' partials [range][NT * 4][32] summed in
// range order from range 0. `cross`: other blocks stored them, so read from L2, not a stale L1 line.
template <int NT>
__device__ __forceinline__ void SumRanges(const Params& p, const float* src, bool cross, int tile, int token0, int e0, int step) {
  constexpr int kElems = NT * 4 * 32;
  for (int e = e0; e < kElems; e += step) {
    float sum;
    if (cross) {
      sum = __ldcg(src + e);
      for (int r = 1; r < p.ranges; ++r) sum += __ldcg(src + r * kElems + e);
    } else {
      sum = src[e];
      for (int r = 1; r < p.ranges; ++r) sum += src[r * kElems + e];
    }
    StoreOut(p, sum, tile, token0, (e >> 5) >> 2, (e >> 5) & 3, e & 31);
  }
}

// Split form: grid (tiles x blocks per tile, token tiles of 8 NT); warp w of block b of a tile
// computes range kBlockWarps b + w. Partials are stored [idx = 4 j + i][lane], so the final sum's
// threads read consecutive floats.
template <typename W, typename X, int NT, int kAhead>
__global__ void __launch_bounds__(kBlockWarps * 32) GemmSplitKernel(Params p) {
  extern __shared__ float parked[];  // [warps][NT * 4][32]
  __shared__ bool last;
  const int blocks_per_tile = (p.ranges + kBlockWarps - 1) / kBlockWarps;
  const int tile = blockIdx.x / blocks_per_tile, part = blockIdx.x % blocks_per_tile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int range = part * kBlockWarps + warp;
  const int token_tile = blockIdx.y, token0 = (p.token_tile0 + token_tile) * 8 * NT;
  constexpr int kElems = NT * 4 * 32;
  if (range < p.ranges) {
    float acc[NT][4];
    RangePartial<W, X, NT, kAhead>(p, tile, token0, range, true, acc);  // waits for the previous kernel inside
    float* dst = blocks_per_tile == 1 ? parked + warp * kElems : p.partials + ((static_cast<int64_t>(token_tile) * p.tiles + tile) * p.ranges + range) * kElems;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[(4 * j + i) * 32 + lane] = acc[j][i];
    }
  } else {
    PdlWait();  // before this block's sum writes y
  }
  PdlLaunchDependents();
  const float* src = parked;
  if (blocks_per_tile > 1) {
    if (!LastOfBlocks(p.counters + static_cast<int64_t>(token_tile) * p.tiles + tile, blocks_per_tile, &last)) return;
    src = p.partials + (static_cast<int64_t>(token_tile) * p.tiles + tile) * p.ranges * kElems;
  } else {
    __syncthreads();
  }
  SumRanges<NT>(p, src, blocks_per_tile > 1, tile, token0, threadIdx.x, warps * 32);
}

// Rows form (many token tiles): grid (token tiles, groups of 8 tiles); warp w of a block takes tile
// 8 group + w and walks all its ranges, summing the partials in order as it goes (no work space).
// The block's warps read the same x at about the same time (from L1: 8x less x traffic from L2 than
// a warp per tile), and the token tile is the grid's fastest index, so the token tiles of one
// weight group run together and read it from L2 rather than HBM (~12% faster at 512-2048 tokens
// than tile-major order).
template <typename W, typename X, int NT, int kAhead>
__global__ void __launch_bounds__(kBlockWarps * 32, 2) GemmRowsKernel(Params p) {
  const int tile = blockIdx.y * kBlockWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int token0 = (p.token_tile0 + blockIdx.x) * 8 * NT;
  if (tile >= p.tiles) return;
  float sum[NT][4];
  for (int r = 0; r < p.ranges; ++r) {
    float acc[NT][4];
    RangePartial<W, X, NT, kAhead>(p, tile, token0, r, r == 0, acc);  // the first range waits for the previous kernel
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sum[j][i] = r == 0 ? acc[j][i] : sum[j][i] + acc[j][i];
    }
  }
  PdlLaunchDependents();
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) StoreOut(p, sum[j][i], tile, token0, j, i, lane);
  }
}

// Tiled form: grid (token tiles of 8 NT, groups of kTiledWarps tiles x range blocks); a stage is
// kTiledStageK k of the group's 64 weight rows and of the token tile's 8 NT x rows, rows of 128
// bytes whose two 64-byte chunk halves swap on odd rows, so that the 8 lanes of an LDS.128 phase
// (rows g and g + 1, 4 x 16 bytes each) hit all 32 banks once.
constexpr int kTiledWarps = 4;
constexpr int kTiledRows = kTiledWarps * kTileRows;
constexpr int kTiledStageK = 2 * kChunkK;
constexpr int kTiledStages = 4;
constexpr int kTiledRowBytes = kTiledStageK * 2;
template <int NT>
constexpr int kTiledStageBytes = (kTiledRows + 8 * NT) * kTiledRowBytes;
template <int NT>
constexpr size_t kTiledSmem = static_cast<size_t>(kTiledStages) * kTiledStageBytes<NT>;

// Byte offset of k unit u (16 bytes, 0..7) of row r within a stage's row block.
__host__ __device__ constexpr int TiledOffset(int r, int u) { return r * kTiledRowBytes + (((u >> 2) ^ (r & 1)) << 6) + ((u & 3) << 4); }

// A thread's share of a stage's copies, worked out once: thread i copies k unit i % 8 of rows
// i / 8 + 16 q (q < kRows / 16), the same rows and unit every stage. Its sources are one 64-bit
// pointer that advances 128 bytes per stage plus fixed 32-bit offsets (rows past the end point at
// the first row and copy nothing), so a copy is an add, a select of its size and the LDGSTS
// (64-bit row products and selects computed per copy, which the compiler rematerializes, cost
// ~100 of a stage's ~600 instructions).
template <int kRows>
struct TiledCopier {
  static constexpr int kCopies = kRows / 16;
  const unsigned char* src;  // unit i % 8 of the first row at the current stage
  uint32_t src_off[kCopies];  // bytes from `src` to row q
  uint32_t dst[kCopies];      // offset in the stage's row block
  int bytes[kCopies];         // 16, or 0 for rows past the end
  __device__ void Init(const void* base, int row_bytes, int first_row, int rows_total, int unit0, int tid) {
    const int u = tid % 8;
    src = static_cast<const unsigned char*>(base) + static_cast<int64_t>(first_row) * row_bytes + 16 * (unit0 + u);
#pragma unroll
    for (int q = 0; q < kCopies; ++q) {
      const int r = tid / 8 + 16 * q;
      const bool ok = first_row + r < rows_total;
      src_off[q] = ok ? static_cast<uint32_t>(r) * static_cast<uint32_t>(row_bytes) : 0u;
      bytes[q] = ok ? 16 : 0;
      dst[q] = TiledOffset(r, u);
    }
  }
  // The next stage into the row block at shared address `block`; `k_ok`: the thread's unit is < K.
  __device__ __forceinline__ void IssueAndAdvance(uint32_t block, bool k_ok) {
#pragma unroll
    for (int q = 0; q < kCopies; ++q) CopyAsync16ZeroFill(block + dst[q], src + src_off[q], k_ok ? bytes[q] : 0);
    src += kTiledRowBytes;
  }
};

// The same MMAs, in the same order per output, as RangePartial: range r's partial starts from zero
// (an MMA onto zeroed accumulators gives the bits of RangePartial's fresh form, a . b + 0), and
// every token group runs its MMAs (x rows past M are zero-filled). A block walks every range and
// keeps the rows form's running sum ((p0 + p1) + p2) + ...; or, kAcrossBlocks (N with few groups),
// takes one range and stores its partials in work space, which GemmSumRangesKernel then sums in
// range order, as the split form's last block does. Either way the bits are the split form's.
// (Two instances, not a runtime switch: with a cross-block sum in the same kernel the one-block
// form runs 1.8x slower; the sum is a kernel of its own so that the block-per-range loop keeps
// the code it has without it.)
template <typename W, typename X, int NT, bool kAcrossBlocks>
__global__ void __launch_bounds__(kTiledWarps * 32, 3) GemmTiledKernel(Params p) {
  using A = MmaType<X>;
  static_assert(std::is_same<A, W>::value && !std::is_same<X, float>::value, "16-bit x and weights of the MMA's type");
  extern __shared__ __align__(16) unsigned char ring[];  // [kTiledStages][rows 64 + 8 NT][128 B]
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // token tiles are the fastest grid index: the token tiles of one weight group run together and
  // read it from L2 rather than HBM (as in the rows form)
  const int token_tile = blockIdx.x, token0 = (p.token_tile0 + token_tile) * 8 * NT;
  const int group = kAcrossBlocks ? blockIdx.y / p.ranges : blockIdx.y;
  const int row0 = group * kTiledRows, tile = group * kTiledWarps + warp;
  const int r_begin = kAcrossBlocks ? blockIdx.y % p.ranges : 0, r_end = kAcrossBlocks ? r_begin + 1 : p.ranges;
  const int c_first = r_begin * p.range_chunks, c_last = min(r_end * p.range_chunks, p.chunks);
  // stages count from the block's first chunk, in 16-byte k units of the rows
  const int unit0 = c_first * (kChunkK / 8), row_units = p.K / 8;
  const int stages = (c_last - c_first + 1) / 2;
  const int my_unit = unit0 + tid % 8;  // a copy's k unit at stage 0
  TiledCopier<kTiledRows> wcopy;
  TiledCopier<8 * NT> xcopy;
  wcopy.Init(p.w, p.K * 2, row0, p.N, unit0, tid);
  xcopy.Init(p.x, p.K * 2, token0, p.M, unit0, tid);
  constexpr uint32_t kXBlock = kTiledRows * kTiledRowBytes;  // x rows follow the weight rows in a stage
  // the first stages' weights stream in while the previous kernel drains; x only after it
  for (int s = 0; s < kTiledStages - 1; ++s) {
    if (s < stages) wcopy.IssueAndAdvance(ring_base + s * kTiledStageBytes<NT>, s * 8 + my_unit < row_units);
  }
  PdlWait();
  for (int s = 0; s < kTiledStages - 1; ++s) {
    if (s < stages) xcopy.IssueAndAdvance(ring_base + s * kTiledStageBytes<NT> + kXBlock, s * 8 + my_unit < row_units);
    CopyAsyncCommit();
  }
  // A lane's reads of a chunk: 16 bytes of rows g and g + 8 of its tile and of token g of each
  // token group, at k unit 4 ch + t of the stage; rows g, g + 8 and 8 j + g share their parity,
  // so the offsets are fixed apart from 1 KB per token group, and chunk 1's are chunk 0's with the
  // 64-byte halves swapped (xor 64).
  const uint32_t a_off = TiledOffset(warp * kTileRows + g, t), x_off = kXBlock + TiledOffset(g, t);
  constexpr uint32_t kRowsOf8 = 8 * kTiledRowBytes;
  // Ranges outside, chunks inside: the accumulators stay in their registers through the chunk loop
  // (a stage loop with per-chunk range checks and per-group exits costs ~130 register moves per
  // chunk), and the ring is refilled at every even chunk.
  float sum[NT][4];
  int c = c_first;
  for (int r = r_begin; r < r_end; ++r) {
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    const int c_end = min(c + p.range_chunks, c_last);
    for (; c < c_end; ++c) {
      const int lc = c - c_first, st = lc >> 1;
      if ((lc & 1) == 0) {
        CopyAsyncWait<kTiledStages - 2>();
        __syncthreads();  // stage st is in every thread's view, and every warp is done with stage st - 1's slot
        const int next = st + kTiledStages - 1;
        if (next < stages) {
          const uint32_t block = ring_base + (next % kTiledStages) * kTiledStageBytes<NT>;
          const bool k_ok = next * 8 + my_unit < row_units;
          wcopy.IssueAndAdvance(block, k_ok);
          xcopy.IssueAndAdvance(block + kXBlock, k_ok);
        }
        CopyAsyncCommit();
      }
      const uint32_t slot = ring_base + (st % kTiledStages) * kTiledStageBytes<NT>, half = (lc & 1) << 6;
      const uint4 wa = LoadShared16(slot + (a_off ^ half));
      const uint4 wb = LoadShared16(slot + (a_off ^ half) + kRowsOf8);
      const uint32_t wr[2][4] = {{wa.x, wa.y, wa.z, wa.w}, {wb.x, wb.y, wb.z, wb.w}};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 xv = LoadShared16(slot + (x_off ^ half) + j * kRowsOf8);
        const uint32_t xr[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {wr[0][2 * h], wr[1][2 * h], wr[0][2 * h + 1], wr[1][2 * h + 1]};
          Mma<A>(acc[j], a, xr[2 * h], xr[2 * h + 1], false);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) sum[j][i] = r == r_begin ? acc[j][i] : sum[j][i] + acc[j][i];
  }
  CopyAsyncWaitAll();
  PdlLaunchDependents();
  if constexpr (!kAcrossBlocks) {
    if (tile >= p.tiles) return;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) StoreOut(p, sum[j][i], tile, token0, j, i, lane);
    }
  } else {
    // this range's partial of each tile into work space, [token tile][tile][range][NT * 4][32]
    if (tile >= p.tiles) return;
    constexpr int kElems = NT * 4 * 32;
    float* dst = p.partials + ((static_cast<int64_t>(token_tile) * p.tiles + tile) * p.ranges + r_begin) * kElems;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[(4 * j + i) * 32 + lane] = sum[j][i];
    }
  }
}

// The block-per-range tiled form's partials summed in range order: grid (tiles, token tiles of the
// launch), each block one tile's NT * 4 * 32 outputs.
template <int NT>
__global__ void __launch_bounds__(128) GemmSumRangesKernel(Params p) {
  PdlWait();  // the partials are the previous kernel's
  PdlLaunchDependents();
  const int tile = blockIdx.x, token_tile = blockIdx.y, token0 = (p.token_tile0 + token_tile) * 8 * NT;
  SumRanges<NT>(p, p.partials + (static_cast<int64_t>(token_tile) * p.tiles + tile) * p.ranges * (NT * 4 * 32), true, tile, token0, threadIdx.x, blockDim.x);
}

// The forms (dispatch_policy.cc chooses; the comment at the top of this file says what each is).
using Form = policy::GemmForm;
static_assert(kBlockWarps == policy::kGemmBlockWarps && kMinRangeChunks == policy::kGemmMinRangeChunks && kChunkK == policy::kGemmChunkK && kTileRows == policy::kGemmTileRows &&
                  kTiledWarps == policy::kGemmTiledWarps && gemm::kWgmmaRows == policy::kGemmWgmmaRows && gemm::kWgmmaTokens == policy::kGemmWgmmaTokens && kMaxGridY == policy::kMaxGridY,
              "the dispatch rules size this file's launches (dispatch_policy.h)");

// Work space (floats per token tile) and counters (per token tile) of the split form when it sums
// ranges across blocks; token tiles are launched in chunks whose work space fits kWorkSpaceMax.
struct CrossBlock {
  size_t floats_per_token_tile;
  int counters_per_token_tile;
};
Status LaunchChunks(Params p, int token_tiles, const CrossBlock* cross, Scratch& scratch, cudaStream_t s, const std::function<Status(const Params&, int)>& launch) {
  int chunk = std::min(token_tiles, kMaxGridY);  // token tiles are grid.y of the split form
  if (cross) {
    const size_t per_token_tile = cross->floats_per_token_tile * sizeof(float);
    chunk = static_cast<int>(std::clamp<size_t>(kWorkSpaceMax / per_token_tile, 1, chunk));
    KDTREE_RETURN_IF_ERROR(scratch.Reserve(chunk * per_token_tile, s));
    void* counters = nullptr;
    KDTREE_RETURN_IF_ERROR(scratch.Zeroed(static_cast<size_t>(chunk) * cross->counters_per_token_tile * sizeof(int), s, &counters));
    p.partials = static_cast<float*>(scratch.ptr);
    p.counters = static_cast<int*>(counters);
  }
  for (int first = 0; first < token_tiles; first += chunk) {
    p.token_tile0 = first;
    KDTREE_RETURN_IF_ERROR(launch(p, std::min(chunk, token_tiles - first)));
  }
  return Status::Ok();
}

// The wgmma form: x staged per token tile into work space, in launches whose staged x fits
// kWorkSpaceMax.
Status RunWgmma(Params p, bool f16, Scratch& scratch, cudaStream_t s) {
  const int token_tiles = (p.M + gemm::kWgmmaTokens - 1) / gemm::kWgmmaTokens;
  const size_t per_tile = gemm::WgmmaStagedBytes(p);
  const int chunk = static_cast<int>(std::clamp<size_t>(kWorkSpaceMax / per_tile, 1, std::min(token_tiles, kMaxGridY)));
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(chunk * per_tile, s));
  for (int first = 0; first < token_tiles; first += chunk) {
    p.token_tile0 = first;
    KDTREE_RETURN_IF_ERROR(gemm::LaunchWgmma(p, f16, std::min(chunk, token_tiles - first), scratch.ptr, s));
  }
  return Status::Ok();
}

template <typename W, typename X, int NT>
Status Run(const Params& p, const policy::GemmPlan& plan, Scratch& scratch, cudaStream_t s) {
  const Form form = plan.form;
  // the split and rows forms' instance: the plan's load depth (only one token tile of 16-bit x has
  // a deep instance; the plan gives the others their kLoadAhead)
  constexpr int kDeepAhead = kDeepInstance<X, NT> ? policy::kGemmDeepLoadAhead : kLoadAhead<X, NT>;
  const bool deep = kDeepInstance<X, NT> && plan.load_ahead == policy::kGemmDeepLoadAhead;
  if (!deep && plan.load_ahead != kLoadAhead<X, NT>) return Unsupported("gemm: the plan's load depth ", plan.load_ahead, " has no kernel instance for token tiles of ", 8 * NT);
  const int token_tiles = (p.M + 8 * NT - 1) / (8 * NT);
  const size_t elems = static_cast<size_t>(NT) * 4 * 32;
  const int groups = (p.tiles + kBlockWarps - 1) / kBlockWarps;
  const dim3 block(kBlockWarps * 32);
  if (form == Form::kRows) {
    const auto kernel = deep ? GemmRowsKernel<W, X, NT, kDeepAhead> : GemmRowsKernel<W, X, NT, kLoadAhead<X, NT>>;
    return LaunchChunks(p, token_tiles, nullptr, scratch, s, [&](const Params& q, int n) { return LaunchPdl("gemm (rows form)", kernel, dim3(n, groups), block, 0, s, q); });
  }
  const CrossBlock cross{static_cast<size_t>(p.tiles) * p.ranges * elems, p.tiles};
  if constexpr (NT >= 4 && !std::is_same<X, float>::value) {
    if (form == Form::kWgmma) return RunWgmma(p, std::is_same<X, __half>::value, scratch, s);
    if (form == Form::kTiled || form == Form::kTiledSplit) {
      const bool across = form == Form::kTiledSplit;
      const auto kernel = across ? GemmTiledKernel<W, X, NT, true> : GemmTiledKernel<W, X, NT, false>;
      KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kTiledSmem<NT>)), "gemm (tiled form): shared memory"));
      const int blocks_y = (p.tiles + kTiledWarps - 1) / kTiledWarps * (across ? p.ranges : 1);
      const CrossBlock partials{cross.floats_per_token_tile, 0};  // no counters: the sum is its own kernel
      return LaunchChunks(p, token_tiles, across ? &partials : nullptr, scratch, s, [&](const Params& q, int n) {
        KDTREE_RETURN_IF_ERROR(LaunchPdl("gemm (tiled form)", kernel, dim3(n, blocks_y), dim3(kTiledWarps * 32), kTiledSmem<NT>, s, q));
        return across ? LaunchPdl("gemm (tiled form): range sums", GemmSumRangesKernel<NT>, dim3(p.tiles, n), dim3(128), 0, s, q) : Status::Ok();
      });
    }
  }
  const int blocks_per_tile = (p.ranges + kBlockWarps - 1) / kBlockWarps;
  const int warps = std::min(kBlockWarps, p.ranges);
  const size_t smem = blocks_per_tile == 1 ? warps * elems * sizeof(float) : 0;
  const auto kernel = deep ? GemmSplitKernel<W, X, NT, kDeepAhead> : GemmSplitKernel<W, X, NT, kLoadAhead<X, NT>>;
  return LaunchChunks(p, token_tiles, blocks_per_tile > 1 ? &cross : nullptr, scratch, s, [&](const Params& q, int n) {
    return LaunchPdl("gemm (split form)", kernel, dim3(p.tiles * blocks_per_tile, n), dim3(warps * 32), smem, s, q);
  });
}

// Token tiles of 8, 16, 32 or 64 tokens (32 at most for f32 x, whose fragments are 3 planes): the
// plan's NT.
template <typename W, typename X>
Status RunTokens(const Params& p, const policy::GemmPlan& plan, Scratch& scratch, cudaStream_t s) {
  if (plan.nt == 1) return Run<W, X, 1>(p, plan, scratch, s);
  if (plan.nt == 2) return Run<W, X, 2>(p, plan, scratch, s);
  if constexpr (std::is_same<X, float>::value) {
    return Run<W, X, 4>(p, plan, scratch, s);
  } else {
    if (plan.nt == 4) return Run<W, X, 4>(p, plan, scratch, s);
    return Run<W, X, 8>(p, plan, scratch, s);
  }
}

}  // namespace

Status LaunchGemm(const GemmArgs& a, cudaStream_t s, Scratch& scratch, const GemmContext& ctx) {
  Params p{};
  p.x = a.x.data;
  p.w = static_cast<const uint4*>(a.w.data);
  p.y = a.y.data;
  p.y_dtype = a.y.dtype;
  p.M = static_cast<int>(a.x.dim(0));
  p.K = static_cast<int>(a.x.dim(1));
  p.N = static_cast<int>(a.w.dim(0));
  if (p.M == 0 || p.N == 0) return Status::Ok();
  p.chunks = (p.K + kChunkK - 1) / kChunkK;
  p.tiles = (p.N + kTileRows - 1) / kTileRows;
  if (static_cast<int64_t>(p.tiles) * kTileRows * p.K >= (int64_t{1} << 40)) return Invalid("gemm: N x K = ", p.N, " x ", p.K, " is too large");
  policy::GemmCall c;
  c.m = p.M;
  c.n = p.N;
  c.k = p.K;
  c.x = a.x.dtype;
  c.warps_per_sm = kWarpsPerSm;
  policy::GemmPlan plan;
  KDTREE_RETURN_IF_ERROR(policy::PlanGemm(c, policy::Device{ctx.sms, gemm::WgmmaAvailable()}, ctx.forced.gemm, &plan));
  p.ranges = plan.ranges;
  p.range_chunks = plan.range_chunks;
  *ctx.form = policy::GemmFormName(plan.form);
  if (a.w.dtype == DType::kF16) return RunTokens<__half, __half>(p, plan, scratch, s);
  if (a.x.dtype == DType::kF32) return RunTokens<__nv_bfloat16, float>(p, plan, scratch, s);
  return RunTokens<__nv_bfloat16, __nv_bfloat16>(p, plan, scratch, s);
}

}  // namespace cuda
}  // namespace kdtree
