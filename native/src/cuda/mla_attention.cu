// MLA attention over the latent KV cache, in the absorbed form (DeepSeek-V3 / Kimi K2):
//   q_lat[t, h] = W_kb[h]^T q_nope[t, h]                       (R = kv_lora_rank values)
//   score_j     = (q_lat . c_j + q_pe . kpe_j) * scale          over the keys token t may see
//   ctx[t, h]   = sum_j softmax(score)_j c_j;   out[t, h] = W_vb[h] ctx[t, h]
// Keys: the `base` committed slots, then the new tokens the mask allows (causal without a mask;
// a DDTree verify passes the ancestor mask). Flash-decoding style: a token's key list is cut into
// fixed chunks, a block per (chunk, tile of token-head rows), so a 4096-key decode fills the GPU
// instead of running H blocks; chunks combine in a fixed order, so a token's output depends only
// on the keys it sees (decode and tree verify give the same bits for the same prefix).
#include "mla_chunk.cuh"
#include "mla_project_mma.cuh"

namespace kdtree {
namespace cuda {
namespace {

using namespace mla;

constexpr int kQLatR = 32;        // q_lat values per block (one per lane)
constexpr int kQLatSplit = 8;     // warps per block, each summing dn / 8 of the terms
constexpr int kQLatTokens = 8;    // tokens per block (<= kQLatSplit: warp k writes token k)
static_assert(kQLatTokens <= kQLatSplit, "a warp writes each token's sum");
constexpr int kOutVPerBlock = 8;    // output values per merge block when rows are few (8 rather than 32: more blocks for a decode's few rows, ~1.3x faster)
constexpr int kCombineAloneRows = 128;  // from this many rows, one merge kernel (CombineOutKernel) instead of two
// Up to this many rows over the committed prefix (a tree verify of up to 34 tokens at 8 heads) the
// 24-row whole-chunk tiles are at least as fast as the 64-row staged ones (a 9-token verify ~1.4x
// faster, 33 tokens even); above it they are slower (65 tokens ~1.2x).
constexpr int kSmallTilesMaxRows = 272;

// The latent cache holds f32 or bf16 values (CacheT): a bf16 cache is half the bytes to keep and
// to read per key. A bf16 cache whose rows are whole 8-byte pieces runs on tensor cores
// (mla_attention_mma.cu); the CUDA-core kernels below take the rest, widening cache values to f32
// exactly, so their arithmetic is the same for both dtypes.
//
// A cache value's bits, held in a register from the staged kernel's load (issued a stage ahead)
// until its store to shared memory: widening it next to the load would make the thread wait for
// the load before the current stage's FMAs.
template <typename CacheT>
struct CacheBits;
template <>
struct CacheBits<float> {
  using Raw = float;
  static __device__ __forceinline__ Raw Load(const float* p, int64_t i) { return p[i]; }
  static __device__ __forceinline__ float Widen(Raw v) { return v; }
};
template <>
struct CacheBits<__nv_bfloat16> {
  using Raw = uint32_t;
  static __device__ __forceinline__ Raw Load(const __nv_bfloat16* p, int64_t i) { return reinterpret_cast<const uint16_t*>(p)[i]; }
  static __device__ __forceinline__ float Widen(Raw v) { return __uint_as_float(v << 16); }
};
// Four consecutive cache values from shared memory (16 bytes of f32 or 8 of bf16, aligned).
__device__ __forceinline__ float4 CacheValues4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 CacheValues4(const __nv_bfloat16* p) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u), __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xFFFF0000u));
}

// q_lat[t, h, r] = sum_i q_nope[t, h, i] kv_b[h * (dn + dv) + i, r]: a block owns 32 values of r
// of one head (a warp's loads are 128 contiguous bytes of a kv_b row) for up to kQLatTokens
// tokens, so each kv_b value is read once for all of them (once per token costs a 65-node verify
// ~48 us); its 8 warps split i and add up in warp order through shared memory (deterministic, the
// same order for every token count). One thread per r over all of i would leave 32 blocks on the
// GPU, each walking 128 rows (~54 us for a decode token).
__global__ void __launch_bounds__(kQLatR * kQLatSplit) QLatentKernel(const float* q_nope, const void* kv_b, DType kvb_dtype, int T, int H, int dn, int dv, int R,
                                                                   float* q_lat) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float part[kQLatSplit][kQLatTokens][kQLatR];
  const int h = blockIdx.x, t0 = blockIdx.z * kQLatTokens, tokens = min(kQLatTokens, T - t0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.y * kQLatR + lane;
  const int64_t col = static_cast<int64_t>(h) * (dn + dv) * R + r;
  float s[kQLatTokens];
#pragma unroll
  for (int k = 0; k < kQLatTokens; ++k) s[k] = 0.f;
  if (r < R) {
    for (int i = warp; i < dn; i += kQLatSplit) {
      const float w = LoadAsF32(kv_b, kvb_dtype, col + static_cast<int64_t>(i) * R);
#pragma unroll
      for (int k = 0; k < kQLatTokens; ++k) {
        if (k < tokens) s[k] = fmaf(q_nope[(static_cast<int64_t>(t0 + k) * H + h) * dn + i], w, s[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kQLatTokens; ++k) part[warp][k][lane] = s[k];
  __syncthreads();
  // warp k sums token k's parts in warp order
  if (warp < tokens && r < R) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kQLatSplit; ++w) sum += part[w][warp][lane];
    q_lat[(static_cast<int64_t>(t0 + warp) * H + h) * R + r] = sum;
  }
}

// Key counts of a call with a mask on the CUDA-core path (KeyCounts): one warp per token; every
// head of the token gets the count.
__global__ void KeyCountKernel(const uint8_t* mask, int T, int H, int64_t base, const int32_t* base_on_device, int64_t* key_counts) {
  PdlWait();
  PdlLaunchDependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * (blockDim.x >> 5) + warp;
  if (t >= T) return;
  KeyCounts from_mask{nullptr, mask, T, H, base, base_on_device};
  from_mask.Resolve();
  const int64_t count = from_mask.Warp(t * H);  // counted from the mask row
  for (int h = lane; h < H; h += 32) key_counts[static_cast<int64_t>(t) * H + h] = count;
}

// The attention of a chunk of kAttnChunk keys for a tile of ROWS query rows (token-head pairs), as
// two small GEMMs on CUDA cores: scores S = [q_lat | q_pe] . [c | kpe]^T (ROWS x 64, over
// D = R + dr in stages of kTileD through shared memory), the chunk's softmax per row, then the
// partial context P . c (ROWS x R, kTileCols columns at a time). Every key row is read once per
// tile instead of once per (token, head): one block per (token, head, chunk) re-reads the cache
// 8 x 65 times for a 65-node tree verify (~2.5 ms, limited by per-query latency, not traffic).
// Chunks are fixed cuts of each row's key list (the committed slots, then its allowed new tokens),
// and each row's arithmetic has one order whatever the tile: a score is one f32 FMA chain over d,
// the softmax runs over the chunk's keys in order in one thread, a context value is one FMA chain
// over the 64 keys (a padded key adds 0 x finite). So a row's bits do not depend on the other
// rows, on ROWS, or on which mode loaded its keys: tree verify equals decoding over the same keys.
// Modes: SHARED, every row of the tile has the same key list in this chunk (the chunk lies in the
// committed prefix, or attention is causal: key k is slot k for every row, rows differ only in
// how many keys they see); otherwise the tile holds one token's heads and its keys are looked up
// through its mask row.
// A 16 x TX thread grid: RPT rows x KPT keys (scores), then RPT rows x CPT columns. Small
// tiles (decode, a tree node's own keys) are few blocks on a mostly idle GPU, each warp a chain of
// dependent shared-memory reads: they spread a tile over twice the threads and take fewer, larger
// stages.
template <int ROWS>
struct TileLayout {
  static constexpr int kThreads = ROWS <= 16 ? 512 : 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kTx = kThreads / 16;
  static constexpr int kRowsPerThread = ROWS / 16;
  static constexpr int kKeysPerThread = kAttnChunk / kTx;
  static constexpr int kTileD = ROWS <= 16 ? 64 : 32;       // dims of q and keys per stage (128 is slower)
  static constexpr int kTileCols = ROWS <= 16 ? 128 : 64;   // context columns per pass
  static constexpr int kColsPerThread = kTileCols / kTx;
  static constexpr int kQStride = ROWS + 4, kKStride = kAttnChunk + 4, kPStride = ROWS + 4, kCStride = kTileCols + 4;
  static constexpr int kStage = kTileD * (kQStride + kKStride);  // Q and K stage (phase 1)
  static constexpr int kCtx = kAttnChunk * kCStride;             // c columns (phase 3), aliasing the stage
  static constexpr int kFloats = (kStage > kCtx ? kStage : kCtx) + kAttnChunk * kPStride;
  static size_t Bytes(int T, bool shared) { return kFloats * sizeof(float) + (shared ? 0 : static_cast<size_t>(T) * sizeof(int)); }
};

// N consecutive floats of shared memory into registers: 16- or 8-byte reads when N allows (the
// tile strides keep every such run aligned).
template <int N>
__device__ __forceinline__ void LoadRun(const float* src, float (&v)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = *reinterpret_cast<const float4*>(src + i);
      v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 f = *reinterpret_cast<const float2*>(src + i);
      v[i] = f.x, v[i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = src[i];
  }
}

// acc[i][k] += sum over steps of a[step][i] * b[step][k], one FMA chain per element in step order
// (a register tile of an outer-product GEMM; a and b in shared memory, SA and SB floats per step).
template <int M, int N, int STEPS, int SA, int SB>
__device__ __forceinline__ void AccumulateOuter(const float* a, const float* b, float (&acc)[M][N]) {
#pragma unroll 8
  for (int step = 0; step < STEPS; ++step) {
    float av[M], bv[N];
    LoadRun<M>(a + step * SA, av);
    LoadRun<N>(b + step * SB, bv);
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int k = 0; k < N; ++k) acc[i][k] = fmaf(av[i], bv[k], acc[i][k]);
  }
}

// The rows of a CUDA-core tile: token-head rows th0 .. th0 + rows - 1.
struct TileRows {
  int th0, rows;
  __device__ int operator()(int i) const { return i < rows ? th0 + i : -1; }
};

// Phase 2 of a chunk: its softmax, one thread per row, keys in order (scores in probs[key *
// PSTRIDE + row], turned into p); the row's (max, sum) go to its partial.
template <int ROWS, int PSTRIDE>
__device__ __forceinline__ void ChunkSoftmax(float* probs, const int* row_keys, float scale, float* partial, int th0, int max_chunks, int chunk, int R) {
  const int tid = threadIdx.x;
  if (tid < ROWS) {
    float* pr = probs + tid;  // key j at pr[j * PSTRIDE]
    const int n = row_keys[tid];
    float m = -INFINITY, l = 0.f;
    for (int j = 0; j < n; ++j) m = fmaxf(m, ScaledScore(pr[j * PSTRIDE], scale));
    for (int j = 0; j < kAttnChunk; ++j) {
      const float p = j < n ? KeyWeight(pr[j * PSTRIDE], scale, m) : 0.f;
      pr[j * PSTRIDE] = p;
      l += p;
    }
    if (n > 0) {
      float* out = partial + (static_cast<int64_t>(th0 + tid) * max_chunks + chunk) * (R + 2);
      out[0] = m;
      out[1] = l;
    }
  }
}

template <int ROWS, bool SHARED, typename CacheT, bool kBaseOnDevice>
__global__ void __launch_bounds__(TileLayout<ROWS>::kThreads) AttendTileKernel(const float* q_lat, const float* q_pe, const CacheT* cache_c, const CacheT* cache_kpe, const uint8_t* mask,
                                                                 int T, int H, int R, int dr, int64_t base, float scale, int max_chunks, int chunk0,
                                                                 KeyCounts key_counts, float* partial) {
  PdlWait();
  PdlLaunchDependents();
  using L = TileLayout<ROWS>;
  constexpr int RPT = L::kRowsPerThread, KPT = L::kKeysPerThread, CPT = L::kColsPerThread;
  constexpr int kThreads = L::kThreads, kWarps = L::kWarps, kTileD = L::kTileD, kTileCols = L::kTileCols;
  extern __shared__ float4 tile_smem[];
  float* stage_q = reinterpret_cast<float*>(tile_smem);  // [kTileD][ROWS]  (phase 1)
  float* stage_k = stage_q + kTileD * L::kQStride;       // [kTileD][64 keys]
  float* ctx_c = stage_q;                                // [64 keys][kTileCols]  (phase 3)
  float* probs = stage_q + (L::kStage > L::kCtx ? L::kStage : L::kCtx);  // [64 keys][ROWS]: scores, then p
  int* allowed = reinterpret_cast<int*>(probs + kAttnChunk * L::kPStride);  // [T] (one token's tile)
  __shared__ int64_t slots[kAttnChunk];  // cache slot of each key of the chunk, -1 past the last
  __shared__ int row_keys[ROWS];         // keys of the chunk each row sees
  const int chunk = BlockChunk<SHARED, kBaseOnDevice>(chunk0, base, key_counts, mask);
  if (chunk < 0) return;
  // rows: SHARED, th = tile * ROWS + i; otherwise token blockIdx.y, heads blockIdx.z * ROWS + i
  const int th0 = SHARED ? blockIdx.y * ROWS : blockIdx.y * H + blockIdx.z * ROWS;
  const int rows = SHARED ? min(ROWS, T * H - th0) : min(ROWS, H - static_cast<int>(blockIdx.z) * ROWS);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const auto row_count = [&](int i) -> int64_t { return i < rows ? key_counts(th0 + i) : 0; };  // direct here (KeyCounts)
  if (ChunkKeys<ROWS, SHARED, kWarps>(mask, T, base, row_count, chunk, allowed, slots, row_keys) == 0) return;

  // Stages go through registers: a thread loads its elements of the next stage (all in flight at
  // once) while the block computes on the current one. Loading element by element into shared
  // memory serialized one L2 round trip per element: 169 us for a decode token (Nsight).
  // Phase 1 stage, [d][row] in shared memory: each warp instruction moves a block of 4 rows x 8
  // dims, lane -> (row 4 rb + lane % 4, dim 8 db + lane / 4); a warp keeps one dim block and walks
  // the row blocks. Global reads are 4 runs of 32 bytes, and the transposed stores hit 32 distinct
  // banks (strides are 4 mod 32, or 20 at 16 rows); a warp per row and a lane per dim made them
  // 4-way conflicts.
  constexpr int kDBlocks = kTileD / 8, kRowStep = kWarps / kDBlocks;  // row blocks advance by kRowStep
  constexpr int kQPerThread = ROWS / 4 / kRowStep, kKPerThread = kAttnChunk / 4 / kRowStep;
  constexpr int kCPerThread = kAttnChunk * kTileCols / kThreads;
  static_assert(kRowStep * kDBlocks == kWarps && kQPerThread * kRowStep * 4 == ROWS && kKPerThread * kRowStep * 4 == kAttnChunk && kCPerThread * kThreads == kAttnChunk * kTileCols,
                "tile loads must cover the tile");
  const int D = R + dr;
  using Bits = CacheBits<CacheT>;
  float q_next[kQPerThread];
  typename Bits::Raw k_next[kKPerThread];
  const int stage_row = 4 * (warp / kDBlocks) + (lane & 3), stage_d = 8 * (warp % kDBlocks) + (lane >> 2);  // row (or key) 4 kRowStep u + stage_row
  auto load_stage = [&](int d0) {
    const int d = d0 + stage_d;
#pragma unroll
    for (int u = 0; u < kQPerThread; ++u) {
      const int row = stage_row + 4 * kRowStep * u;
      const int64_t th = th0 + row;
      q_next[u] = row >= rows || d >= D ? 0.f : d < R ? q_lat[th * R + d] : q_pe[th * dr + d - R];
    }
#pragma unroll
    for (int u = 0; u < kKPerThread; ++u) {
      const int64_t slot = slots[stage_row + 4 * kRowStep * u];
      k_next[u] = slot < 0 || d >= D ? 0 : d < R ? Bits::Load(cache_c, slot * R + d) : Bits::Load(cache_kpe, slot * dr + d - R);
    }
  };
  auto store_stage = [&]() {
#pragma unroll
    for (int u = 0; u < kQPerThread; ++u) stage_q[stage_d * L::kQStride + stage_row + 4 * kRowStep * u] = q_next[u];
#pragma unroll
    for (int u = 0; u < kKPerThread; ++u) stage_k[stage_d * L::kKStride + stage_row + 4 * kRowStep * u] = Bits::Widen(k_next[u]);
  };
  // Phase 3 stage: column r0 + tid % kTileCols of keys tid / kTileCols + 4 u
  typename Bits::Raw c_next[kCPerThread];
  auto load_ctx = [&](int r0) {
    const int r = r0 + tid % kTileCols;
#pragma unroll
    for (int u = 0; u < kCPerThread; ++u) {
      const int64_t slot = slots[tid / kTileCols + (kThreads / kTileCols) * u];
      c_next[u] = slot < 0 || r >= R ? 0 : Bits::Load(cache_c, slot * R + r);
    }
  };

  // Phase 1: scores, RPT rows x KPT keys per thread
  const int tx = tid % L::kTx, ty = tid / L::kTx;
  float s[RPT][KPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i)
#pragma unroll
    for (int k = 0; k < KPT; ++k) s[i][k] = 0.f;
  load_stage(0);
  for (int d0 = 0; d0 < D; d0 += kTileD) {
    store_stage();
    __syncthreads();
    if (d0 + kTileD < D) load_stage(d0 + kTileD);
    AccumulateOuter<RPT, KPT, kTileD, L::kQStride, L::kKStride>(stage_q + RPT * ty, stage_k + KPT * tx, s);
    __syncthreads();
  }
  load_ctx(0);  // in flight during the softmax
#pragma unroll
  for (int i = 0; i < RPT; ++i)
#pragma unroll
    for (int k = 0; k < KPT; ++k) probs[(KPT * tx + k) * L::kPStride + RPT * ty + i] = s[i][k];
  __syncthreads();

  // Phase 2: the chunk's softmax
  ChunkSoftmax<ROWS, L::kPStride>(probs, row_keys, scale, partial, th0, max_chunks, chunk, R);

  // Phase 3: partial context, RPT rows x CPT columns per thread, one FMA chain over the keys
  for (int r0 = 0; r0 < R; r0 += kTileCols) {
#pragma unroll
    for (int u = 0; u < kCPerThread; ++u) ctx_c[(tid / kTileCols + (kThreads / kTileCols) * u) * L::kCStride + tid % kTileCols] = Bits::Widen(c_next[u]);
    __syncthreads();
    if (r0 + kTileCols < R) load_ctx(r0 + kTileCols);
    float a[RPT][CPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
      for (int c = 0; c < CPT; ++c) a[i][c] = 0.f;
    AccumulateOuter<RPT, CPT, kAttnChunk, L::kPStride, L::kCStride>(probs + RPT * ty, ctx_c + CPT * tx, a);
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int row = RPT * ty + i;
      if (row_keys[row] == 0) continue;
      float* out = partial + (static_cast<int64_t>(th0 + row) * max_chunks + chunk) * (R + 2) + 2;
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int r = r0 + CPT * tx + c;
        if (r < R) out[r] = a[i][c];
      }
    }
    __syncthreads();
  }
}

// Eight consecutive values of a bf16 or f32 tensor (kv_b's dtypes) from element i (16-byte
// aligned) as f32.
__device__ __forceinline__ void Load8AsF32(const void* p, DType t, int64_t i, float (&v)[8]) {
  if (t == DType::kF32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p) + i)), b = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p) + i) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  const uint4 q = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i));
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
}

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

// out[g][v] = W_vb[h, v] . ctx[g] for the `rows` (<= G) rows of one head (ctx [G][R], out rows
// out_stride apart) and v in [v_begin, v_end), one warp per v at a time. Each W_vb value is loaded
// once for all the rows, and each row's sum has the one-row order (a lane's FMA chain over its r,
// then the xor tree), so a row's bits do not depend on G.
template <int G>
__device__ __forceinline__ void ProjectOut(const float* ctx, int rows, const void* kv_b, DType kvb_dtype, bool vector_rows, int h, int R, int dn, int dv, int v_begin, int v_end,
                                           OutRows out, int64_t out_stride) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int v = v_begin + warp; v < v_end; v += blockDim.x / 32) {
    const int64_t row = static_cast<int64_t>(h * (dn + dv) + dn + v) * R;
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    if (vector_rows) {
      // 8 values per lane and load (16 bytes of bf16): a 512-wide row in two loads per lane
      // instead of 16 dependent 2-byte ones
      for (int r = 8 * lane; r < R; r += 256) {
        float w[8];
        Load8AsF32(kv_b, kvb_dtype, row + r, w);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g >= rows) continue;
          const float4 c0 = *reinterpret_cast<const float4*>(ctx + g * R + r), c1 = *reinterpret_cast<const float4*>(ctx + g * R + r + 4);
          const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) s[g] = fmaf(w[i], c[i], s[g]);
        }
      }
    } else {
      for (int r = lane; r < R; r += 32) {
        const float w = LoadAsF32(kv_b, kvb_dtype, row + r);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g < rows) s[g] = fmaf(w, ctx[g * R + r], s[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= rows) continue;  // rows is block-uniform
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], off);
      if (lane == 0) out.Store(g * out_stride + v, s[g]);
    }
  }
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

__global__ void __launch_bounds__(256) ProjectOutKernel(const float* ctx_in, int H, int R, const void* kv_b, DType kvb_dtype, bool vector_rows, int dn, int dv, int v_per_block,
                                                        OutRows out) {
  extern __shared__ float ctx[];  // [R]
  const int th = blockIdx.x, h = th % H;
  const int v_begin = blockIdx.y * v_per_block, v_end = min(dv, v_begin + v_per_block);
  // this block's W_vb rows (contiguous) into L2 while the merge still runs
  const int elem = kvb_dtype == DType::kF32 ? 4 : 2;
  const char* rows = static_cast<const char*>(kv_b) + static_cast<int64_t>(h * (dn + dv) + dn + v_begin) * R * elem;
  const int bytes = (v_end - v_begin) * R * elem;  // v_per_block rows
  for (int off = 128 * static_cast<int>(threadIdx.x); off < bytes; off += 128 * static_cast<int>(blockDim.x)) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rows + off) : "memory");
  }
  PdlWait();
  for (int r = threadIdx.x; r < R; r += blockDim.x) ctx[r] = ctx_in[static_cast<int64_t>(th) * R + r];
  __syncthreads();
  ProjectOut<1>(ctx, 1, kv_b, kvb_dtype, vector_rows, h, R, dn, dv, v_begin, v_end, out + static_cast<int64_t>(th) * dv, 0);
}

// Small tiles (decode, a tree node's own keys) in one round trip: the whole chunk (64 key rows of
// [c | kpe], zero past its keys) and the tile's q rows go into shared memory with cp.async, then
// scores, softmax and context all read shared memory. The staged kernel made a
// small tile ~13 dependent global round trips (9 score stages, 4 context passes) on a mostly idle
// GPU. Per row the arithmetic is AttendTileKernel's (a score is one FMA chain over d in order, a
// context value one chain over the 64 keys), so both kernels give a row the same bits.
// 512 threads; phases 1 and 3 give each thread a register tile of rows (ChunkScores,
// ChunkContext), and a 4-row decode tile still keeps 8 (phase 1) and 16 (phase 3) warps busy.
// 24 rows: 211 KB of shared memory at D = 576. Against 16 (190 KB) small verifies and decode are
// 3-8% faster, at the cost of a 65-token verify's 8-row tail no longer fitting beside a 64-row
// tile block on an SM (~2.5% slower there). A bf16 cache's chunk is half the bytes (82 KB of keys
// instead of 148 at D = 576).
struct ChunkLayout {
  static constexpr int kRows = 24, kThreads = 512, kWarps = kThreads / 32;
  static constexpr int kPStride = kRows + 4;
  // floats per q row (and per f32 key row): 16-byte runs, and rows 4 banks apart so a warp's
  // 16-byte reads of 32 consecutive key rows hit distinct banks
  __host__ __device__ static int Stride(int D) { return (D + 31) / 32 * 32 + 4; }
  // cache values per key row: bf16 rows 8 bytes apart modulo 128, so a warp's 8-byte reads of 32
  // consecutive key rows take the two wavefronts their 256 bytes need (rows 16 bytes apart, as
  // 16-byte copies would want, made them 4)
  template <typename CacheT>
  __host__ __device__ static int KeyStride(int D) { return sizeof(CacheT) == 4 ? Stride(D) : (D + 63) / 64 * 64 + 4; }
  template <typename CacheT>
  static size_t Bytes(int D, int T, bool shared) {
    return static_cast<size_t>(kAttnChunk) * KeyStride<CacheT>(D) * sizeof(CacheT) + (static_cast<size_t>(kRows) * Stride(D) + kAttnChunk * kPStride) * sizeof(float) +
           (shared ? 0 : static_cast<size_t>(T) * sizeof(int));
  }
};

// The whole-chunk kernel's phases 1 and 3 as register tiles: each (row, key) score is one FMA
// chain over d in order and each context value one chain over the 64 keys in order, as in
// AttendTileKernel, whichever thread computes it.
constexpr int kScoreGroups = ChunkLayout::kThreads / kAttnChunk;  // row groups of phase 1: 8
constexpr int kScoreRows = ChunkLayout::kRows / kScoreGroups;     // rows per thread of phase 1
static_assert(kScoreRows * kScoreGroups == ChunkLayout::kRows && kScoreRows <= 3, "phase 1: whole rows per thread cover a tile");
constexpr int kContextColThreads = 128;                           // 4 columns each: 512 per pass
constexpr int kContextGroups = ChunkLayout::kThreads / kContextColThreads;  // row groups of phase 3: 4
constexpr int kContextRows = ChunkLayout::kRows / kContextGroups;  // rows per thread of phase 3
static_assert(kContextRows * kContextGroups == ChunkLayout::kRows && kContextRows <= 6, "phase 3: whole rows per thread cover a tile");

// Scores of key `key` for rows group + 8 i, i < NR: probs[key][row].
template <int NR, typename CacheT>
__device__ __forceinline__ void ChunkScores(const float* q, int stride, const CacheT* keys, int key_stride, float* probs, int D, int key, int group) {
  const CacheT* kr = keys + key * key_stride;
  float sc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) sc[i] = 0.f;
#pragma unroll 4
  for (int d = 0; d < D; d += 4) {
    const float4 kv = CacheValues4(kr + d);
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const float4 qv = *reinterpret_cast<const float4*>(q + (group + kScoreGroups * i) * stride + d);
      sc[i] = fmaf(qv.x, kv.x, sc[i]);
      sc[i] = fmaf(qv.y, kv.y, sc[i]);
      sc[i] = fmaf(qv.z, kv.z, sc[i]);
      sc[i] = fmaf(qv.w, kv.w, sc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) probs[key * ChunkLayout::kPStride + group + kScoreGroups * i] = sc[i];
}

// Where a tile row's partial goes: [th][chunk][m, l, R context values]; rows without keys in the
// chunk store nothing.
struct PartialOut {
  float* partial;
  int th0, max_chunks, chunk, R;
  const int* row_keys;
};

// Context columns col .. col + 3 (each pass of 512) for rows group + 4 i, i < NR.
template <int NR, typename CacheT>
__device__ __forceinline__ void ChunkContext(const float* probs, const CacheT* keys, int key_stride, int R, int col, int group, const PartialOut& o) {
  for (int c0 = col; c0 < R; c0 += 4 * kContextColThreads) {
    float a[NR][4];
#pragma unroll
    for (int i = 0; i < NR; ++i) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
#pragma unroll 8
    for (int j = 0; j < kAttnChunk; ++j) {
      const float4 c = CacheValues4(keys + j * key_stride + c0);
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const float p = probs[j * ChunkLayout::kPStride + group + kContextGroups * i];
        a[i][0] = fmaf(p, c.x, a[i][0]);
        a[i][1] = fmaf(p, c.y, a[i][1]);
        a[i][2] = fmaf(p, c.z, a[i][2]);
        a[i][3] = fmaf(p, c.w, a[i][3]);
      }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int r = group + kContextGroups * i;
      if (o.row_keys[r] == 0) continue;
      float* out = o.partial + (static_cast<int64_t>(o.th0 + r) * o.max_chunks + o.chunk) * (o.R + 2) + 2;
#pragma unroll
      for (int k = 0; k < 4; ++k) out[c0 + k] = a[i][k];  // partial rows are R + 2 floats: not 16-byte aligned
    }
  }
}

template <bool SHARED, typename CacheT, bool kBaseOnDevice>
__global__ void __launch_bounds__(ChunkLayout::kThreads) AttendChunkKernel(const float* q_lat, const float* q_pe, const CacheT* cache_c, const CacheT* cache_kpe, const uint8_t* mask,
                                                                          int T, int H, int R, int dr, int64_t base, float scale, int max_chunks, int chunk0,
                                                                          KeyCounts key_counts, float* partial, int tile_rows, int row0) {
  PdlWait();
  PdlLaunchDependents();
  constexpr int ROWS = ChunkLayout::kRows, kPStride = ChunkLayout::kPStride;
  const int D = R + dr, stride = ChunkLayout::Stride(D), key_stride = ChunkLayout::KeyStride<CacheT>(D);
  extern __shared__ float4 chunk_smem[];
  CacheT* keys = reinterpret_cast<CacheT*>(chunk_smem);   // [64 keys][key_stride]: c (d < R), then kpe
  float* q = reinterpret_cast<float*>(keys + kAttnChunk * key_stride);  // [ROWS][stride]: q_lat, then q_pe
  float* probs = q + ROWS * stride;                       // [64 keys][kPStride]: scores, then p
  int* allowed = reinterpret_cast<int*>(probs + kAttnChunk * kPStride);  // [T] (one token's tile)
  __shared__ int64_t slots[kAttnChunk];
  __shared__ int row_keys[ROWS];
  const int chunk = BlockChunk<SHARED, kBaseOnDevice>(chunk0, base, key_counts, mask);
  if (chunk < 0) return;
  // rows: SHARED, th = row0 + tile * tile_rows + i; otherwise token blockIdx.y, heads blockIdx.z * tile_rows + i
  const int th0 = SHARED ? row0 + blockIdx.y * tile_rows : blockIdx.y * H + blockIdx.z * tile_rows;  // tile_rows <= ROWS
  const int rows = SHARED ? min(tile_rows, T * H - th0) : min(tile_rows, H - static_cast<int>(blockIdx.z) * tile_rows);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const auto row_count = [&](int i) -> int64_t { return i < rows ? key_counts(th0 + i) : 0; };  // direct here (KeyCounts)
  if (ChunkKeys<ROWS, SHARED, ChunkLayout::kWarps>(mask, T, base, row_count, chunk, allowed, slots, row_keys) == 0) return;

  // Pieces of 4 values (D, R and dr are multiples of 4) of the key rows (16 bytes of f32, 8 of
  // bf16), then of the tile's q rows, a warp per row (no index division per piece); key rows past
  // the chunk's keys are zero-filled (source size 0): the context chains run over all 64 keys
  for (int r = warp; r < kAttnChunk + rows; r += ChunkLayout::kWarps) {
    if (r < kAttnChunk) {
      const int64_t slot = slots[r];
      const bool valid = slot >= 0;
      const CacheT* c_row = valid ? cache_c + slot * R : cache_c;
      const CacheT* pe_row = valid ? cache_kpe + slot * dr : cache_kpe;
      CacheT* dst = keys + r * key_stride;
      for (int d = 4 * lane; d < D; d += 4 * 32) {
        const CacheT* src = !valid ? cache_c : d < R ? c_row + d : pe_row + d - R;
        const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(dst + d));
        if constexpr (sizeof(CacheT) == 4) {
          CopyAsync16ZeroFill(to, src, valid ? 16 : 0);
        } else {
          CopyAsync8ZeroFill(to, src, valid ? 8 : 0);
        }
      }
    } else {
      const int64_t th = th0 + r - kAttnChunk;
      const float *c_row = q_lat + th * R, *pe_row = q_pe + th * dr;
      float* dst = q + (r - kAttnChunk) * stride;
      for (int d = 4 * lane; d < D; d += 4 * 32) CopyAsync16ZeroFill(static_cast<uint32_t>(__cvta_generic_to_shared(dst + d)), d < R ? c_row + d : pe_row + d - R, 16);
    }
  }
  CopyAsyncWaitAll();
  __syncthreads();

  // Phase 1: scores. Thread (key tid % 64, row group tid / 64) takes rows g, g + 8, g + 16 of the
  // tile: a warp reads 32 key rows and broadcasts its rows' q, and each key value it loads serves
  // all of them (a lane per (row, key) read every key row once per row: 2.4 MB of shared memory for a
  // 16-row tile, the phase's bound).
  {
    const int key = tid % kAttnChunk, group = tid / kAttnChunk;
    const int mine = rows > group ? (rows - group + kScoreGroups - 1) / kScoreGroups : 0;  // warp-uniform
    switch (mine) {
      case 3: if constexpr (kScoreRows >= 3) ChunkScores<3>(q, stride, keys, key_stride, probs, D, key, group); break;
      case 2: ChunkScores<2>(q, stride, keys, key_stride, probs, D, key, group); break;
      case 1: ChunkScores<1>(q, stride, keys, key_stride, probs, D, key, group); break;
      default: break;
    }
  }
  __syncthreads();

  // Phase 2: the chunk's softmax, a warp per row: the max and the exponentials in parallel (exact
  // in any order), the sum in key order by one lane, as ChunkSoftmax does
  for (int r = warp; r < rows; r += ChunkLayout::kWarps) {
    const int n = row_keys[r];
    const float s0 = probs[lane * kPStride + r], s1 = probs[(lane + 32) * kPStride + r];
    float m = fmaxf(lane < n ? ScaledScore(s0, scale) : -INFINITY, lane + 32 < n ? ScaledScore(s1, scale) : -INFINITY);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    probs[lane * kPStride + r] = lane < n ? KeyWeight(s0, scale, m) : 0.f;
    probs[(lane + 32) * kPStride + r] = lane + 32 < n ? KeyWeight(s1, scale, m) : 0.f;
    __syncwarp();
    if (lane == 0 && n > 0) {
      float l = 0.f;
#pragma unroll 16
      for (int j = 0; j < kAttnChunk; ++j) l += probs[j * kPStride + r];
      float* out = partial + (static_cast<int64_t>(th0 + r) * max_chunks + chunk) * (R + 2);
      out[0] = m;
      out[1] = l;
    }
  }
  __syncthreads();

  // Phase 3: partial context. Thread (4 columns from 4 (tid % 128), row group tid / 128) takes
  // rows g, g + 4, ..., g + 20 of the tile, each column value it loads serving all of them.
  {
    const int col = 4 * (tid % kContextColThreads), group = tid / kContextColThreads;
    const int mine = rows > group ? (rows - group + kContextGroups - 1) / kContextGroups : 0;  // warp-uniform
    const PartialOut out{partial, th0, max_chunks, chunk, R, row_keys};
    switch (mine) {
      case 6: if constexpr (kContextRows >= 6) ChunkContext<6>(probs, keys, key_stride, R, col, group, out); break;
      case 5: if constexpr (kContextRows >= 5) ChunkContext<5>(probs, keys, key_stride, R, col, group, out); break;
      case 4: ChunkContext<4>(probs, keys, key_stride, R, col, group, out); break;
      case 3: ChunkContext<3>(probs, keys, key_stride, R, col, group, out); break;
      case 2: ChunkContext<2>(probs, keys, key_stride, R, col, group, out); break;
      case 1: ChunkContext<1>(probs, keys, key_stride, R, col, group, out); break;
      default: break;
    }
  }
}

template <typename CacheT>
struct AttendArgs {
  const float *q_lat, *q_pe;
  const CacheT *cache_c, *cache_kpe;
  const uint8_t* mask;
  int T, H, R, dr;
  int64_t base;
  float scale;
  int max_chunks;
  KeyCounts key_counts;
  float* partial;
};

template <int ROWS, bool SHARED, typename CacheT>
Status LaunchAttendTile(const AttendArgs<CacheT>& a, dim3 grid, int chunk0, cudaStream_t s) {
  const size_t smem = TileLayout<ROWS>::Bytes(a.T, SHARED);
  if (smem > 200 * 1024) return Unsupported("mla_attention: ", a.T, " new tokens with a mask need more shared memory than a block has; split the call");
  const auto kernel = a.key_counts.base_on_device ? AttendTileKernel<ROWS, SHARED, CacheT, true> : AttendTileKernel<ROWS, SHARED, CacheT, false>;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "mla attend: shared memory"));
  return LaunchPdl("mla attend", kernel, grid, dim3(TileLayout<ROWS>::kThreads), smem, s, a.q_lat, a.q_pe, a.cache_c, a.cache_kpe, a.mask, a.T, a.H, a.R, a.dr,
                   a.base, a.scale, a.max_chunks, chunk0, a.key_counts, a.partial);
}

// Whether the whole-chunk kernel can take a small tile: the chunk and the tile's q rows fit in
// shared memory and every row can be copied in pieces of 4 values.
template <typename CacheT>
bool WholeChunkFits(const AttendArgs<CacheT>& a, bool shared) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return ChunkLayout::Bytes<CacheT>(a.R + a.dr, a.T, shared) <= 227 * 1024 && a.R % 4 == 0 && a.dr % 4 == 0 && aligned(a.q_lat) && aligned(a.q_pe) && aligned(a.cache_c) &&
         aligned(a.cache_kpe);
}

// Small tiles (<= 24 rows: one token's heads, a decode's tokens, or the rows of a tree verify of up
// to kSmallTilesMaxRows; SHARED: rows [row0, T H)) take AttendChunkKernel when the whole chunk fits
// in shared memory and its rows can be copied in pieces of 4 values; otherwise the staged kernel. A decode is one tile per chunk: 65 blocks at 4K keys
// on a 132-SM GPU, each bound by its shared-memory reads. Rows are independent, so while the
// blocks would still fit one per SM the tile is cut in halves (down to 4 rows): twice the blocks,
// each reading the chunk once for half the rows.
template <bool SHARED, typename CacheT>
Status LaunchSmallTile(const AttendArgs<CacheT>& a, int chunks, int chunk0, int sms, cudaStream_t s, int row0 = 0) {
  const int rows = SHARED ? a.T * a.H - row0 : a.H, tokens = SHARED ? 1 : a.T;
  const auto grid = [&](int tile_rows) { return SHARED ? dim3(chunks, (rows + tile_rows - 1) / tile_rows) : dim3(chunks, tokens, (rows + tile_rows - 1) / tile_rows); };
  const size_t smem = ChunkLayout::Bytes<CacheT>(a.R + a.dr, a.T, SHARED);
  if (!WholeChunkFits(a, SHARED)) return LaunchAttendTile<16, SHARED>(a, grid(16), chunk0, s);  // row0 = 0 here (SmallTileTail)
  int tile_rows = rows <= 16 ? 16 : ChunkLayout::kRows;  // a decode's 8 rows: halves of 16
  const auto blocks = [&](int tr) { return static_cast<int64_t>(chunks) * tokens * ((rows + tr - 1) / tr); };
  while (tile_rows > 4 && blocks(tile_rows / 2) <= sms) tile_rows /= 2;
  const auto kernel = a.key_counts.base_on_device ? AttendChunkKernel<SHARED, CacheT, true> : AttendChunkKernel<SHARED, CacheT, false>;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "mla attend: shared memory"));
  return LaunchPdl("mla attend (whole chunk)", kernel, grid(tile_rows), dim3(ChunkLayout::kThreads), smem, s, a.q_lat, a.q_pe, a.cache_c, a.cache_kpe, a.mask, a.T,
                   a.H, a.R, a.dr, a.base, a.scale, a.max_chunks, chunk0, a.key_counts, a.partial, tile_rows, row0);
}

// Whether SHARED rows past the last whole 64-row tile go to the small-tile kernel: a 65-node tree
// verify has 520 rows, and a ninth 64-row tile for its last 8 would cost as much as a full one.
template <typename CacheT>
bool SmallTileTail(const AttendArgs<CacheT>& a) {
  const int tail = a.T * a.H % 64;
  return a.T * a.H > 64 && tail > 0 && tail <= ChunkLayout::kRows && WholeChunkFits(a, true);
}

// The attention of every row over its chunks: causal, every chunk is shared by all rows; with a
// mask, the chunks inside the committed prefix are (the first shared_chunks) and the next
// token_chunks are looked up per token.
template <typename CacheT>
Status LaunchAttend(const AttendArgs<CacheT>& args, int shared_chunks, int token_chunks, int sms, cudaStream_t s) {
  const int T = args.T, H = args.H;
  if (shared_chunks > 0) {
    // rows [0, tiled) in 64-row tiles, the rest (a tail of at most 24, or all of up to
    // kSmallTilesMaxRows) in small tiles
    const int rows = T * H, tiled = rows <= kSmallTilesMaxRows ? 0 : SmallTileTail(args) ? rows / 64 * 64 : rows;
    if (tiled > 0) KDTREE_RETURN_IF_ERROR((LaunchAttendTile<64, true>(args, dim3(shared_chunks, (tiled + 63) / 64), 0, s)));
    if (tiled < rows) KDTREE_RETURN_IF_ERROR(LaunchSmallTile<true>(args, shared_chunks, 0, sms, s, tiled));
  }
  if (token_chunks > 0) {
    const Status st = H <= ChunkLayout::kRows ? LaunchSmallTile<false>(args, token_chunks, shared_chunks, sms, s)
                              : LaunchAttendTile<64, false>(args, dim3(token_chunks, T, (H + 63) / 64), shared_chunks, s);
    KDTREE_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

}  // namespace

Status LaunchMlaAttention(const MlaAttentionArgs& a, cudaStream_t s, Scratch& scratch, int sms) {
  const int T = static_cast<int>(a.q_nope.dim(0)), H = static_cast<int>(a.q_nope.dim(1)), dn = static_cast<int>(a.q_nope.dim(2));
  const int dr = static_cast<int>(a.q_pe.dim(2)), R = static_cast<int>(a.cache_c.dim(1)), dv = static_cast<int>(a.out.dim(2));
  const int max_chunks = static_cast<int>((a.base + T + kAttnChunk - 1) / kAttnChunk);
  // every call with this kv_b takes the same projection: rows keep their bits
  const bool project_mma = mla::ProjectMmaFits(a.kv_b.data, a.kv_b.dtype, R);
  const int ctx_stride = project_mma ? R + 4 : R;  // floats per ctx row in the merge's shared memory
  if ((static_cast<size_t>(ctx_stride) + max_chunks) * 4 > 48 * 1024) return Unsupported("mla_attention: ", a.base + T, " keys need more chunk weights than the merge keeps in shared memory (", (48 * 1024 / 4 - ctx_stride) * kAttnChunk, " at most)");
  // scratch: q_lat f32 [T * H, R], ctx f32 [T * H, R] (the two-kernel merge; on 16 bytes where R is
  // a multiple of 4, as the tensor-core projection reads it), partial f32 [T * H, max_chunks, R + 2],
  // key counts i64 [T * H] (KeyCounts)
  const size_t q_lat_floats = static_cast<size_t>(T) * H * R, partial_floats = static_cast<size_t>(T) * H * max_chunks * (R + 2);
  const size_t floats_bytes = (2 * q_lat_floats + partial_floats) * sizeof(float), counts_offset = (floats_bytes + 255) / 256 * 256;
  const uint8_t* mask = a.mask.present() ? a.mask.as<const uint8_t>() : nullptr;
  mla::AttendMmaArgs mma{nullptr, a.q_pe.as<const float>(), nullptr, nullptr, mask, T, H, R, dr, a.base, static_cast<float>(a.scale), max_chunks, {}, nullptr};
  bool tensor_cores = false;
  if (a.cache_c.dtype == DType::kBF16) {
    mma.cache_c = a.cache_c.as<const __nv_bfloat16>();
    mma.cache_kpe = a.cache_kpe.as<const __nv_bfloat16>();
    tensor_cores = mla::AttendMmaFits(mma);
  }
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(counts_offset + (mask && !tensor_cores ? static_cast<size_t>(T) * H * sizeof(int64_t) : 0), s));
  float* q_lat = static_cast<float*>(scratch.ptr);
  float* ctx = q_lat + q_lat_floats;
  float* partial = ctx + q_lat_floats;
  // counted by a kernel only with a mask on the CUDA-core path
  int64_t* counts = mask && !tensor_cores ? reinterpret_cast<int64_t*>(static_cast<char*>(scratch.ptr) + counts_offset) : nullptr;
  const int32_t* base_on_device = OnDevice(a.base_on_device);
  const KeyCounts key_counts{counts, mask, T, H, a.base, base_on_device};
  if (mla::QLatentMmaFits(a.kv_b.data, a.kv_b.dtype, a.q_nope.as<const float>(), dn, R)) {
    KDTREE_RETURN_IF_ERROR(mla::LaunchQLatentMma(a.q_nope.as<const float>(), static_cast<const __nv_bfloat16*>(a.kv_b.data), T, H, dn, dv, R, q_lat, s));
  } else {
    KDTREE_RETURN_IF_ERROR(LaunchPdl("mla q_latent", QLatentKernel, dim3(H, (R + kQLatR - 1) / kQLatR, (T + kQLatTokens - 1) / kQLatTokens), dim3(kQLatR * kQLatSplit), 0, s,
                                   a.q_nope.as<const float>(), static_cast<const void*>(a.kv_b.data), a.kv_b.dtype, T, H, dn, dv, R, q_lat));
  }
  if (counts) KDTREE_RETURN_IF_ERROR(LaunchPdl("mla key counts", KeyCountKernel, dim3((T + 7) / 8), dim3(256), 0, s, mask, T, H, a.base, base_on_device, counts));
  // Causal, every chunk is shared by all rows. With a mask the committed prefix's chunks are, and
  // the chunks from the committed slots' one are looked up per token: with the committed slots on
  // the device, as many as T new keys can touch from any start (the kernels find where they begin).
  const int shared_chunks = mask ? static_cast<int>(a.base / kAttnChunk) : max_chunks;
  const int token_chunks = !mask ? 0 : base_on_device ? std::min(max_chunks, (T + kAttnChunk - 1) / kAttnChunk + 1) : max_chunks - shared_chunks;
  if (tensor_cores) {  // every call on this cache takes the same path: rows keep their bits
    mma.q_lat = q_lat;
    mma.key_counts = key_counts;
    mma.partial = partial;
    KDTREE_RETURN_IF_ERROR(mla::LaunchAttendMma(mma, shared_chunks, token_chunks, sms, s));
  } else if (a.cache_c.dtype == DType::kBF16) {
    const AttendArgs<__nv_bfloat16> args{q_lat, a.q_pe.as<const float>(), a.cache_c.as<const __nv_bfloat16>(), a.cache_kpe.as<const __nv_bfloat16>(), mask, T, H, R, dr, a.base,
                                         static_cast<float>(a.scale), max_chunks, key_counts, partial};
    KDTREE_RETURN_IF_ERROR(LaunchAttend(args, shared_chunks, token_chunks, sms, s));
  } else {
    const AttendArgs<float> args{q_lat, a.q_pe.as<const float>(), a.cache_c.as<const float>(), a.cache_kpe.as<const float>(), mask, T, H, R, dr, a.base, static_cast<float>(a.scale),
                                 max_chunks, key_counts, partial};
    KDTREE_RETURN_IF_ERROR(LaunchAttend(args, shared_chunks, token_chunks, sms, s));
  }
  // kv_b rows read 8 values per load when every row starts on 16 bytes
  const bool vector_rows = R % 8 == 0 && reinterpret_cast<uintptr_t>(a.kv_b.data) % 16 == 0;
  const OutRows out{a.out.data, a.out.dtype};
  const size_t weight_bytes = static_cast<size_t>(max_chunks) * sizeof(float);
  if (T * H >= kCombineAloneRows) {
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
                       static_cast<const void*>(a.kv_b.data), a.kv_b.dtype, vector_rows, dn, dv, out);
    };
    if (project_mma) {
      return G == 8 ? launch(CombineOutKernel<8, true>) : G == 4 ? launch(CombineOutKernel<4, true>) : G == 2 ? launch(CombineOutKernel<2, true>) : launch(CombineOutKernel<1, true>);
    }
    return G == 8 ? launch(CombineOutKernel<8, false>) : G == 4 ? launch(CombineOutKernel<4, false>) : G == 2 ? launch(CombineOutKernel<2, false>) : launch(CombineOutKernel<1, false>);
  }
  KDTREE_RETURN_IF_ERROR(LaunchPdl("mla combine", CombineContextKernel, dim3(T * H, (R + kContextCols - 1) / kContextCols), dim3(kContextCols), weight_bytes, s,
                                   static_cast<const float*>(partial), key_counts, max_chunks, R, ctx));
  if (project_mma) return mla::LaunchProjectOutMma(ctx, static_cast<const __nv_bfloat16*>(a.kv_b.data), T, H, R, dn, dv, out, s);
  return LaunchPdl("mla out projection", ProjectOutKernel, dim3(T * H, (dv + kOutVPerBlock - 1) / kOutVPerBlock), dim3(256), R * sizeof(float), s, static_cast<const float*>(ctx), H, R,
                   static_cast<const void*>(a.kv_b.data), a.kv_b.dtype, vector_rows, dn, dv, kOutVPerBlock, out);
}

}  // namespace cuda
}  // namespace kdtree
