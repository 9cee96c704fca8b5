// W4A16 GEMM on the packed layout (w4a16_layout.h): y[M, N] = x[M, K] . dequant(W)^T, and its
// grouped MoE form.
//
// At decode the GEMM is a pure weight stream (0.56 bytes per weight against 2 bytes of x per
// token), so the design is about bytes in flight and instructions per byte:
//  * W rows are the 16-row M side of mma.m16n8k16 and tokens the 8-wide N side: one token costs
//    one MMA per 16 x 16 weights instead of wasting 15/16 of a 16-token tile.
//  * Each lane fetches its A fragments straight from HBM, two 16-byte loads per 128 k (a warp's
//    load is 512 contiguous bytes), kRing steps ahead in a register ring (no shared memory).
//    One LOP3 + one HSUB2 turn a nibble pair into an exact bf16x2 (or f16x2) code pair q = u - 8.
//  * x: the layout's k order makes a lane's B fragments for both k16 slices of a 32-k block eight
//    consecutive k, one 16-byte load (layout v2; an 8-byte load per slice would make each load of
//    8 token rows 8 L1 wavefronts instead of 4). Up to 8
//    tokens with K a multiple of 128, x is read in place (L1-resident, no K-tail predicates);
//    otherwise a staging kernel first rewrites it in fragment order, zero-padded, so a warp's load
//    is 512 contiguous bytes; at 9-16 tokens each warp copies its next step of it into shared
//    memory (cp.async) while it computes the current one, except on matrices of up to 8192 x 8192,
//    which read 9-16 token rows in place too (ChooseForm). f32 x is split into three bf16 planes
//    (hi + mid + lo = x to 24 bits), three MMAs with the same exact codes.
//  * Codes are exact, so the MMA computes the f32 sum of x * q per group; a group's sum is then
//    scaled into the accumulator: y = sum_g s_g * (sum_{k in g} x_k q_k). A lane's 8 scales (two
//    rows, the step's 4 groups) arrive with the step's weights in one 16-byte load.
//  * Work is stream-K: the (tile, step) space of a matrix is cut into equal ranges, one per block
//    and within it one per warp, so every warp streams the same bytes and the ring never drains at
//    tile boundaries. A block sums the tiles its warps share in shared memory, in warp order; a
//    tile crossing into the next block is finished by one exchange between the two (CombineSplitTiles).
//  * Launches use programmatic dependent launch: a GEMM fills its weight ring (and, at decode,
//    prefetches the next steps into L2) while the previous kernel drains, and waits for it only
//    before reading x.
//  * Every output element is computed in the same order whatever M is (MMA columns are
//    independent; the ranges depend only on N, K and the device), so results are batch-invariant.
//  * At 17+ tokens on large N, w4a16_wgmma.cu's warpgroup kernel (sm_90a) takes over: whole tiles
//    per warp and x shared by four warps through the tensor cores, replaying these ranges' rounding.
// Limits (docs/benchmarks/cuda.md; the measurements behind them in docs/gpu/notes.md): at M = 1
// the kernel streams the large shapes as fast as a pure read in its own access pattern and
// occupancy (tools/gpu/stream_floor.cu); a read at 4 blocks per SM, which 128 registers per thread
// do not allow, is a few percent faster. The step arithmetic (~150-160 instructions per KB of
// weights, 88 of them dequantization; 8 HMMA.16816 per KB at M <= 8, 16 at M <= 16) is bound by
// its dependency chains and control code at 4 warps per scheduler, not by its dequantization
// count: fewer dequantization instructions (biased codes) and a deeper shared-memory ring were
// both slower, a flatter loop with the same instruction count faster.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../common/dispatch_policy.h"
#include "w4a16_kernel.cuh"

namespace kdtree {
namespace cuda {
namespace {

using namespace w4a16;

// The code type the MMA runs in for activations X: f16 for f16, bf16 otherwise.
template <typename X>
using CodeT = typename std::conditional<std::is_same<X, __half>::value, __half, __nv_bfloat16>::type;

// A block's warps split its step range and combine the tiles they share in shared memory; only a
// tile that crosses a block boundary is combined across blocks, by one exchange.
constexpr int kWarps = policy::kW4A16WarpsPerBlock;
constexpr int kThreads = kWarps * 32;
// Pieces per warp of a MoE verify launch whose split gives a warp fewer than
// policy::kW4A16PiecesMinSteps steps (dispatch_policy.cc's PiecesPerWarp).
constexpr int kPiecesMax = policy::kW4A16PiecesMax;
// Steps in flight per warp: at one token group 3 KB of weights in registers, with 16 warps per SM
// (<= 128 registers) 48 KB per SM; with more groups fewer, which leaves their x and accumulators
// the registers. Each depth is the fastest one measured for its token groups: a deeper ring slows
// the 2- and 4-group tiles (their x needs the registers), a shallower one the one-token stream.
// Tiles given more registers at 12 warps per SM were slower; 20 warps per SM spill.
template <int NT>
constexpr int kRing = NT == 1 ? 3 : NT == 4 ? 1 : 2;
// Steps a decode launch (one token group, dense) prefetches into L2 before it waits for the
// previous kernel: the weight stream starts while that kernel drains. More steps compete with the
// previous kernel's last warps (8-16 were slower on the large shapes), and with more token groups
// (x staged) prefetching was slower; one step is the fastest measured.
constexpr int kPrefetchSteps = 1;
constexpr int kWarpsPerSm = policy::kW4A16WarpsPerSm;  // stream-K ranges per SM and weight matrix (= resident warps up to 32 tokens)
// Token tiles per launch. Staged x (16 tiles of 64 tokens: 15 MB at K = 7168) bounds a chunk at
// kChunkTiles; read in place, only the exchange slots do, up to kChunkExchangeBytes of them. Fewer
// launches are faster where a launch has many tiles: every launch ends on a tail, and a MoE launch
// runs all of its tile slots while the routing (on the device) fills only some (a 65-token MoE
// verify step has ~450 slots per projection, ~290 used), so read in place a MoE launch takes all
// of them at once. A block that loops over several tiles instead was no faster there and slowed
// the kernel's other uses.
constexpr int kChunkTiles = 16;
constexpr size_t kChunkExchangeBytes = size_t{32} << 20;

// Where the NT-token-group kernel divides: with the multiply the 16-token kernel's loop came out
// slower (the compiler schedules it worse), so that one keeps the division.
template <int NT>
__device__ __forceinline__ int Quotient(const Divisor& v, int n) {
  if constexpr (NT == 2) {
    return n / v.d;
  } else {
    return v.Div(n);
  }
}

// The forms of the stream-K kernel besides its token groups (NT); all compute every output in the
// same order, so a row's bits do not depend on the form.
//  kStandard  x staged (StageXKernel) above one token group; at two groups each warp copies its
//             next step of it into shared memory
//  kOneToken  one token per tile (NT = 1): the MMA columns of token 2 t + 1 are not scaled, parked
//             or exchanged
//  kEvenColumns  2-4 tokens per tile (NT = 1), token u in MMA column 2 u (read in place by the
//             lanes g = 2 u, 2 u + 1): as in the one-token form the odd columns are not scaled,
//             parked or exchanged, so a step has 8 scale FMAs instead of 16. One token keeps a
//             form of its own: as an even-column tile it is slightly slower at M = 1 (the same
//             arithmetic in a different schedule).
//  kXInPlace  two groups reading the x rows in place, as one group does (dispatch_policy.cc's
//             ChooseForm says where)
using Form = policy::W4A16Form;
// Tokens per tile of the even-column form.
constexpr int kEvenColumnTokens = policy::kW4A16EvenColumnTokens;

// Whether x is read from the staged copy (StageXKernel): 16-bit x with more than one group of 8
// tokens in the standard form. With one group the in-place rows are few (one at decode, where
// staging would only add a launch); with more, in-place loads hit 8 L1 lines each. f32 x is never
// staged.
template <typename X, int NT, Form F>
constexpr bool StagesX() { return NT > 1 && !std::is_same<X, float>::value && F != Form::kXInPlace; }
inline bool StagesX(DType x, int nt, Form f) { return nt > 1 && x != DType::kF32 && f != Form::kXInPlace; }

// B fragments (x[k .. k + 3] of one token) as the MMA takes them: one bf16x2/f16x2 register pair
// for 16-bit x, three (lo, mid, hi bf16 planes: x to 24 bits) for f32 x. Out-of-range blocks (a K
// tail) load zeros: their codes are zero too, and the loads stay unconditional so that the
// compiler can issue a whole step's loads before the first MMA.
template <typename X>
struct BFrag {
  static constexpr int kPlanes = std::is_same<X, float>::value ? 3 : 1;
  uint32_t r[kPlanes][2];
};
__device__ __forceinline__ BFrag<float> SplitF32(const float4 v) {
  BFrag<float> f;
  const Bf16Planes a = SplitPair(v.x, v.y), b = SplitPair(v.z, v.w);
  f.r[0][0] = a.lo;
  f.r[0][1] = b.lo;
  f.r[1][0] = a.mid;
  f.r[1][1] = b.mid;
  f.r[2][0] = a.hi;
  f.r[2][1] = b.hi;
  return f;
}
// Both k16 slices of a 32-k block: x[k0 .. k0 + 7] of one token, slice s from x[k0 + 4 s] (the
// layout's k order, w4a16_layout.h): one 16-byte load for 16-bit x.
template <typename X>
struct BlockB {
  BFrag<X> s[2];
};
// One slice alone (x[k0 + 4 s .. + 3]): with 4 or more token groups, loading both slices of every
// group up front costs registers the 128-register budget does not have (spills double at 32 tokens).
template <typename X>
__device__ __forceinline__ BFrag<X> LoadSliceB(const X* xk, bool valid) {
  if constexpr (std::is_same<X, float>::value) {
    return SplitF32(valid ? LoadActivation(reinterpret_cast<const float4*>(xk)) : make_float4(0.f, 0.f, 0.f, 0.f));
  } else {
    uint2 v = make_uint2(0u, 0u);
    if (valid) v = LoadActivation(reinterpret_cast<const uint2*>(xk));
    BFrag<X> f;
    f.r[0][0] = v.x;
    f.r[0][1] = v.y;
    return f;
  }
}
template <typename X>
__device__ __forceinline__ BlockB<X> BlockFromWords(const uint4 v) {
  BlockB<X> f;
  f.s[0].r[0][0] = v.x;
  f.s[0].r[0][1] = v.y;
  f.s[1].r[0][0] = v.z;
  f.s[1].r[0][1] = v.w;
  return f;
}
template <typename X>
__device__ __forceinline__ BlockB<X> LoadBlockB(const X* xk, bool valid) {
  if constexpr (std::is_same<X, float>::value) {
    BlockB<X> f;
    f.s[0] = LoadSliceB<X>(xk, valid);
    f.s[1] = LoadSliceB<X>(xk + 4, valid);
    return f;
  } else {
    return BlockFromWords<X>(valid ? LoadActivation(reinterpret_cast<const uint4*>(xk)) : make_uint4(0u, 0u, 0u, 0u));
  }
}
// The same from the warp's shared-memory copy of staged 16-bit x (SharedX), by its 32-bit shared
// address: a generic pointer into shared memory makes the compiler rebuild the shared window base
// (S2R SR_CgaCtaId, LEA) at every step.
template <typename X>
__device__ __forceinline__ BlockB<X> SharedBlockB(uint32_t addr) {
  static_assert(!std::is_same<X, float>::value, "f32 x is never staged (StagesX)");
  return BlockFromWords<X>(LoadShared16(addr));
}

// part (+)= codes . x: the planes smallest first, so the f32 sum keeps f32 precision.
template <typename X>
__device__ __forceinline__ void MmaB(float* part, const uint32_t* a, const BFrag<X>& b, bool fresh) {
  using A = CodeT<X>;
#pragma unroll
  for (int pl = 0; pl < BFrag<X>::kPlanes; ++pl) Mma<A>(part, a, b.r[pl][0], b.r[pl][1], fresh && pl == 0);
}

// Whether acc element i holds a token of the launch: in the one-token and even-column forms only
// the MMA columns 2 t, elements 0 and 2, do; the others are neither scaled, parked nor exchanged.
template <Form F>
constexpr bool LiveElement(int i) { return (F != Form::kOneToken && F != Form::kEvenColumns) || (i & 1) == 0; }

// One token group's staged x of a step: 8 k16 slices x 32 lanes x 8 B (StageXKernel's order).
constexpr int kXStepBytes = 8 * 32 * 8;

// One step (128 k of the lane's two rows): 8 k16 slices per group of 8 tokens, each group's sum
// scaled into acc as it ends. xs[j] points at this step's x of token 8 j + g (+ 8 t), so every x
// load is a register + immediate; with shared x (kSharedX) the step's x is at shared address x_shared
// instead, [group j][32-k block b][lane][16 B]. Only `blocks` 32-k blocks hold real k (a K tail).
// Straight-line code (no branches): the compiler hoists the x loads and interleaves them with
// dequantization and MMAs (loading a step's x into registers up front measured no faster and
// cost 1 block per SM at 16 tokens).
template <typename X, typename S, int NT, int G, Form F, bool kSharedX>
__device__ __forceinline__ void RunStep(const uint4& w0, const uint4& w1, const ScaleFrag<S>& sf, int step, int blocks,
                                        const X* const (&xs)[NT], uint32_t x_shared, float (&acc)[NT][4], float (&part)[NT][4]) {
  using A = CodeT<X>;
  // Staged x (StagesX): block b of the step is 256 elements further, zero-padded past K;
  // otherwise x is read in place, 32 k per block. In place, 16-bit x always has whole steps
  // (ChooseNt stages it otherwise), so only f32 x predicates its loads at a K tail.
  constexpr bool kStaged = StagesX<X, NT, F>();
  constexpr bool kPredicated = !kStaged && std::is_same<X, float>::value;
  constexpr int kBlockStride = kStaged ? 32 * 8 : 32;
  constexpr bool kWholeBlock = NT <= 2;  // x of both slices in one load (LoadSliceB says why not always)
  static_assert(!kSharedX || kWholeBlock, "shared x is read a whole block at a time");
  const uint32_t magic = kMagic<A>;
  const uint32_t lo[4] = {w0.x, w0.y, w0.z, w0.w}, hi[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const bool valid = kPredicated ? b == 0 || b < blocks : true;
    BlockB<X> xb[kWholeBlock ? NT : 1];
    if constexpr (kWholeBlock) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (kSharedX) {
          xb[j] = SharedBlockB<X>(x_shared + j * kXStepBytes + 32 * 16 * b);
        } else {
          xb[j] = LoadBlockB<X>(xs[j] + kBlockStride * b, valid);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const uint32_t a[4] = {Dequant2<A>(lo[b] >> (8 * s), magic), Dequant2<A>(hi[b] >> (8 * s), magic),
                             Dequant2<A>(lo[b] >> (8 * s + 4), magic), Dequant2<A>(hi[b] >> (8 * s + 4), magic)};
      const bool fresh = (32 * b) % G == 0 && s == 0;  // compile-time once unrolled
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (kWholeBlock) {
          MmaB<X>(part[j], a, xb[j].s[s], fresh);
        } else {
          MmaB<X>(part[j], a, LoadSliceB<X>(xs[j] + kBlockStride * b + 4 * s, valid), fresh);
        }
      }
    }
    if ((32 * b + 32) % G == 0) {  // a group ends (compile-time): scale its exact sums into acc
      const int q = G == 32 ? b : G == 64 ? (2 * step + b / 2) & 3 : step & 3;  // its slot in the scale block
      float s_lo, s_hi;  // rows g and g + 8
      ScalesOf<S>(sf, q, &s_lo, &s_hi);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j][0] = fmaf(part[j][0], s_lo, acc[j][0]);
        acc[j][2] = fmaf(part[j][2], s_hi, acc[j][2]);
        if constexpr (LiveElement<F>(1)) {
          acc[j][1] = fmaf(part[j][1], s_lo, acc[j][1]);
          acc[j][3] = fmaf(part[j][3], s_hi, acc[j][3]);
        }
      }
    }
  }
}

// Token tile `tile` (of all the launch's): logical rows [row_start, row_start + rows) of one expert.
__device__ __forceinline__ bool ResolveTile(const GemmParams& p, int tile, int* expert, int* row_start, int* rows) {
  if (p.moe_tiles != nullptr) {
    if (tile >= *p.num_tiles) return false;
    const Tile t = p.moe_tiles[tile];
    *expert = t.expert;
    *row_start = t.row_start;
    *rows = t.rows;
  } else {
    *expert = 0;
    *row_start = tile * p.tile_tokens;
    *rows = min(p.tile_tokens, p.M - *row_start);
  }
  return *rows > 0;
}

// MoE with few (token, expert) pairs (a decode step): every block orders the pairs by expert itself
// instead of waiting for a MoeSortKernel launch (a separate sort costs each projection one more
// kernel in the dependent chain, which at decode is latency). Same convention as the sort:
// logical rows are the valid pairs in expert order (pair order within an expert), cut into tiles of
// tile_tokens rows per expert; the rows of this block's tile get x_row/out_row written (other
// blocks of the tile write the same values). Block-wide: every thread calls it; returns false when
// the tile does not exist.
// Its shared memory comes after the kernel's other dynamic shared memory, and only one-token-group
// launches have it: a static array here would also sit in every 16-token block, whose 80 KB then no
// longer fit twice per SM (which more than doubles the 16-token time).
constexpr int kRoutePairsMax = policy::kW4A16RoutePairsMax;
constexpr int kRouteSharedBytes = (2 * kRoutePairsMax + 4) * sizeof(int);
// kTileRows is tile_tokens: 8 (one token group), 4 in the even-column form, or 1 in the one-token
// form (a tile per pair).
// A compile-time count: with the tile size read at run time a MoE decode step is measurably slower.
template <int kTileRows>
__device__ bool RouteTile(const GemmParams& p, int tile, int* shared, int* expert, int* row_start, int* rows) {
  int* expert_of = shared;                       // [kRoutePairsMax]
  int* tile_start = shared + kRoutePairsMax;     // [kRoutePairsMax]: the pair's row if it starts a tile
  int* tile_info = shared + 2 * kRoutePairsMax;  // expert, first row, rows
  const int q = threadIdx.x, pairs = p.route_pairs;
  if (q < pairs) {
    const int e = p.route_ids[q];
    expert_of[q] = e >= 0 && e < p.route_experts ? e : INT_MAX;  // invalid ids route nowhere, as in the sort
  }
  if (q == 0) tile_info[2] = 0;
  __syncthreads();
  // the pair's row (its rank by (expert, pair)), its expert's first row and row count
  const int e = q < pairs ? expert_of[q] : INT_MAX;
  int pos = 0, first = 0, count = 0;
  if (e != INT_MAX) {
    for (int r = 0; r < pairs; ++r) {
      const int er = expert_of[r];
      pos += er < e || (er == e && r < q);
      first += er < e;
      count += er == e;
    }
  }
  const int in_expert = pos - first;
  if (q < pairs) tile_start[q] = e != INT_MAX && in_expert % kTileRows == 0 ? pos : INT_MAX;
  __syncthreads();
  if (e != INT_MAX) {
    int my_tile = -1;  // tiles are numbered by their first rows
    for (int r = 0; r < pairs; ++r) my_tile += tile_start[r] <= pos;
    if (my_tile == tile) {
      p.x_row[pos] = p.route_gather ? p.by_route_topk.Div(q) : q;
      p.out_row[pos] = q;
      if (in_expert % kTileRows == 0) {
        tile_info[0] = e;
        tile_info[1] = pos;
        tile_info[2] = min(kTileRows, count - in_expert);
      }
    }
  }
  __syncthreads();  // the tile, and this block's x_row/out_row writes, are visible to the block
  *expert = tile_info[0];
  *row_start = tile_info[1];
  *rows = tile_info[2];
  return *rows > 0;
}

// 16-bit x of a chunk of token tiles, rewritten in B-fragment order so that the GEMM's x loads are
// 512 contiguous bytes per warp (read in place, the 8 token rows of a warp load hit 8 L1 lines:
// 7.6 wavefronts per request at 16 tokens, L1 56% busy). Layout, per chunk tile and group of 8
// tokens j: [32-k block q][lane (g, t)][8 elements] = x[token 8 j + g][32 q + 8 t .. + 7], zero
// for missing tokens and for k past K. One thread per 16 bytes.
template <int NT, typename X>
__global__ void StageXKernel(const GemmParams p, int chunk_tiles, X* xs) {
  PdlWait();  // x is the previous kernel's, and the previous GEMM may still read xs
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = static_cast<int>(i & 31), g = lane >> 2, t = lane & 3;
  const int blocks32 = p.slices / 2;
  const int64_t q = (i >> 5) % blocks32, jt = (i >> 5) / blocks32;  // jt = chunk tile * NT + j
  if (jt >= static_cast<int64_t>(chunk_tiles) * NT) return;
  const int tile = p.tile_offset + static_cast<int>(jt / NT), tok = 8 * static_cast<int>(jt % NT) + g;
  const int k = static_cast<int>(q) * 32 + 8 * t;
  int expert, row_start, rows;
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (ResolveTile(p, tile, &expert, &row_start, &rows) && tok < rows && k < p.K) {
    const int lr = row_start + tok;
    v = *reinterpret_cast<const uint4*>(static_cast<const X*>(p.x) + static_cast<int64_t>(p.x_row ? p.x_row[lr] : lr) * p.K + k);
  }
  reinterpret_cast<uint4*>(xs)[i] = v;
}

// kSilu: the SiLU epilogue (p.silu_mul), a compile-time choice in every kernel that has it: as a
// run-time flag its code raises the registers and stack of the plain instances too (the prefill
// kernel by 14 registers, a few percent slower).
template <int NT, Form F, bool kSilu>
__device__ __forceinline__ void StoreTile(const GemmParams& p, const float (&v)[NT][4], int tile, int row_start, int rows, int g, int t) {
  // The even-column form skips its dead columns; the one-token form keeps its guarded stores of
  // them (never taken): removing them changes its schedule, not its bytes, and was no faster.
  constexpr bool kEven = F == Form::kEvenColumns;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if constexpr (kSilu) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (!kEven || LiveElement<F>(i)) StoreSilu<kEven>(p, v[j][i], v[j][i + 2], j, i, tile, row_start, rows, g, t);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (!kEven || LiveElement<F>(i)) StoreElement<kEven>(p, v[j][i], j, i, tile, row_start, rows, g, t);
    }
  }
}

// Split tiles. A tile whose steps lie in several warps' ranges is parked by each of them in
// shared memory (slot 0: the warp's first tile, slot 1: its last; the tiles in between are whole
// and stored directly), and after one barrier a warp of the block sums the parked partials in warp
// order. A tile that crosses a block boundary (at most two blocks: a block's range is at least a
// tile) is then finished by whichever of its two blocks comes second: one 64-bit exchange per
// element hands over the other's sum, and a + b = b + a exactly, so the result does not depend on
// which block was first. No global fence or counter: the value travels in the atomic (a fence +
// counter + reload chain at the end of every warp's range costs ~2.5 us per call). A per-tile
// shared-memory counter instead of the barrier (no warp waits for another) is slower everywhere.
template <int NT>
constexpr int kSlotFloats = NT * 8 * w4::kTileRows;
// Whether a warp copies its next step's staged x into shared memory (cp.async) while it computes
// the current one: at 16 tokens the x loads, issued right before their MMAs, are otherwise the top
// stall (long scoreboard). 2 KB per token group and step, two slots per warp (three, copied two
// steps ahead, are slower). Only at NT = 2: at NT = 4 the slots leave one block per SM, faster on
// the dense shapes and slower on the expert ones.
template <int NT, Form F>
constexpr bool SharedX() { return NT == 2 && F != Form::kXInPlace; }
constexpr int kXSlots = 2;
template <int NT, Form F>
constexpr int SharedXBytes() { return SharedX<NT, F>() ? kWarps * kXSlots * NT * kXStepBytes : 0; }
template <int NT>
constexpr int RouteBytes() { return NT == 1 ? kRouteSharedBytes : 0; }  // RouteTile: MoE decode only
template <int NT, Form F>
constexpr int SharedBytes() { return kWarps * 2 * kSlotFloats<NT> * sizeof(float) + SharedXBytes<NT, F>() + RouteBytes<NT>(); }

// acc element i of n-tile j of a lane, in a partial slot: [token 8 j + 2 t + (i & 1)][row g + 8 (i >> 1)]
__device__ __forceinline__ int SlotIndex(int j, int i, int g, int t) { return (8 * j + 2 * t + (i & 1)) * w4::kTileRows + g + 8 * (i >> 1); }

// This block's stream-K range, [begin, end) in steps of the matrix, and its warps' shares. Never
// empty: the grid has no more blocks than ranges. Step indices are 32-bit (RunGemm checks that a
// matrix has fewer than kMaxSteps): 64-bit divisions are subroutine calls, and the ones at the start
// and the end of a launch sit on its critical path.
struct BlockRange {
  int begin, end;
  __device__ int WarpBegin(const GemmParams& p, int w) const { return min(end, begin + w * p.steps_per_warp); }
  __device__ int WarpEnd(const GemmParams& p, int w) const { return min(end, WarpBegin(p, w) + p.steps_per_warp); }
};
__device__ __forceinline__ BlockRange RangeOf(const GemmParams& p) {
  const int begin = static_cast<int>(blockIdx.x) * p.steps_per_block;
  return {begin, min(p.tiles * p.steps, begin + p.steps_per_block)};
}

template <int NT, Form F>
__device__ __forceinline__ void ParkPartial(float* slot, const float (&acc)[NT][4], int g, int t) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (LiveElement<F>(i)) slot[SlotIndex(j, i, g, t)] = acc[j][i];
}

// Both halves of a 16-byte exchange slot at once: its old value comes back.
__device__ __forceinline__ void AtomicExch128(uint64_t* slot, uint64_t lo, uint64_t hi, uint64_t* old_lo, uint64_t* old_hi) {
  asm volatile(
      "{\n .reg .b128 v, o;\n mov.b128 v, {%2, %3};\n atom.exch.b128 o, [%4], v;\n mov.b128 {%0, %1}, o;\n}\n"
      : "=l"(*old_lo), "=l"(*old_hi)
      : "l"(lo), "l"(hi), "l"(slot)
      : "memory");
}

// The exchange of a boundary tile under the SiLU epilogue: an output needs its gate row g and up
// row g + 8 finished in the same place, so each (g, g + 8) pair travels in one 16-byte atomic
// (element-wise exchanges could leave the gate finished by one block and the up by the other).
// Same slots, paired: [token 8 j + 2 t + i][g] x 16 bytes.
template <int NT, Form F>
__device__ __forceinline__ void ExchangePairs(const GemmParams& p, const float (&sum)[NT][4], uint64_t* slots, int tile, int row_start, int rows, int g, int t) {
  uint64_t other[NT][2][2];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      other[j][i][0] = other[j][i][1] = 0;
      if (LiveElement<F>(i)) {
        AtomicExch128(slots + 2 * ((8 * j + 2 * t + i) * 8 + g), (1ull << 32) | __float_as_uint(sum[j][i]), (1ull << 32) | __float_as_uint(sum[j][i + 2]), &other[j][i][0], &other[j][i][1]);
      }
    }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (other[j][i][0] >> 32) {  // second: finish the pair and leave the slot zero for the next launch
        StoreSilu<F == Form::kEvenColumns>(p, sum[j][i] + __uint_as_float(static_cast<uint32_t>(other[j][i][0])), sum[j][i + 2] + __uint_as_float(static_cast<uint32_t>(other[j][i][1])), j, i, tile,
                  row_start, rows, g, t);
        uint64_t* slot = slots + 2 * ((8 * j + 2 * t + i) * 8 + g);
        slot[0] = slot[1] = 0;
      }
    }
}

// The block's sum of split tile `tile` (warps wa..wb in order), stored, or finished by exchange.
template <int NT, Form F, bool kSilu>
__device__ __forceinline__ void CombineTile(const GemmParams& p, const BlockRange& br, const float* parked, int tile, int wa, int wb, bool inside, int row_start,
                                            int rows, int g, int t) {
  const int t0 = tile * p.steps;
  float sum[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) sum[j][i] = 0.f;
  for (int w = wa; w <= wb; ++w) {
    const bool first = tile == Quotient<NT>(p.by_steps, br.WarpBegin(p, w));
    const float* slot = parked + (2 * w + (first ? 0 : 1)) * kSlotFloats<NT>;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (LiveElement<F>(i)) sum[j][i] += slot[SlotIndex(j, i, g, t)];
  }
  if (inside) {
    StoreTile<NT, F, kSilu>(p, sum, tile, row_start, rows, g, t);
    return;
  }
  // The boundary between blocks b and b + 1 has exchange slot b. All of a lane's exchanges are in
  // flight before any result is looked at: checking each before issuing the next cost one round
  // trip per element (4 per lane at 8 tokens, 32 at 64: 6-17% of the time at 16-64 tokens).
  const int boundary = t0 < br.begin ? blockIdx.x - 1 : blockIdx.x;
  uint64_t* slots = p.exchange + (static_cast<int64_t>(blockIdx.y) * p.range_blocks + boundary) * kSlotFloats<NT>;
  if constexpr (kSilu) {
    ExchangePairs<NT, F>(p, sum, slots, tile, row_start, rows, g, t);
  } else {  // (not a return above: nvcc warns that the loops below are unreachable in the kSilu instances)
    unsigned long long other[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        other[j][i] = LiveElement<F>(i) ? atomicExch(reinterpret_cast<unsigned long long*>(slots + SlotIndex(j, i, g, t)), (1ull << 32) | __float_as_uint(sum[j][i])) : 0;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (other[j][i] >> 32) {  // second: finish the element and leave the slot zero for the next launch
          StoreElement<F == Form::kEvenColumns>(p, sum[j][i] + __uint_as_float(static_cast<uint32_t>(other[j][i])), j, i, tile, row_start, rows, g, t);
          slots[SlotIndex(j, i, g, t)] = 0;
        }
      }
  }
}

// After the block barrier: sum the parked partials of the block's split tiles, store the tiles that
// lie inside the block, and exchange the two boundary tiles' block sums.
// The range and the parked partials are recomputed here, not kept live across the streaming loop.
template <int NT, Form F, bool kSilu, int kPhysWarps = kWarps>
__device__ void CombineSplitTiles(const GemmParams& p, int row_start, int rows) {
  const int wib = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const BlockRange br = RangeOf(p);
  extern __shared__ float4 shared_partials[];
  const float* parked = reinterpret_cast<const float*>(shared_partials);
  const int t_lo = Quotient<NT>(p.by_steps, br.begin), t_hi = Quotient<NT>(p.by_steps, br.end - 1);
  for (int tile = t_lo + wib; tile <= t_hi; tile += kPhysWarps) {
    const int t0 = tile * p.steps, t1 = t0 + p.steps;
    const int c0 = max(t0, br.begin), c1 = min(t1, br.end);  // the block's part of the tile
    const int wa = Quotient<NT>(p.by_steps_per_warp, c0 - br.begin), wb = Quotient<NT>(p.by_steps_per_warp, c1 - 1 - br.begin);
    const bool inside = t0 >= br.begin && t1 <= br.end;
    if (wa == wb && inside) continue;  // one warp had it whole and stored it
    CombineTile<NT, F, kSilu>(p, br, parked, tile, wa, wb, inside, row_start, rows, g, t);
  }
}

// Whether the NT-group kernel walks its range as one flat loop with precomputed segment ends (see
// kFlatLoop in W4A16Kernel).
constexpr bool kFlatLoopFor(int nt) { return nt == 1 || nt == 4; }

// Copies one step of staged x for the NT token groups (2 KB each; group j at src + j * group_bytes)
// into a warp's shared-memory slot: 16-byte cp.async, 4 per lane per group. `src` and `dst` point at
// the lane's first 16 bytes; its others are 512 bytes apart on both sides, immediates of the copies.
template <int NT>
__device__ __forceinline__ void CopyXStep(const char* src, int64_t group_bytes, uint32_t dst) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < kXStepBytes / 16 / 32; ++q) CopyAsync16(dst + j * kXStepBytes + 32 * 16 * q, src + j * group_bytes + 32 * 16 * q);
}

template <typename X, typename S, int NT, int G, Form F, int kPieces, bool kSilu>
__global__ void __launch_bounds__(kThreads / kPieces, (NT <= 4 ? kWarpsPerSm / kWarps : 1) * kPieces) W4A16Kernel(const GemmParams p) {
  // Programmatic dependent launch: the next kernel in the stream may start as our blocks retire,
  // and we may start before the previous kernel ends. Weights and scales never depend on earlier
  // kernels, so a dense launch fills its ring first and waits (griddepcontrol.wait) only before
  // reading x or writing anything; MoE waits at once (its tiles come from the sort kernel).
  PdlLaunchDependents();
  const bool moe = p.moe_tiles != nullptr;
  if (moe) PdlWait();
  extern __shared__ float4 shared_partials[];
  int expert, row_start, rows;
  const int my_tile = p.tile_offset + static_cast<int>(blockIdx.y);
  int* route_shared = reinterpret_cast<int*>(reinterpret_cast<char*>(shared_partials) + SharedBytes<NT, F>() - RouteBytes<NT>());
  constexpr int kRouteRows = F == Form::kOneToken ? 1 : F == Form::kEvenColumns ? kEvenColumnTokens : 8;
  if (!(NT == 1 && p.route_ids != nullptr ? RouteTile<kRouteRows>(p, my_tile, route_shared, &expert, &row_start, &rows)
                                          : ResolveTile(p, my_tile, &expert, &row_start, &rows))) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wib = threadIdx.x >> 5;
  const int64_t total = static_cast<int64_t>(p.tiles) * p.steps;
  // This warp's steps (empty for the last warps of a short last block: they still meet the barrier)
  const BlockRange br = RangeOf(p);
  // kPieces > 1: this warp streams the ranges of kPieces consecutive warps of the block's split
  // (pieces), one after the other with its ring running on, and parks or stores each piece as
  // that warp would: the same operations in the same order, so the same bits (PiecesPerWarp).
  static_assert(kPieces == 1 || (kFlatLoopFor(NT) && !SharedX<NT, F>()), "pieces ride the flat loop's segment ends");
  const int f_begin = br.WarpBegin(p, wib * kPieces), f_end = br.WarpEnd(p, wib * kPieces + kPieces - 1);
  float* parked = reinterpret_cast<float*>(shared_partials);  // [kWarps][2 slots][kSlotFloats]
  const uint4* wq = p.qw + static_cast<int64_t>(expert) * total * kUint4PerStep + lane;
  const S* sq = reinterpret_cast<const S*>(p.sc) + static_cast<int64_t>(expert) * p.tiles * p.blocks * w4::kScalesPerBlock + 8 * g;

  // Load cursor: the ring holds steps [f, f + kRing<NT>). Weights advance 1 KB per step; a tile's
  // scale blocks follow the previous tile's, so the scale pointer advances one block every
  // 4G/128 steps and at every tile end (a partly used last block).
  constexpr int kStepsPerBlock = 4 * G / w4::kStepK;
  const int first_tile = Quotient<NT>(p.by_steps, f_begin), first_step = f_begin - first_tile * p.steps;
  int ld_step = first_step;
  int ld_f = f_begin;
  const uint4* ld_w = wq + static_cast<int64_t>(f_begin) * kUint4PerStep;
  const S* ld_s = sq + (static_cast<int64_t>(first_tile) * p.blocks + ld_step / kStepsPerBlock) * w4::kScalesPerBlock;
  // kRing + 1 register slots, the loop unrolled over them: step i reads slot i % kSlots while step
  // i + kRing loads into another, so no slot is copied aside before its reload (with kRing slots
  // the compiler moves each step's 12 registers: ~28 of ~210 instructions per step).
  constexpr int kSlots = kRing<NT> + 1;
  uint4 ring_w[kSlots][2];
  ScaleFrag<S> ring_s[kSlots];
  // The flat loop: the cursor advances whether or not the range has a step left to load, so that
  // the unrolled slots address their loads as immediate offsets from one pointer per iteration (at
  // G = 32 a step is one scale block and tiles' blocks follow each other, so the scale cursor is
  // linear too), and a step ends a tile's segment when it reaches a precomputed step index. It is
  // faster at one and four token groups (~1 us at M = 1 on the large shapes); at two and eight
  // groups the compiler's schedule and spills of the flat loop are worse, so they keep the
  // per-step cursor (so does the in-place form at two groups).
  constexpr bool kFlatLoop = kFlatLoopFor(NT);
#define KDTREE_ISSUE(SLOT)                                                                                                           \
  do {                                                                                                                               \
    if (ld_f < f_end) {                                                                                                              \
      ring_w[SLOT][0] = LoadStream(ld_w);                                                                                            \
      ring_w[SLOT][1] = LoadStream(ld_w + 32);                                                                                       \
      for (int v = 0; v < static_cast<int>(sizeof(S)) / 2; ++v) ring_s[SLOT].v[v] = __ldg(reinterpret_cast<const uint4*>(ld_s) + v); \
      if constexpr (!kFlatLoop) {                                                                                                  \
        ++ld_f;                                                                                                                      \
        ld_w += kUint4PerStep;                                                                                                       \
      }                                                                                                                              \
      if constexpr (!kFlatLoop || kStepsPerBlock > 1) {                                                                            \
        const bool tile_end = ++ld_step == p.steps;                                                                                  \
        if (tile_end || ld_step % kStepsPerBlock == 0) ld_s += w4::kScalesPerBlock;                                                  \
        if (tile_end) ld_step = 0;                                                                                                   \
      }                                                                                                                              \
    }                                                                                                                                \
    if constexpr (kFlatLoop) {                                                                                                     \
      ++ld_f;                                                                                                                        \
      ld_w += kUint4PerStep;                                                                                                         \
      if constexpr (kStepsPerBlock == 1) ld_s += w4::kScalesPerBlock;                                                                \
    }                                                                                                                                \
  } while (0);
#pragma unroll
  for (int s = 0; s < kRing<NT>; ++s) KDTREE_ISSUE(s)
  // While it waits, a decode launch also asks L2 for the kPrefetchSteps steps after its ring
  // (weights and scales): the copy engine fetches them during the previous kernel's tail.
  if (kPrefetchSteps > 0 && NT == 1 && !moe && lane == 0 && ld_f < f_end) {
    const int n = min(kPrefetchSteps, f_end - ld_f);
    PrefetchL2(ld_w, n * kUint4PerStep * 16);
    const S* s_end = reinterpret_cast<const S*>(p.sc) + static_cast<int64_t>(expert + 1) * p.tiles * p.blocks * w4::kScalesPerBlock;
    const int64_t s_n = min(static_cast<int64_t>(n / kStepsPerBlock + 2) * w4::kScalesPerBlock, static_cast<int64_t>(s_end - ld_s));
    PrefetchL2(ld_s, static_cast<uint32_t>(s_n * sizeof(S)) & ~15u);
  }
  if (!moe) PdlWait();  // x and the outputs are the previous kernels'

  // B operand: staged x (this lane's 8 bytes of each slice), or x in place at tokens 8 j + g
  // (the even-column form: g / 2; tokens past the tile repeat its last; their columns are dropped)
  constexpr bool kStaged = StagesX<X, NT, F>();
  const X* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if constexpr (kStaged) {
      xr[j] = static_cast<const X*>(p.xs) + (static_cast<int64_t>(blockIdx.y) * NT + j) * p.slices * 32 * 4 + lane * 8;
    } else {
      const int lr = row_start + min(F == Form::kEvenColumns ? g >> 1 : 8 * j + g, rows - 1);
      xr[j] = static_cast<const X*>(p.x) + static_cast<int64_t>(p.x_row ? p.x_row[lr] : lr) * p.K + 8 * t;
    }
  }

  // Shared x (SharedX): two slots of this warp's staged x, [slot][group j][32-k block][lane][16 B].
  // A lane reads back only the 16-byte units it copied itself (its B fragments), so its own
  // cp.async.wait_group orders copy and read: no warp barrier. The addressing is set up once: the
  // copy source advances 2 KB a step, wrapping to step 0 at a tile end (x does not depend on the
  // weight tile), and the slots alternate by one XOR (a generic pointer into shared memory makes
  // the compiler rebuild the shared window base and both copy addresses at every step: ~35 more
  // instructions per step).
  constexpr bool kSharedX = SharedX<NT, F>();
  constexpr uint32_t kXSlotBytes = NT * kXStepBytes;
  const uint32_t x_lane = static_cast<uint32_t>(__cvta_generic_to_shared(shared_partials)) + kWarps * 2 * kSlotFloats<NT> * sizeof(float) + wib * kXSlots * kXSlotBytes + 16 * lane;
  const char* x_src = reinterpret_cast<const char*>(xr[0]);  // group 0, this lane's first 16 bytes
  const int64_t x_group_bytes = static_cast<int64_t>(p.slices) * 32 * 4 * sizeof(X);
  const int x_tile_bytes = p.steps * kXStepBytes;
  int x_next = (first_step + 1 == p.steps ? 0 : first_step + 1) * kXStepBytes;  // byte offset of the step copied next
  uint32_t x_read = 0;  // the slot read this step
  if constexpr (kSharedX) {
    if (f_begin < f_end) CopyXStep<NT>(x_src + static_cast<int64_t>(first_step) * kXStepBytes, x_group_bytes, x_lane);
    CopyAsyncCommit();
  }
  float acc[NT][4], part[NT][4];  // part: the current group's exact sum (each group starts it afresh)
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = part[j][i] = 0.f;
  int tile = first_tile, step = first_step;
  int piece = wib * kPieces;  // the piece (a warp's range of the split) being streamed
  int piece_begin = f_begin, piece_end = kPieces == 1 ? f_end : br.WarpEnd(p, piece);
  int piece_first_tile = tile;
  int seg_end = min(piece_end, (tile + 1) * p.steps);  // where this piece's part of `tile` ends (a step index)
  // x of this step: in place (one token group) a pointer advanced step by step (no per-step
  // address arithmetic); staged, an offset from the step index (cheaper for several groups)
  constexpr int kXPerStep = kStaged ? 8 * 32 * 4 : w4::kStepK;  // elements per step (staged: 8 slices x 32 lanes x 4)
  const X* x_step = xr[0] + step * kXPerStep;
  for (int base = f_begin; base < f_end; base += kSlots) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (base + s >= f_end) break;
      KDTREE_ISSUE((s + kRing<NT>) % kSlots)
      const uint4 w0 = ring_w[s][0], w1 = ring_w[s][1];
      const ScaleFrag<S> sw = ring_s[s];
      const X* xs[NT];
      if constexpr (kSharedX) {
        // the next step's x into the other slot (past the range's end too: a valid step, never
        // read), then wait for this step's
        CopyXStep<NT>(x_src + x_next, x_group_bytes, x_lane + (x_read ^ kXSlotBytes));
        CopyAsyncCommit();
        CopyAsyncWait<1>();
        x_next = x_next + kXStepBytes == x_tile_bytes ? 0 : x_next + kXStepBytes;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) xs[j] = NT == 1 ? x_step : xr[j] + step * kXPerStep;
      RunStep<X, S, NT, G, F, kSharedX>(w0, w1, sw, step, (p.K - step * w4::kStepK) / 32, xs, x_lane + x_read, acc, part);
      x_read ^= kXSlotBytes;
      x_step += kXPerStep;
      ++step;
      if (kFlatLoop ? base + s + 1 == seg_end : step == p.steps || base + s + 1 == f_end) {
        const int t0 = tile * p.steps;
        if (t0 >= piece_begin && t0 + p.steps <= piece_end) {
          StoreTile<NT, F, kSilu>(p, acc, tile, row_start, rows, g, t);  // whole in this piece
        } else {
          ParkPartial<NT, F>(parked + (2 * piece + (tile == piece_first_tile ? 0 : 1)) * kSlotFloats<NT>, acc, g, t);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
        // the tile ended (inside the range, with one piece per warp): the next one starts
        const bool tile_ended = kPieces > 1 ? seg_end == t0 + p.steps : kFlatLoop ? seg_end < f_end : step == p.steps;
        if (tile_ended) {
          step = 0;
          ++tile;
          x_step = xr[0];
          if constexpr (kPieces == 1) seg_end = min(f_end, seg_end + p.steps);
        }
        if constexpr (kPieces > 1) {
          if (seg_end == piece_end && piece_end < f_end) {  // the piece ended: the next one starts
            ++piece;
            piece_begin = piece_end;
            piece_end = br.WarpEnd(p, piece);
            piece_first_tile = tile;
          }
          seg_end = min(piece_end, (tile + 1) * p.steps);
        }
      }
    }
  }
#undef KDTREE_ISSUE
  if constexpr (kSharedX) CopyAsyncWait<0>();  // the last (unread) x copy lands before the block ends
  __syncthreads();  // every warp's split tiles are parked
  CombineSplitTiles<NT, F, kSilu, kWarps / kPieces>(p, row_start, rows);
}

// MoE sum mode: y[t] = sum_j weights[t, j] * pair[t * topk + j], j in order.
__global__ void MoeSumKernel(const float* pair, int T, int topk, int N, const float* weights, void* y, DType y_dtype) {
  PdlWait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(T) * N) return;
  const int r = static_cast<int>(i / N), n = static_cast<int>(i % N);
  float out = 0.f;
  for (int j = 0; j < topk; ++j) out = fmaf(weights[r * topk + j], pair[static_cast<int64_t>(r * topk + j) * N + n], out);
  StoreFromF32(y, y_dtype, i, out);
}

// MoE: counts pairs per expert, orders them by expert and cuts tiles of <= tile_rows rows. Every
// thread owns a contiguous run of experts, and one block-wide scan gives each run its first row and
// first tile (a single thread walking the 384 experts through global memory takes ~30 us).
// Positions inside an expert are not deterministic, and need not be: rows are independent.
__global__ void MoeSortKernel(const int32_t* ids, int pairs, int topk, int experts, bool gather, int tile_rows,
                              int* x_row, int* out_row, Tile* tiles, int* num_tiles, int* counts) {
  PdlWait();  // ids and the scratch it rewrites belong to earlier kernels
  PdlLaunchDependents();  // the GEMM's blocks may launch now; they wait for the tiles
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  const int per = (experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(experts, static_cast<int>(threadIdx.x) * per), e1 = min(experts, e0 + per);
  int2 mine = make_int2(0, 0);  // rows, tiles of this thread's experts
  for (int e = e0; e < e1; ++e) {
    const int c = __ldcg(&counts[e]);  // the atomics' totals, from L2
    mine.x += c;
    mine.y += (c + tile_rows - 1) / tile_rows;
  }
  __shared__ int2 warp_sums[32];
  int2 total;
  int2 at = BlockExclusiveScan(mine, &total, warp_sums);
  for (int e = e0; e < e1; ++e) {
    const int c = __ldcg(&counts[e]);
    for (int r = 0; r < c; r += tile_rows) tiles[at.y++] = Tile{e, at.x + r, min(tile_rows, c - r), 0};
    counts[e] = at.x;  // becomes the insertion cursor
    at.x += c;
  }
  if (threadIdx.x == 0) *num_tiles = total.y;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e < 0 || e >= experts) continue;  // an invalid id contributes nothing (its row stays unwritten)
    const int pos = atomicAdd(&counts[e], 1);
    x_row[pos] = gather ? p / topk : p;
    out_row[pos] = p;
  }
}

Status Aligned(const Tensor& t, int bytes, const char* op) {
  if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) return Invalid(op, ": ", t.Describe(), " must start on a ", bytes, "-byte boundary (check its offset)");
  return Status::Ok();
}

template <typename X, typename S, int NT, int G, Form F, int kPieces, bool kSilu>
Status LaunchKernel(const GemmParams& p, dim3 grid, cudaStream_t s) {
  constexpr int kShared = SharedBytes<NT, F>();  // the block's parked partials: 8-64 KB
  auto* kernel = W4A16Kernel<X, S, NT, G, F, kPieces, kSilu>;
  if constexpr (kShared > 48 * 1024) {
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared), "w4a16 kernel: shared memory"));
  }
  return LaunchPdl("w4a16 kernel", kernel, grid, dim3(kThreads / kPieces), kShared, s, p);  // see griddepcontrol in the kernel
}
template <typename X, typename S, int NT, Form F, int kPieces, bool kSilu>
Status LaunchG(const GemmParams& p, int group, dim3 grid, cudaStream_t s) {
  switch (group) {
    case 32: return LaunchKernel<X, S, NT, 32, F, kPieces, kSilu>(p, grid, s);
    case 64: return LaunchKernel<X, S, NT, 64, F, kPieces, kSilu>(p, grid, s);
    default: return LaunchKernel<X, S, NT, 128, F, kPieces, kSilu>(p, grid, s);  // validated: 32, 64 or 128
  }
}
template <typename X, int NT, Form F = Form::kStandard, int kPieces = 1>
Status LaunchS(const GemmParams& p, int group, dim3 grid, cudaStream_t s) {
  if (p.silu_mul) return p.sc_f32 ? LaunchG<X, float, NT, F, kPieces, true>(p, group, grid, s) : LaunchG<X, uint16_t, NT, F, kPieces, true>(p, group, grid, s);
  return p.sc_f32 ? LaunchG<X, float, NT, F, kPieces, false>(p, group, grid, s) : LaunchG<X, uint16_t, NT, F, kPieces, false>(p, group, grid, s);
}
template <typename X>
Status LaunchStage(const GemmParams& p, int nt, int chunk_tiles, void* xs, cudaStream_t s) {
  const int64_t threads = static_cast<int64_t>(chunk_tiles) * nt * (p.slices / 2) * 32;  // one per 16 bytes
  const dim3 grid(static_cast<unsigned>((threads + 255) / 256));
  X* out = static_cast<X*>(xs);
  switch (nt) {  // StagesX: nt > 1
    case 2: return LaunchPdl("w4a16 stage x", StageXKernel<2, X>, grid, dim3(256), 0, s, p, chunk_tiles, out);
    case 4: return LaunchPdl("w4a16 stage x", StageXKernel<4, X>, grid, dim3(256), 0, s, p, chunk_tiles, out);
    default: return LaunchPdl("w4a16 stage x", StageXKernel<8, X>, grid, dim3(256), 0, s, p, chunk_tiles, out);
  }
}

template <typename X>
Status LaunchNt(const GemmParams& p, int nt, Form form, int pieces, int group, dim3 grid, cudaStream_t s) {
  if constexpr (std::is_same<X, __nv_bfloat16>::value) {
    if (nt == 2) return form == Form::kXInPlace ? LaunchS<X, 2, Form::kXInPlace>(p, group, grid, s) : LaunchS<X, 2>(p, group, grid, s);
    if (nt == 4) return LaunchS<X, 4>(p, group, grid, s);
    if (pieces == kPiecesMax) {  // PiecesPerWarp
      return form == Form::kEvenColumns ? LaunchS<X, 1, Form::kEvenColumns, kPiecesMax>(p, group, grid, s) : LaunchS<X, 1, Form::kStandard, kPiecesMax>(p, group, grid, s);
    }
  }
  if (nt == 1) {
    if (form == Form::kOneToken) return LaunchS<X, 1, Form::kOneToken>(p, group, grid, s);
    return form == Form::kEvenColumns ? LaunchS<X, 1, Form::kEvenColumns>(p, group, grid, s) : LaunchS<X, 1>(p, group, grid, s);
  }
  return LaunchS<X, 8>(p, group, grid, s);
}

// Scratch of one chunk: the staged x (when StagesX).
size_t StagedXBytes(int chunk, int nt, Form form, int slices, DType x) {
  return StagesX(x, nt, form) ? static_cast<size_t>(chunk) * nt * slices * 32 * 4 * 2 : 0;
}
size_t ScratchAfter(size_t used, int chunk, int nt, Form form, int slices, DType x) { return (used + 255) / 256 * 256 + StagedXBytes(chunk, nt, form, slices, x); }

// Token tiles [0, tiles) in launches of `chunk`, each staging its x into `staged_per_tile` bytes of
// scratch per tile: launch(p, token_tiles, xs) with p.tile_offset set.
template <typename Launch>
Status RunChunks(GemmParams p, int tiles, int chunk, size_t staged_per_tile, Scratch& scratch, size_t scratch_used, cudaStream_t s, Launch launch) {
  const size_t offset = (scratch_used + 255) / 256 * 256;
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(offset + chunk * staged_per_tile, s));
  for (int first = 0; first < tiles; first += chunk) {
    p.tile_offset = first;
    KDTREE_RETURN_IF_ERROR(launch(p, std::min(chunk, tiles - first), static_cast<char*>(scratch.ptr) + offset));
  }
  return Status::Ok();
}
// The warpgroup kernels' token tiles of p.M rows (p's stream-K ranges set: they replay them), on the
// prefill kernel or the 32-token one.
Status RunWgmma(const GemmParams& p, bool prefill, int group, int sms, Scratch& scratch, size_t scratch_used, cudaStream_t s) {
  if (prefill) {
    const int tiles = (p.M + kPrefillTileTokens - 1) / kPrefillTileTokens;
    const size_t staged = PrefillStagedBytes(p.steps);
    const int chunk = std::min(tiles, static_cast<int>(std::max<size_t>(1, policy::kWgmmaStagedBytesMax / staged)));
    return RunChunks(p, tiles, chunk, staged, scratch, scratch_used, s,
                     [&](const GemmParams& q, int token_tiles, void* xs) { return LaunchW4A16Prefill(q, group, token_tiles, sms, xs, s); });
  }
  const int tiles = (p.M + kWgmmaTileTokens - 1) / kWgmmaTileTokens;
  return RunChunks(p, tiles, policy::WgmmaChunk(p.M, p.steps, p.tiles), WgmmaStagedBytes(p.steps, p.tiles), scratch, scratch_used, s,
                   [&](const GemmParams& q, int token_tiles, void* xs) { return LaunchW4A16Wgmma(q, group, token_tiles, sms, xs, s); });
}

// The plan of a launch (dispatch_policy.cc), after the limits of the kernels are checked.
Status Plan(const policy::W4A16Call& c, const GemmContext& ctx, policy::W4A16Plan* plan) {
  const int64_t total = w4::Tiles(c.n) * w4::Steps(c.k);
  if (total > kMaxSteps) {
    return Invalid("w4a16: a weight matrix of N = ", c.n, ", K = ", c.k, " has ", total, " steps of 16 rows x 128 k; at most ", kMaxSteps, " are supported");
  }
  const policy::Device device{ctx.sms, WgmmaAvailable()};
  KDTREE_RETURN_IF_ERROR(policy::PlanW4A16(c, device, ctx.forced.w4a16_prefill, plan));
  *ctx.form = policy::W4A16FormName(*plan);
  return Status::Ok();
}

// Launches the token tiles [0, token_tiles) of a plan in chunks (kChunkTiles, kChunkExchangeBytes:
// the staged x and the exchange slots are sized for one chunk; chunks run in stream order).
Status RunGemm(GemmParams p, const policy::W4A16Plan& plan, DType x_dtype, int group, int token_tiles, int sms, Scratch& scratch, size_t scratch_used, cudaStream_t s) {
  const policy::W4A16Ranges& r = plan.ranges;
  p.steps_per_block = r.steps_per_block;
  p.steps_per_warp = r.steps_per_warp;
  p.by_steps = MakeDivisor(p.steps);
  p.by_steps_per_warp = MakeDivisor(r.steps_per_warp);
  p.range_blocks = r.blocks;
  if (plan.kernel != policy::W4A16Kernel::kStreamK) return RunWgmma(p, plan.kernel == policy::W4A16Kernel::kPrefill, group, sms, scratch, scratch_used, s);
  p.slices = p.steps * 8;
  const int nt = plan.nt;
  const Form form = plan.form;
  const size_t exchange_per_tile = static_cast<size_t>(r.blocks) * nt * 8 * w4::kTileRows * sizeof(uint64_t);
  const int in_place_chunk = static_cast<int>(std::max<size_t>(kChunkTiles, kChunkExchangeBytes / exchange_per_tile));
  const bool stage = StagesX(x_dtype, nt, form);
  const int chunk = std::min(token_tiles, stage ? kChunkTiles : in_place_chunk);
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(ScratchAfter(scratch_used, chunk, nt, form, p.slices, x_dtype), s));
  void* staged = static_cast<char*>(scratch.ptr) + (scratch_used + 255) / 256 * 256;
  p.xs = stage ? staged : nullptr;
  void* exchange = nullptr;
  KDTREE_RETURN_IF_ERROR(scratch.Zeroed(chunk * exchange_per_tile, s, &exchange));
  p.exchange = static_cast<uint64_t*>(exchange);
  for (int first = 0; first < token_tiles; first += chunk) {
    p.tile_offset = first;
    const int tiles_now = std::min(chunk, token_tiles - first);
    const dim3 grid(r.blocks, tiles_now);
    Status st = !stage ? Status::Ok()
              : x_dtype == DType::kBF16 ? LaunchStage<__nv_bfloat16>(p, nt, tiles_now, staged, s)
                                        : LaunchStage<__half>(p, nt, tiles_now, staged, s);
    KDTREE_RETURN_IF_ERROR(st);
    st = x_dtype == DType::kBF16 ? LaunchNt<__nv_bfloat16>(p, nt, form, plan.pieces, group, grid, s)
       : x_dtype == DType::kF16  ? LaunchNt<__half>(p, nt, form, 1, group, grid, s)
                                 : LaunchNt<float>(p, nt, form, 1, group, grid, s);
    KDTREE_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

// The fields every launch shares: operands and the packed shape.
GemmParams WeightParams(const Tensor& x, const Tensor& qw, const Tensor& sc, int n, int group, int rows) {
  GemmParams p{};
  p.x = x.data;
  p.qw = reinterpret_cast<const uint4*>(qw.data);
  p.sc = static_cast<const char*>(sc.data);
  p.sc_f32 = sc.dtype == DType::kF32;
  p.N = n;
  p.K = static_cast<int>(x.dim(1));
  p.tiles = static_cast<int>(w4::Tiles(n));
  p.steps = static_cast<int>(w4::Steps(p.K));
  p.blocks = static_cast<int>(w4::ScaleBlocks(p.K, group));
  p.M = rows;
  return p;
}

Status CheckAlignment(const Tensor& x, const Tensor& qw, const Tensor& sc, const char* op) {
  KDTREE_RETURN_IF_ERROR(Aligned(qw, 16, op));
  KDTREE_RETURN_IF_ERROR(Aligned(x, 16, op));
  return Aligned(sc, 16, op);
}

}  // namespace

Status LaunchW4A16Gemm(const W4A16GemmArgs& a, cudaStream_t s, Scratch& scratch, const GemmContext& ctx) {
  const int m = static_cast<int>(a.x.dim(0)), n = static_cast<int>(WeightRows(a.y, a.epilogue));
  if (m == 0 || n == 0) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(CheckAlignment(a.x, a.qw, a.sc, "w4a16_gemm"));
  GemmParams p = WeightParams(a.x, a.qw, a.sc, n, a.group, m);
  policy::W4A16Call c;
  c.tokens = m;
  c.n = n;
  c.k = p.K;
  c.group = a.group;
  c.x = a.x.dtype;
  c.sc_f32 = p.sc_f32;
  policy::W4A16Plan plan;
  KDTREE_RETURN_IF_ERROR(Plan(c, ctx, &plan));
  p.silu_mul = a.epilogue == Epilogue::kSiluMul;
  p.tile_tokens = plan.tile_tokens;
  p.y = a.y.data;
  p.y_dtype = a.y.dtype;
  return RunGemm(p, plan, a.x.dtype, a.group, (m + p.tile_tokens - 1) / p.tile_tokens, ctx.sms, scratch, 0, s);
}

Status LaunchMoeGemm(const MoeGemmArgs& a, cudaStream_t s, Scratch& scratch, const GemmContext& ctx) {
  const int experts = static_cast<int>(a.qw.dim(0)), n = static_cast<int>(WeightRows(a.y, a.epilogue));
  const int t = static_cast<int>(a.ids.dim(0)), topk = static_cast<int>(a.ids.dim(1)), pairs = t * topk;
  if (pairs == 0 || n == 0) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(CheckAlignment(a.x, a.qw, a.sc, "moe_gemm"));
  const bool gather = a.mode == MoeMode::kGather;
  policy::W4A16Call c;
  c.tokens = t;
  c.n = n;
  c.k = static_cast<int>(a.x.dim(1));
  c.group = a.group;
  c.x = a.x.dtype;
  c.sc_f32 = a.sc.dtype == DType::kF32;
  c.moe = true;
  c.experts = experts;
  c.topk = topk;
  c.min_warp_steps = a.min_warp_steps;
  policy::W4A16Plan plan;
  KDTREE_RETURN_IF_ERROR(Plan(c, ctx, &plan));
  // token tiles of rows an expert can expect (dispatch_policy.cc), plus one partial tile per expert
  const int nt = plan.nt, tile_rows = plan.tile_tokens;
  const bool route = plan.route;
  const int max_tiles = tile_rows == 1 ? pairs : (pairs + tile_rows - 1) / tile_rows + std::min(experts, pairs);
  GemmParams p = WeightParams(a.x, a.qw, a.sc, n, a.group, pairs);
  p.silu_mul = a.epilogue == Epilogue::kSiluMul;  // gather mode only (validated)
  p.tile_tokens = tile_rows;
  // scratch: x_row[pairs] out_row[pairs] counts[experts] num_tiles tiles[max_tiles] (sum mode: pair rows [pairs, N] f32), partials
  auto align = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t off_out = align(pairs * sizeof(int));
  const size_t off_counts = off_out + align(pairs * sizeof(int));
  const size_t off_num = off_counts + align(experts * sizeof(int));
  const size_t off_tiles = off_num + 256;
  const size_t off_pair = off_tiles + align(max_tiles * sizeof(Tile));
  const size_t used = off_pair + (gather ? 0 : static_cast<size_t>(pairs) * n * sizeof(float));
  // RunGemm may grow (and move) the scratch block: reserve the whole need first
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(ScratchAfter(used, std::min(max_tiles, kChunkTiles), nt, plan.form, p.steps * 8, a.x.dtype), s));
  char* base = static_cast<char*>(scratch.ptr);
  int* x_row = reinterpret_cast<int*>(base);
  int* out_row = reinterpret_cast<int*>(base + off_out);
  int* counts = reinterpret_cast<int*>(base + off_counts);
  int* num_tiles = reinterpret_cast<int*>(base + off_num);
  Tile* tiles = reinterpret_cast<Tile*>(base + off_tiles);
  float* pair_out = reinterpret_cast<float*>(base + off_pair);
  if (route) {
    p.route_ids = a.ids.as<const int32_t>();
    p.route_pairs = pairs;
    p.route_topk = topk;
    p.route_experts = experts;
    p.route_gather = gather;
    p.by_route_topk = MakeDivisor(topk);
  } else {
    KDTREE_RETURN_IF_ERROR(LaunchPdl("moe sort", MoeSortKernel, dim3(1), dim3(1024), 0, s, a.ids.as<const int32_t>(), pairs, topk, experts, gather, tile_rows, x_row, out_row,
                                     tiles, num_tiles, counts));
  }
  p.moe_tiles = tiles;
  p.num_tiles = num_tiles;
  p.x_row = x_row;
  p.out_row = out_row;
  p.y = gather ? a.y.data : pair_out;
  p.y_dtype = gather ? a.y.dtype : DType::kF32;
  KDTREE_RETURN_IF_ERROR(RunGemm(p, plan, a.x.dtype, a.group, max_tiles, ctx.sms, scratch, used, s));
  if (!gather) {
    const int64_t count = static_cast<int64_t>(t) * n;
    KDTREE_RETURN_IF_ERROR(LaunchPdl("moe sum", MoeSumKernel, dim3(static_cast<unsigned>((count + 255) / 256)), dim3(256), 0, s, static_cast<const float*>(pair_out), t, topk, n,
                                     a.weights.as<const float>(), a.y.data, a.y.dtype));
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace kdtree
