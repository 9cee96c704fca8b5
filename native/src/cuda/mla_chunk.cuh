// What the MLA attend kernels share (mla_attend.cu: CUDA cores, f32 or bf16 cache;
// mla_attend_mma.cu: tensor cores, bf16 cache) and the merge reads: the chunking of a row's key
// list, its key count, the keys of a chunk, and the softmax's roundings. Every kernel cuts a row's
// keys at the same places and rounds a score the same way, so the merge (mla_merge.cu) takes any
// kernel's partials.
#pragma once
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace mla {

constexpr int kAttnChunk = 64;  // keys per chunk: a token's key list is cut into fixed chunks of 64

// The keys token-head row th (token th / H) sees: the `base` committed slots and the new tokens
// its mask row allows. Causal (no mask: decode, prefill) that is base + t + 1. With a mask the
// CUDA-core path counts them in a kernel of its own (`counts`: its attention kernels read them
// directly); the tensor-core path counts a tile's rows in the attention kernel and a row's in the
// merge, so no counting kernel sits between a call's q absorption and its attention (a launch
// less in the dependent chain).
struct KeyCounts {
  const int64_t* counts;  // [T H], or null: causal, or counted from the mask
  const uint8_t* mask;    // [T, T], or null: causal
  int T, H;
  int64_t base;
  const int32_t* base_on_device;  // or null: `base` is the committed slots
  // Every kernel of a call calls it once, after PdlWait: the committed slots read on the device,
  // clamped to [0, base] (the host's base bounds them: the grid and the partials are sized for it).
  __device__ void Resolve() {
    if (base_on_device) base = min(max(static_cast<int64_t>(*base_on_device), int64_t{0}), base);
    base_on_device = nullptr;
  }
  // Whether a single thread can take a count (counted already, or causal).
  __device__ bool Direct() const { return counts != nullptr || mask == nullptr; }
  __device__ int64_t operator()(int th) const { return counts ? counts[th] : base + th / H + 1; }
  // Any form; a whole warp calls it and every lane gets the count.
  __device__ int64_t Warp(int th) const {
    if (Direct()) return (*this)(th);
    const int t = th / H, lane = threadIdx.x & 31;
    int count = 0;
    for (int j0 = 0; j0 < T; j0 += 32) {
      const int j = j0 + lane;
      count += __popc(__ballot_sync(0xffffffffu, j < T && mask[static_cast<int64_t>(t) * T + j] != 0));
    }
    return base + count;
  }
};

// The key counts of a tile's rows (row_th(i): token-head row, or -1: none) into shared memory, for
// a kernel that may count from the mask: a thread per row where counts are direct, else a warp per
// row. Every thread of the block calls it.
template <int ROWS, int kWarps, typename RowTh>
__device__ void TileKeyCounts(KeyCounts key_counts, RowTh row_th, int64_t* tile_counts) {
  if (key_counts.Direct()) {
    for (int i = threadIdx.x; i < ROWS; i += blockDim.x) {
      const int th = row_th(i);
      tile_counts[i] = th >= 0 ? key_counts(th) : 0;
    }
  } else {
    for (int i = threadIdx.x >> 5; i < ROWS; i += kWarps) {
      const int th = row_th(i);
      const int64_t n = th >= 0 ? key_counts.Warp(th) : 0;
      if ((threadIdx.x & 31) == 0) tile_counts[i] = n;
    }
  }
  __syncthreads();
}

// The chunk's keys for a tile of rows: slots[j] = the cache slot of key j of the chunk (-1 past
// the longest row's last), row_keys[i] = how many of them row i sees (row_count(i): its key count,
// 0 for no row); returns the most any row sees (0: the tile has nothing to do here, e.g.
// causal prefill's upper triangle). Without SHARED
// the tile is the heads of token `t` and `allowed` (shared memory, [T]) receives the new tokens its
// mask row allows, in order. Every thread of the block must call it.
template <int ROWS, bool SHARED, int kWarps, typename RowCount>
__device__ int ChunkKeys(const uint8_t* mask, int T, int t, int64_t base, RowCount row_count, int chunk, int* allowed, int64_t* slots, int* row_keys) {
  __shared__ int warp_counts[kWarps];
  __shared__ int max_keys;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t k_begin = static_cast<int64_t>(chunk) * kAttnChunk;
  if (tid == 0) max_keys = 0;
  if constexpr (!SHARED) {
    // ordered compaction of the new tokens this token sees (ballot + prefix over warps)
    int count = 0;
    for (int j0 = 0; j0 < T; j0 += kWarps * 32) {
      const int j = j0 + tid;
      const bool ok = j < T && mask[static_cast<int64_t>(t) * T + j] != 0;
      const unsigned bal = __ballot_sync(0xffffffffu, ok);
      if (lane == 0) warp_counts[warp] = __popc(bal);
      __syncthreads();
      int before = count;
      for (int w = 0; w < warp; ++w) before += warp_counts[w];
      if (ok) allowed[before + __popc(bal & ((1u << lane) - 1))] = j;
      for (int w = 0; w < kWarps; ++w) count += warp_counts[w];
      __syncthreads();
    }
  }
  __syncthreads();
  if (tid < ROWS) {
    const int64_t left = row_count(tid) - k_begin;
    const int n = left <= 0 ? 0 : left >= kAttnChunk ? kAttnChunk : static_cast<int>(left);
    row_keys[tid] = n;
    atomicMax(&max_keys, n);
  }
  __syncthreads();
  const int n_max = max_keys;
  if (n_max > 0 && tid < kAttnChunk) {
    const int64_t key = k_begin + tid;
    slots[tid] = tid >= n_max ? -1 : SHARED || key < base ? key : base + allowed[key - base];
  }
  __syncthreads();
  return n_max;
}

// A key's scaled score and its exponent, with explicit roundings: both softmax forms must give the
// same bits, and a plain s * scale - m may or may not be contracted into one FMA.
__device__ __forceinline__ float ScaledScore(float s, float scale) { return __fmul_rn(s, scale); }
__device__ __forceinline__ float KeyWeight(float s, float scale, float m) { return expf(__fsub_rn(ScaledScore(s, scale), m)); }

// The chunks a kernel of one call takes: SHARED kernels (grid.x from chunk0) stop where the
// committed prefix ends when a mask picks the new keys; per-token kernels start there, at the
// committed slots' chunk. Both read `base` as resolved on the device, so a graph captured with a
// bound serves any committed length up to it; host calls launch exactly these ranges.
template <bool SHARED>
__device__ __forceinline__ int2 CallChunks(int chunk0, int chunk_end, int64_t base, const uint8_t* mask) {
  if constexpr (SHARED) return make_int2(chunk0, mask ? min(chunk_end, static_cast<int>(base / kAttnChunk)) : chunk_end);
  const int first = static_cast<int>(base / kAttnChunk);
  return make_int2(first, first + (chunk_end - chunk0));
}

// The chunk of a kernel that takes one per block (or -1: none). With the committed slots on the
// device (kBaseOnDevice) it resolves them first, into `base` and the key counts; host calls take
// chunk0 + blockIdx.x as launched, with no resolve in their kernels (the resolve slows the f32
// verify kernels by ~1 us).
template <bool SHARED, bool kBaseOnDevice>
__device__ __forceinline__ int BlockChunk(int chunk0, int64_t& base, KeyCounts& key_counts, const uint8_t* mask) {
  if constexpr (!kBaseOnDevice) {
    return chunk0 + static_cast<int>(blockIdx.x);
  } else {
    key_counts.Resolve();
    base = key_counts.base;
    const int2 chunks = CallChunks<SHARED>(chunk0, chunk0 + static_cast<int>(gridDim.x), base, mask);
    const int chunk = chunks.x + static_cast<int>(blockIdx.x);
    return chunk < chunks.y ? chunk : -1;
  }
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
