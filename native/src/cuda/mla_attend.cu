// Stage 2 of MLA attention, the attend, on CUDA cores (f32 or bf16 cache):
//   q_lat f32 [T H, R], q_pe f32 [T H, dr], cache_c [slots, R], cache_kpe [slots, dr], mask [T, T]
//   -> partial f32 [T H, max_chunks, R + 2]: per (row, chunk of 64 keys) the chunk's softmax max m,
//      its sum l and the R values of its unnormalised context (mla_merge.cu combines them).
// A block per (chunk, tile of token-head rows), flash-decoding style, so a 4096-key decode fills
// the GPU instead of running H blocks. Two kernels: the staged tile (AttendTileKernel, 16 or 64
// rows, keys and q through shared memory in stages) and the whole chunk (AttendChunkKernel, up to
// 24 rows, the chunk copied in one round trip); LaunchAttend picks by rows, and a row gets the same
// bits from either. A masked call's key counts come first (LaunchKeyCounts). A bf16 cache whose
// rows are whole 8-byte pieces takes the tensor-core form instead (mla_attend_mma.cu).
#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace {

using namespace mla;

// Up to this many rows over the committed prefix (a tree verify of up to 34 tokens at 8 heads) the
// 24-row whole-chunk tiles are at least as fast as the 64-row staged ones (a 9-token verify ~1.4x
// faster, 33 tokens even); above it they are slower (65 tokens ~1.2x).
constexpr int kSmallTilesMaxRows = 272;

// The latent cache holds f32 or bf16 values (CacheT): a bf16 cache is half the bytes to keep and
// to read per key. A bf16 cache whose rows are whole 8-byte pieces runs on tensor cores
// (mla_attend_mma.cu); the CUDA-core kernels below take the rest, widening cache values to f32
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
  if (ChunkKeys<ROWS, SHARED, kWarps>(mask, T, blockIdx.y, base, row_count, chunk, allowed, slots, row_keys) == 0) return;

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
  if (ChunkKeys<ROWS, SHARED, ChunkLayout::kWarps>(mask, T, blockIdx.y, base, row_count, chunk, allowed, slots, row_keys) == 0) return;

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

}  // namespace

namespace mla {

Status LaunchKeyCounts(const uint8_t* mask, int T, int H, int64_t base, const int32_t* base_on_device, int64_t* counts, cudaStream_t s) {
  return LaunchPdl("mla key counts", KeyCountKernel, dim3((T + 7) / 8), dim3(256), 0, s, mask, T, H, base, base_on_device, counts);
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

template Status LaunchAttend<float>(const AttendArgs<float>&, int, int, int, cudaStream_t);
template Status LaunchAttend<__nv_bfloat16>(const AttendArgs<__nv_bfloat16>&, int, int, int, cudaStream_t);

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
