// Stage 3 of MLA attention, the merge: a token-head row's chunk partials into its context,
//   partial f32 [T H, max_chunks, R + 2] -> ctx[r] = sum_c weight_c partial_c[r],
//   weight_c = exp(m_c - max) / sum over the chunks of l_c exp(m_c - max)
// with the chunks in a fixed order, so a row's bits depend only on the keys it sees. Many rows
// (verify, prefill: LaunchMergeOut) merge and project to out [T, H, dv] in one kernel, each block
// reading a head's W_vb rows once for up to 8 tokens; few rows (decode, a small tree:
// LaunchMergeContext) write ctx f32 [T H, R] and the projection stage (mla_project*.cu) follows.
// Both forms use the same pieces, so a row gets the same bits from either.
#include "mla_project.cuh"
#include "mla_project_mma.cuh"
#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace {

using namespace mla;

// The merge of a token-head's chunks: ctx[r] = sum_c weight_c partial_c[r], weight_c =
// exp(m_c - max) / sum, then out[v] = W_vb[h, v] . ctx. The pieces below are shared by the one-block
// form (many rows) and the two-kernel form (few rows), so a row gets the same bits from either.

// A warp turns each chunk's (m, l) into its weight once (the weights recomputed per thread and per
// r take ~57 us for a decode token). Each lane keeps its chunks' maxima in `weight`
// (read from global memory once, the loads of a loop in flight together) and reads their sums once.
__device__ __forceinline__ void ChunkWeights(const float* p, int chunks, int R, float* weight) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
#pragma unroll 4
  for (int c = lane; c < chunks; c += 32) {
    const float mc = p[c * (R + 2)];
    weight[c] = mc;
    mx = fmaxf(mx, mc);
  }
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  float denom = 0.f;
#pragma unroll 4
  for (int c = lane; c < chunks; c += 32) {
    const float mc = weight[c];
    if (mc != -INFINITY) denom = fmaf(p[c * (R + 2) + 1], expf(mc - mx), denom);  // explicit: one rounding in every kernel that inlines this
  }
  for (int off = 16; off > 0; off >>= 1) denom += __shfl_xor_sync(0xffffffffu, denom, off);
  for (int c = lane; c < chunks; c += 32) {
    const float mc = weight[c];
    weight[c] = mc == -INFINITY ? 0.f : expf(mc - mx) / denom;
  }
}

// ctx[r]: one FMA chain over the chunks in order. Spread thin (decode: a few rows over many
// blocks) each thread's chain is the critical path, and 16 chunks' loads go out before their FMAs
// (~1.3x faster than the compiler's unrolling). With a block per row the compiler's own unrolling
// measured best (unrolled by 16, prefill's merge is ~5% slower; not unrolled, a verify's merge
// ~1.75x slower).
template <bool kSpread>
__device__ __forceinline__ float ContextValue(const float* p, const float* weight, int chunks, int R, int r) {
  float num = 0.f;
  if constexpr (kSpread) {
#pragma unroll 16
    for (int c = 0; c < chunks; ++c) num = fmaf(weight[c], p[c * (R + 2) + 2 + r], num);
  } else {
    for (int c = 0; c < chunks; ++c) num = fmaf(weight[c], p[c * (R + 2) + 2 + r], num);
  }
  return num;
}

// ctx[r], ctx[r + 1] (r even, R even: 8-byte loads) for a block per row: ContextValue's chains, with
// 8 chunks' loads issued before their FMAs (4 or 16 measure the same).
__device__ __forceinline__ float2 ContextPair(const float* p, const float* weight, int chunks, int R, int r) {
  constexpr int kUnroll = 8;
  float2 num = make_float2(0.f, 0.f);
  int c = 0;
  for (; c + kUnroll <= chunks; c += kUnroll) {
    float2 v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) v[i] = *reinterpret_cast<const float2*>(p + (c + i) * (R + 2) + 2 + r);
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      num.x = fmaf(weight[c + i], v[i].x, num.x);
      num.y = fmaf(weight[c + i], v[i].y, num.y);
    }
  }
  for (; c < chunks; ++c) {
    const float2 v = *reinterpret_cast<const float2*>(p + c * (R + 2) + 2 + r);
    num.x = fmaf(weight[c], v.x, num.x);
    num.y = fmaf(weight[c], v.y, num.y);
  }
  return num;
}

// The chunks row th's keys fill (a whole warp calls it).
__device__ __forceinline__ int RowChunks(KeyCounts key_counts, int th) { return static_cast<int>((key_counts.Warp(th) + kAttnChunk - 1) / kAttnChunk); }

// Many rows (verify, prefill): a block per head and G tokens merges each row's chunks once (warp g
// the chunk weights of row g) and projects every v for all G rows, reading each W_vb row once for
// them (a block per row read the head's 131 KB of W_vb per row: 537 MB for a 512-token prefill).
// With kMma (a bf16 kv_b) the projection runs on tensor cores (mla_project_mma.cuh), a warp per 16
// values of v; ctx rows are then R + 4 floats apart, so the 8 rows' 16-byte reads of an MMA step
// fall in distinct banks.
template <int G, bool kMma>
__global__ void __launch_bounds__(256) CombineOutKernel(const float* partial, KeyCounts key_counts, int max_chunks, int T, int H, int R, const void* kv_b,
                                                        DType kvb_dtype, bool vector_rows, int dn, int dv, OutRows out) {
  static_assert(G <= 8, "a warp per row computes its chunk weights; the MMA projection's tile has 8 rows");
  PdlWait();
  PdlLaunchDependents();
  key_counts.Resolve();
  extern __shared__ float shared[];
  const int stride = kMma ? R + 4 : R;
  float* ctx = shared;                  // [G][stride]
  float* weight = shared + G * stride;  // [G][max_chunks]
  const int h = blockIdx.x, t0 = blockIdx.y * G, rows = G == 1 ? 1 : min(G, T - t0), warp = threadIdx.x >> 5;
  const int64_t th0 = static_cast<int64_t>(t0) * H + h;  // row g: th0 + g H
  __shared__ int row_chunks[G];
  if (warp < rows) {
    const int chunks = RowChunks(key_counts, static_cast<int>(th0 + warp * H));
    if ((threadIdx.x & 31) == 0) row_chunks[warp] = chunks;
    ChunkWeights(partial + (th0 + warp * H) * max_chunks * (R + 2), chunks, R, weight + warp * max_chunks);
  }
  __syncthreads();
  for (int g = 0; g < rows; ++g) {
    const int64_t th = th0 + g * H;
    const float* p = partial + th * max_chunks * (R + 2);
    const int chunks = row_chunks[g];
    if (R % 2 == 0) {
      for (int r = 2 * threadIdx.x; r < R; r += 2 * blockDim.x) *reinterpret_cast<float2*>(ctx + g * stride + r) = ContextPair(p, weight + g * max_chunks, chunks, R, r);
    } else {
      for (int r = threadIdx.x; r < R; r += blockDim.x) ctx[g * stride + r] = ContextValue<false>(p, weight + g * max_chunks, chunks, R, r);
    }
  }
  __syncthreads();
  if constexpr (kMma) {
    const __nv_bfloat16* w_vb = static_cast<const __nv_bfloat16*>(kv_b) + static_cast<int64_t>(h * (dn + dv) + dn) * R;
    for (int v0 = 16 * warp; v0 < dv; v0 += 16 * (blockDim.x / 32)) ProjectTileMma(w_vb, v0, dv, R, ctx, stride, rows, out + th0 * dv, static_cast<int64_t>(H) * dv);
  } else {
    ProjectOut<G>(ctx, rows, kv_b, kvb_dtype, vector_rows, h, R, dn, dv, 0, dv, out + th0 * dv, static_cast<int64_t>(H) * dv);
  }
}

// Few rows (decode, a small tree): a row's merge is spread over many blocks in two launches. Blocks
// of kContextCols values of r merge the chunks into ctx (global, [rows, R]); then blocks of
// kOutVPerBlock values of v project it. One kernel with a block per (row, v range) would merge
// every chunk again in each of its 16 blocks per row (16 x the partial reads: ~16 us of a 36 us
// decode). The projection is launched programmatically dependent: its blocks prefetch their
// W_vb rows into L2 while the merge runs, and wait for it only before reading ctx.
constexpr int kContextCols = 32;  // one warp per block: a decode's 8 rows in 128 blocks, not 32 of 4 warps (decode ~0.4 us faster)
__global__ void __launch_bounds__(kContextCols) CombineContextKernel(const float* partial, KeyCounts key_counts, int max_chunks, int R, float* ctx_out) {
  PdlWait();
  PdlLaunchDependents();
  key_counts.Resolve();
  extern __shared__ float weight[];  // [max_chunks]
  const int th = blockIdx.x, r = blockIdx.y * kContextCols + threadIdx.x;
  const int chunks = RowChunks(key_counts, th);  // the block is one warp
  const float* p = partial + static_cast<int64_t>(th) * max_chunks * (R + 2);
  ChunkWeights(p, chunks, R, weight);
  __syncthreads();
  if (r < R) ctx_out[static_cast<int64_t>(th) * R + r] = ContextValue<true>(p, weight, chunks, R, r);
}

}  // namespace

namespace mla {

Status LaunchMergeOut(const float* partial, KeyCounts key_counts, int max_chunks, int T, int H, int R, const void* kv_b, DType kvb_dtype, bool vector_rows, int dn, int dv, OutRows out,
                      bool project_mma, int ctx_stride, int sms, cudaStream_t s) {
  const size_t weight_bytes = static_cast<size_t>(max_chunks) * sizeof(float);
  // tokens per block: up to 8 while the blocks stay >= 4 per SM (a row's merge reads all its
  // chunks' partials, 131 KB per row at 64 chunks, so a verify wants its blocks) and their ctx and
  // chunk weights fit in 48 KB: a 512-token prefill gains 8 rows of W_vb reuse (~8% faster), while
  // a 65-node verify with 4-8 rows per block (72-136 blocks) would be 1.2-1.3x slower.
  int G = 8;
  while (G > 1 && ((T + G - 1) / G * H < 4 * sms || static_cast<size_t>(G) * (ctx_stride + max_chunks) * sizeof(float) > 48 * 1024)) G /= 2;
  const size_t smem = static_cast<size_t>(G) * (ctx_stride * sizeof(float) + weight_bytes);
  const dim3 grid(H, (T + G - 1) / G);  // a head's blocks next to each other (they share W_vb in L2; prefill ~2% faster)
  const auto launch = [&](auto kernel) {
    return LaunchPdl("mla combine + out", kernel, grid, dim3(256), smem, s, static_cast<const float*>(partial), key_counts, max_chunks, T, H, R,
                     kv_b, kvb_dtype, vector_rows, dn, dv, out);
  };
  if (project_mma) {
    return G == 8 ? launch(CombineOutKernel<8, true>) : G == 4 ? launch(CombineOutKernel<4, true>) : G == 2 ? launch(CombineOutKernel<2, true>) : launch(CombineOutKernel<1, true>);
  }
  return G == 8 ? launch(CombineOutKernel<8, false>) : G == 4 ? launch(CombineOutKernel<4, false>) : G == 2 ? launch(CombineOutKernel<2, false>) : launch(CombineOutKernel<1, false>);
}

Status LaunchMergeContext(const float* partial, KeyCounts key_counts, int max_chunks, int rows, int R, float* ctx, cudaStream_t s) {
  const size_t weight_bytes = static_cast<size_t>(max_chunks) * sizeof(float);
  return LaunchPdl("mla combine", CombineContextKernel, dim3(rows, (R + kContextCols - 1) / kContextCols), dim3(kContextCols), weight_bytes, s, partial, key_counts, max_chunks, R, ctx);
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
