// Stage 2 of MLA attention, the attend, on tensor cores, for a bf16 latent cache: the chunks'
// partials [T H, max_chunks, R + 2] as the CUDA-core kernels write them (mla_attend.cu; what they
// share is in mla_chunk.cuh), so the merge (mla_merge.cu) takes either's.
//
// Why: the CUDA-core tiles run a tree verify far below the memory floor, as f32 FMA chains of
// D = R + dr per score and 64 keys per context value. A bf16 cache value is an exact bf16 operand;
// q and p are f32, split into three bf16 planes (hi + mid + lo = the value to 24 bits,
// SplitPair), so every product is exact and the MMA's f32 sums are the only roundings (the W4A16
// kernel's f32 activations work the same way).
//  * scores^T [64 keys, rows] = keys [64, D] . q^T: keys on the 16-row side of mma.m16n8k16
//    (ldmatrix from the chunk in shared memory), token-head rows on the 8-wide side, their
//    fragments split by each block into shared memory once (SplitTileQ).
//  * ctx^T [R, rows] = c^T [R, 64 keys] . p^T: the chunk's c rows transposed by ldmatrix.trans,
//    p split into planes in shared memory by the softmax.
// Batch invariance: an MMA column's sums depend only on its own operands, and every (key, row)
// score and (dim, row) context value is one fixed sequence of MMAs whatever the tile (D cut in two
// halves, each summed in two chains by slice parity, added in one order; the context one chain over
// the 4 key slices), as is a row's softmax. So a row's bits depend only on the keys it sees: tree
// verify equals decoding, and the tile size is a free choice (TileGroups).
// Rows are slots t Hp + h, Hp = H rounded up to 8, so a token's heads start an 8-row column group
// and a tree token's tile (its heads, keys looked up through its mask row) holds no other token.
// On one Kimi K2 rank (8 heads over 4096 slots) it is ~1.5x faster than the CUDA-core kernels on
// the same bf16 cache for a 65-node tree verify (docs/benchmarks/cuda.md). What bounds it is
// per-chunk work besides the MMAs: ~1300 instructions per warp and chunk (the key copy's address
// arithmetic, the softmax, the stores), with a 16-row tile sharing each chunk's shared-memory
// reads; a copy per chunk of the q fragments (no double buffer, 32-row tiles) was slower.
#include <algorithm>

#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace mla {
namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kPlanes = 3;  // bf16 planes of an f32 operand: lo, mid, hi (summed smallest first)

__host__ __device__ inline int PaddedHeads(int H) { return (H + 7) / 8 * 8; }
__host__ __device__ inline int PaddedDims(int D) { return (D + 15) / 16 * 16; }

// Shared memory of a block (a tile of 8 NT rows over a range of chunks): two buffers of a chunk's
// 64 key rows ([c | kpe], zero to Dp; the next chunk's copy lands in one while the block computes
// on the other), the tile's q fragments (copied once), the scores (two D halves, [row][key]) and
// the p planes ([plane][row][key]). Key rows are Dp + 8 bf16 apart and p rows 72: an odd multiple
// of 16 bytes, so the 8 rows an ldmatrix reads hit distinct banks.
template <int NT>
struct MmaLayout {
  static constexpr int kRows = 8 * NT;
  static constexpr int kScoreStride = kAttnChunk + 4;  // f32: a warp's reads of one row are one wavefront
  static constexpr int kPStride = kAttnChunk + 8;      // bf16
  __host__ __device__ static int KeyStride(int Dp) { return Dp + 8; }
  __host__ __device__ static size_t KeyBytes(int Dp) { return static_cast<size_t>(kAttnChunk) * KeyStride(Dp) * 2; }
  __host__ __device__ static size_t QBytes(int slices) { return static_cast<size_t>(NT) * slices * kPlanes * 32 * sizeof(uint2); }
  static constexpr size_t kScoreBytes = 2 * kRows * kScoreStride * sizeof(float), kPBytes = kPlanes * kRows * kPStride * 2;
  static size_t Bytes(int Dp, int T, bool shared) { return 2 * KeyBytes(Dp) + QBytes(Dp / 16) + kScoreBytes + kPBytes + (shared ? 0 : static_cast<size_t>(T) * sizeof(int)); }
};

// q as the B operands of m16n8k16 in shared memory, one 8-row column group at a time:
// q[((nt * slices + slice) * 3 + plane) * 32 + lane] = plane `plane` (lo, mid, hi) of slot
// slot0 + 8 nt + lane / 4, dims 16 slice + 2 (lane % 4) + {0, 1} (.x) and + {8, 9} (.y); [q_lat |
// q_pe], zero past D and for the slots past a token's heads or the last token. Each block splits
// its tile's rows itself (a decode's 65 blocks each the same 8 rows: 18 KB of f32 reads), which
// keeps a kernel out of the chain between the q absorption and the attention.
__device__ __forceinline__ void SplitTileQ(const float* q_lat, const float* q_pe, int T, int H, int Hp, int R, int dr, int slices, int slot0, int groups, uint2* q) {
  const int D = R + dr;
  for (int i = threadIdx.x; i < groups * slices * 32; i += blockDim.x) {  // (nt, slice, lane)
    const int lane = i % 32, ns = i / 32, slice = ns % slices, nt = ns / slices;
    const int slot = slot0 + 8 * nt + lane / 4, t = slot / Hp, h = slot % Hp;
    const bool row = t < T && h < H;
    const int64_t th = static_cast<int64_t>(t) * H + h;
    const int d0 = 16 * slice + 2 * (lane % 4);
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int d = d0 + (k & 1) + 8 * (k >> 1);
      v[k] = !row || d >= D ? 0.f : d < R ? q_lat[th * R + d] : q_pe[th * dr + d - R];
    }
    const Bf16Planes a = SplitPair(v[0], v[1]), b = SplitPair(v[2], v[3]);
    uint2* out = q + ns * kPlanes * 32 + lane;
    out[0] = make_uint2(a.lo, b.lo);
    out[32] = make_uint2(a.mid, b.mid);
    out[64] = make_uint2(a.hi, b.hi);
  }
}

// The rows of a tile: slots slot0 .. slot0 + 8 NT - 1 -> token-head rows (-1 past a token's heads
// or the last token).
struct SlotRows {
  int slot0, T, H, Hp;
  __device__ int operator()(int i) const {
    const int s = slot0 + i, t = s / Hp, h = s % Hp;
    return t < T && h < H ? t * H + h : -1;
  }
};

// One score slice of a warp's 16 keys for its column groups nt0, nt0 + 2, ...: the three planes of
// q, smallest first, into the chains `acc`. (A chain per plane is slower.)
template <int NT>
__device__ __forceinline__ void ScoreSlice(uint32_t keys_addr, const uint2* q, int nt0, int slice, int slices, float (&acc)[(NT + 1) / 2][4]) {
  uint32_t a[4];
  LoadMatrixX4(a, keys_addr + slice * 32);
#pragma unroll
  for (int j = 0; j < (NT + 1) / 2; ++j) {
    const int nt = nt0 + 2 * j;
    if (nt >= NT) break;  // NT = 1: the odd warps have none
    const uint2* b = q + (nt * slices + slice) * kPlanes * 32;  // q: this lane's fragments
#pragma unroll
    for (int pl = 0; pl < kPlanes; ++pl) {
      const uint2 v = b[pl * 32];
      MmaBf16(acc[j], a, v.x, v.y);
    }
  }
}

// A chunk's key rows into a key buffer: rows past its keys zero-filled, the dims D .. Dp left as
// they are (zero). Pieces of 8 values (16 bytes) when R and dr allow (`wide`), else 4.
__device__ __forceinline__ void CopyKeys(__nv_bfloat16* dst, const int64_t* slots, const __nv_bfloat16* cache_c, const __nv_bfloat16* cache_kpe, int R, int dr, int key_stride, bool wide) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, D = R + dr;
  for (int r = warp; r < kAttnChunk; r += kWarps) {
    const int64_t slot = slots[r];
    const bool valid = slot >= 0;
    const __nv_bfloat16 *c_row = cache_c + (valid ? slot * R : 0), *pe_row = cache_kpe + (valid ? slot * dr : 0);
    const uint32_t row = static_cast<uint32_t>(__cvta_generic_to_shared(dst + r * key_stride));
    if (wide) {
      for (int d = 8 * lane; d < D; d += 8 * 32) CopyAsync16ZeroFill(row + 2 * d, d < R ? c_row + d : pe_row + d - R, valid ? 16 : 0);
    } else {
      for (int d = 4 * lane; d < D; d += 4 * 32) CopyAsync8ZeroFill(row + 2 * d, d < R ? c_row + d : pe_row + d - R, valid ? 8 : 0);
    }
  }
}

// A block per (range of chunks, tile of 8 NT slots): SHARED tiles cut the slots of all tokens
// (every row has the chunk's keys at the same slots), the others one token's heads (grid y =
// token, z = tile of its heads) with its keys looked up through its mask row. The tile's q is
// copied once; each chunk's keys are copied while the block computes on the previous one. 16
// warps: for the scores warp w takes keys 16 (w % 4) .. + 15 over half (w / 4) % 2 of D for column
// groups w / 8, w / 8 + 2, ...; for the context dims 16 m .. + 15, m = w, w + 16, ...
// A block walks chunks_per_block chunks from chunk0 + blockIdx.x * chunks_per_block. With the
// committed slots on the device (kBaseOnDevice) it walks every gridDim.x-th chunk of the range the
// resolved base leaves instead: contiguous ranges sized for the bound would put a shorter committed
// prefix's chunks all in the first few blocks (a 17-node verify at 4096 keys would be 4x slower
// with a bound of 32768). Host calls keep the contiguous walk: strided with the same ranges, and
// the resolve in the kernel, cost the 65-node verify's kernel ~2 us.
// Where a block works: its range of chunks (`range` of `ranges`) and its tile (SHARED: tile `y`;
// otherwise token `y`, its heads' tile `z`). A launch of one part gives its block and grid indices.
struct BlockPlace {
  int range, ranges, y, z;
};

template <int NT, bool SHARED, bool kBaseOnDevice>
__device__ __forceinline__ void AttendMmaBlock(const float* q_lat, const float* q_pe, const __nv_bfloat16* cache_c, const __nv_bfloat16* cache_kpe, const uint8_t* mask, int T, int H, int Hp,
                                               int R, int dr, bool wide, int64_t base, float scale, int max_chunks, int chunk0, int chunk_end, int chunks_per_block,
                                               KeyCounts key_counts, float* partial, BlockPlace at) {
  using L = MmaLayout<NT>;
  constexpr int ROWS = L::kRows;
  PdlWait();
  PdlLaunchDependents();
  const int D = R + dr, Dp = PaddedDims(D), slices = Dp / 16, key_stride = L::KeyStride(Dp);
  extern __shared__ uint4 mma_smem[];
  __nv_bfloat16* key_buf = reinterpret_cast<__nv_bfloat16*>(mma_smem);                            // [2][64][key_stride]
  uint2* q = reinterpret_cast<uint2*>(reinterpret_cast<char*>(mma_smem) + 2 * L::KeyBytes(Dp));   // [NT][slices][3][32]
  float* scores = reinterpret_cast<float*>(reinterpret_cast<char*>(q) + L::QBytes(slices));        // [2][ROWS][kScoreStride]
  __nv_bfloat16* p_planes = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(scores) + L::kScoreBytes);  // [3][ROWS][kPStride]
  int* allowed = reinterpret_cast<int*>(reinterpret_cast<char*>(p_planes) + L::kPBytes);          // [T] (one token's tile)
  __shared__ int64_t slots[2][kAttnChunk];
  __shared__ int row_keys[2][ROWS];
  __shared__ int64_t row_out[2][ROWS];  // where row i's partial of the chunk goes (partial + row_out), or -1
  __shared__ int chunk_keys[2];         // the most keys a row of the tile sees in the chunk
  __shared__ int64_t tile_counts[ROWS];  // the keys each row sees in all
  int c_begin = chunk0 + at.range * chunks_per_block, c_end = min(c_begin + chunks_per_block, chunk_end), c_step = 1;
  if constexpr (kBaseOnDevice) {
    key_counts.Resolve();
    base = key_counts.base;
    const int2 chunks = CallChunks<SHARED>(chunk0, chunk_end, base, mask);
    c_begin = chunks.x + at.range;
    c_end = chunks.y;
    c_step = at.ranges;
    if (c_begin >= c_end) return;
  }
  const int slot0 = SHARED ? at.y * ROWS : at.y * Hp + at.z * ROWS;
  const SlotRows row_th{slot0, T, H, Hp};
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // the keys of chunk c into buffer b: slots, row counts, partial offsets, and the copy (committed)
  const auto fetch = [&](int c, int b) {
    const int n = ChunkKeys<ROWS, SHARED, kWarps>(mask, T, at.y, base, [&](int i) { return tile_counts[i]; }, c, allowed, slots[b], row_keys[b]);
    if (tid < ROWS) row_out[b][tid] = row_keys[b][tid] > 0 ? (static_cast<int64_t>(row_th(tid)) * max_chunks + c) * (R + 2) : -1;
    if (tid == 0) chunk_keys[b] = n;
    if (n > 0) CopyKeys(key_buf + b * kAttnChunk * key_stride, slots[b], cache_c, cache_kpe, R, dr, key_stride, wide);
    CopyAsyncCommit();
  };

  // zero key dims D .. Dp, the rows' key counts, the first chunk's copy, then the tile's q while it lands
  for (int i = tid; i < 2 * kAttnChunk * (Dp - D); i += kThreads) key_buf[(i / (Dp - D)) * key_stride + D + i % (Dp - D)] = __float2bfloat16_rn(0.f);
  TileKeyCounts<ROWS, kWarps>(key_counts, row_th, tile_counts);
  fetch(c_begin, 0);
  SplitTileQ(q_lat, q_pe, T, H, Hp, R, dr, slices, slot0, NT, q);
  const int g = lane >> 2, t4 = lane & 3;
  const int kt = warp & 3, half = (warp >> 2) & 1, nt0 = warp >> 3;  // the scores' split
  const int s_begin = half ? slices / 2 : 0, s_end = half ? slices : slices / 2;
  for (int c = c_begin, i = 0; c < c_end; c += c_step, ++i) {
    const int b = i & 1;
    if (c + c_step < c_end) {
      fetch(c + c_step, b ^ 1);  // its buffer was last read before the previous chunk's closing barrier
      CopyAsyncWait<1>();
    } else {
      CopyAsyncWaitAll();
    }
    __syncthreads();
    if (chunk_keys[b] == 0) continue;  // nothing to see here (causal prefill's upper triangle)
    const __nv_bfloat16* keys = key_buf + b * kAttnChunk * key_stride;

    // Scores: keys 16 kt .. + 15 of this warp, slices [s_begin, s_end) in two chains by parity.
    {
      // ldmatrix rows: lane l gives row l % 8 of matrix l / 8 (a0: keys 0-7 x k 0-7, a1: keys 8-15,
      // a2: k 8-15, a3: both)
      const uint32_t keys_addr = static_cast<uint32_t>(__cvta_generic_to_shared(keys + (16 * kt + (lane & 7) + ((lane >> 3) & 1) * 8) * key_stride + (lane >> 4) * 8));
      constexpr int kMine = (NT + 1) / 2;
      float even[kMine][4], odd[kMine][4];
#pragma unroll
      for (int j = 0; j < kMine; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) even[j][i] = odd[j][i] = 0.f;
      for (int sl = s_begin; sl < s_end; sl += 2) {
        ScoreSlice<NT>(keys_addr, q + lane, nt0, sl, slices, even);
        if (sl + 1 < s_end) ScoreSlice<NT>(keys_addr, q + lane, nt0, sl + 1, slices, odd);
      }
      float* out = scores + half * ROWS * L::kScoreStride;
#pragma unroll
      for (int j = 0; j < kMine; ++j) {
        const int nt = nt0 + 2 * j;
        if (nt >= NT) break;
        // acc element i: key 16 kt + g + 8 (i >> 1), row 8 nt + 2 t4 + (i & 1)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[(8 * nt + 2 * t4 + (i & 1)) * L::kScoreStride + 16 * kt + g + 8 * (i >> 1)] = even[j][i] + odd[j][i];
      }
    }
    __syncthreads();

    // The chunk's softmax, a warp per row: the max, the exponentials and their sum (a fixed tree
    // over the lanes) in parallel; p into its three planes.
    for (int r = warp; r < ROWS; r += kWarps) {
      const int n = row_keys[b][r];
      const float* s = scores + r * L::kScoreStride;
      const float* s_hi = s + ROWS * L::kScoreStride;
      const float s0 = s[lane] + s_hi[lane], s1 = s[lane + 32] + s_hi[lane + 32];
      float m = fmaxf(lane < n ? ScaledScore(s0, scale) : -INFINITY, lane + 32 < n ? ScaledScore(s1, scale) : -INFINITY);
      for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float p0 = lane < n ? KeyWeight(s0, scale, m) : 0.f, p1 = lane + 32 < n ? KeyWeight(s1, scale, m) : 0.f;
      const Bf16Planes pp = SplitPair(p0, p1);  // low halves: key lane, high: key lane + 32
      const uint32_t planes[kPlanes] = {pp.lo, pp.mid, pp.hi};
#pragma unroll
      for (int pl = 0; pl < kPlanes; ++pl) {
        uint16_t* row = reinterpret_cast<uint16_t*>(p_planes) + (pl * ROWS + r) * L::kPStride;
        row[lane] = static_cast<uint16_t>(planes[pl] & 0xFFFFu);
        row[lane + 32] = static_cast<uint16_t>(planes[pl] >> 16);
      }
      float l = p0 + p1;
      for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (lane == 0 && n > 0) {
        float* o = partial + row_out[b][r];
        o[0] = m;
        o[1] = l;
      }
    }
    __syncthreads();

    // Context: dims 16 m .. + 15 (m = warp, warp + 16, ...) for every column group, one chain over
    // the 4 key slices x 3 planes. A warp loads the p fragments of the tile once for all its m.
    {
      // pb[nt][pl][h]: slices 2 h (regs 0-1) and 2 h + 1 (regs 2-3) of plane pl, rows 8 nt .. + 7
      uint32_t pb[NT][kPlanes][2][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int pl = 0; pl < kPlanes; ++pl)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            LoadMatrixX4(pb[nt][pl][h], static_cast<uint32_t>(__cvta_generic_to_shared(p_planes + (pl * ROWS + 8 * nt + (lane & 7)) * L::kPStride + 32 * h + (lane >> 3) * 8)));
      for (int m = warp; m < (R + 15) / 16; m += kWarps) {
        uint32_t a[4][4];  // key slice ks: c^T (dims x keys) by ldmatrix.trans of the key rows
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          LoadMatrixX4Trans(a[ks], static_cast<uint32_t>(__cvta_generic_to_shared(keys + (16 * ks + (lane >> 4) * 8 + (lane & 7)) * key_stride + 16 * m + ((lane >> 3) & 1) * 8)));
        }
        const int dim = 16 * m + g;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
#pragma unroll
            for (int pl = 0; pl < kPlanes; ++pl) MmaBf16(acc, a[ks], pb[nt][pl][ks / 2][2 * (ks % 2)], pb[nt][pl][ks / 2][2 * (ks % 2) + 1]);
          // acc element i: dim 16 m + g + 8 (i >> 1), row 8 nt + 2 t4 + (i & 1)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t o = row_out[b][8 * nt + 2 * t4 + (i & 1)];
            const int d = dim + 8 * (i >> 1);
            if (o >= 0 && d < R) partial[o + 2 + d] = acc[i];
          }
        }
      }
    }
    __syncthreads();  // the key buffer and the p planes are free again
  }
}

template <int NT, bool SHARED, bool kBaseOnDevice>
__global__ void __launch_bounds__(kThreads) AttendMmaKernel(const float* q_lat, const float* q_pe, const __nv_bfloat16* cache_c, const __nv_bfloat16* cache_kpe, const uint8_t* mask, int T, int H, int Hp,
                                                            int R, int dr, bool wide, int64_t base, float scale, int max_chunks, int chunk0, int chunk_end,
                                                            int chunks_per_block, KeyCounts key_counts, float* partial) {
  AttendMmaBlock<NT, SHARED, kBaseOnDevice>(q_lat, q_pe, cache_c, cache_kpe, mask, T, H, Hp, R, dr, wide, base, scale, max_chunks, chunk0, chunk_end, chunks_per_block, key_counts, partial,
                                            BlockPlace{static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)});
}

// Both parts of a masked call with the committed slots on the device, in one launch: blocks
// [0, shared_ranges x shared_tiles) walk the committed prefix's chunks (SHARED tiles of NT_S
// groups), the rest each token's chunks from the committed slots' one (tiles of NT_T groups:
// token_ranges x T x head_tiles). Two launches put a second kernel, and its launch gap, into every
// layer of a tree verify that a causal verify of the same nodes runs in one.
template <int NT_S, int NT_T>
__global__ void __launch_bounds__(kThreads) AttendMmaMaskedKernel(const float* q_lat, const float* q_pe, const __nv_bfloat16* cache_c, const __nv_bfloat16* cache_kpe, const uint8_t* mask, int T,
                                                                  int H, int Hp, int R, int dr, bool wide, int64_t base, float scale, int max_chunks, int shared_chunks,
                                                                  int token_chunks, int shared_ranges, int shared_tiles, int token_ranges, int head_tiles, KeyCounts key_counts,
                                                                  float* partial) {
  const int b = static_cast<int>(blockIdx.x);
  if (b < shared_ranges * shared_tiles) {
    AttendMmaBlock<NT_S, true, true>(q_lat, q_pe, cache_c, cache_kpe, mask, T, H, Hp, R, dr, wide, base, scale, max_chunks, 0, shared_chunks, 1, key_counts, partial,
                                     BlockPlace{b % shared_ranges, shared_ranges, b / shared_ranges, 0});
  } else {
    const int i = b - shared_ranges * shared_tiles, tile = i / token_ranges;
    AttendMmaBlock<NT_T, false, true>(q_lat, q_pe, cache_c, cache_kpe, mask, T, H, Hp, R, dr, wide, base, scale, max_chunks, shared_chunks, shared_chunks + token_chunks, 1, key_counts,
                                      partial, BlockPlace{i % token_ranges, token_ranges, tile / head_tiles, tile % head_tiles});
  }
}

// Column groups per tile: a tree token's tile holds only its heads (NT divides Hp / 8); otherwise
// the largest tile whose shared memory fits (2 groups: 220 KB at Kimi K2's D = 576).
constexpr size_t kMaxSmem = 225 * 1024;  // of 227 KB per block: the static part (~1.5 KB) besides
constexpr size_t kMaskedStaticExtra = 2 * 1024;  // the masked kernel's second tile form's static arrays
// A block's dynamic shared memory with tiles of nt column groups.
size_t TileBytes(const AttendMmaArgs& a, int nt, bool shared) {
  const int Dp = PaddedDims(a.R + a.dr);
  return nt == 2 ? MmaLayout<2>::Bytes(Dp, a.T, shared) : MmaLayout<1>::Bytes(Dp, a.T, shared);
}
// The tiles of nt column groups a part cuts its rows into: the slots of all tokens (shared), or
// each token's heads.
int64_t PartTiles(const AttendMmaArgs& a, int nt, bool shared) {
  const int Hp = PaddedHeads(a.H);
  return shared ? (static_cast<int64_t>(a.T) * Hp + 8 * nt - 1) / (8 * nt) : static_cast<int64_t>(a.T) * (Hp / (8 * nt));
}
int TileGroups(const AttendMmaArgs& a, bool shared) {
  const int hp8 = PaddedHeads(a.H) / 8, groups = shared ? a.T * hp8 : hp8;
  for (int nt : {2, 1}) {
    const size_t bytes = TileBytes(a, nt, shared);
    if (bytes <= kMaxSmem && (nt == 1 || nt <= groups / 2) && (shared || hp8 % nt == 0)) return nt;
  }
  return 0;
}

// Key rows copied 8 values (16 bytes) at a time: R and dr multiples of 8, both caches on 16 bytes.
inline bool WideRows(const AttendMmaArgs& a) {
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return a.R % 8 == 0 && a.dr % 8 == 0 && aligned16(a.cache_c) && aligned16(a.cache_kpe);
}

// The ranges of a part with the committed slots on the device: as many as fit in one wave.
inline int DeviceRanges(int chunks, int64_t tiles, int sms) { return static_cast<int>(std::min<int64_t>(chunks, std::max<int64_t>(1, sms / tiles))); }

// Chunks per block: about one block per SM (a block fills its SM's shared memory), each walking its
// chunks with the next one's copy in flight; a decode keeps a chunk per block. With the committed
// slots on the device the blocks stride over the chunks instead, as many ranges as fit in one wave:
// a second wave for a few blocks costs a whole walk again once the chunks are spread evenly (a
// 33-node verify, 17 tiles in 136 blocks, ~1.3x slower).
template <int NT, bool SHARED>
Status Launch(const AttendMmaArgs& a, int chunks, int chunk0, int sms, cudaStream_t s) {
  const int Hp = PaddedHeads(a.H);
  const size_t smem = TileBytes(a, NT, SHARED);
  const int64_t tiles = PartTiles(a, NT, SHARED);
  const bool on_device = a.key_counts.base_on_device != nullptr;
  const int per_block = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunks, (chunks * tiles + sms - 1) / sms)));
  const int ranges = on_device ? DeviceRanges(chunks, tiles, sms) : (chunks + per_block - 1) / per_block;
  const dim3 grid = SHARED ? dim3(ranges, static_cast<unsigned>(tiles)) : dim3(ranges, a.T, Hp / (8 * NT));
  const bool wide = WideRows(a);
  const auto launch = [&](auto kernel) -> Status {
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "mla attend (mma): shared memory"));
    return LaunchPdl("mla attend (mma)", kernel, grid, dim3(kThreads), smem, s, a.q_lat, a.q_pe, a.cache_c, a.cache_kpe, a.mask, a.T, a.H, Hp, a.R, a.dr, wide, a.base, a.scale, a.max_chunks,
                     chunk0, chunk0 + chunks, per_block, a.key_counts, a.partial);
  };
  return on_device ? launch(AttendMmaKernel<NT, SHARED, true>) : launch(AttendMmaKernel<NT, SHARED, false>);
}

// A masked call with the committed slots on the device: both parts in one launch, each part's
// tiles and ranges as its own launch would take them.
template <int NT_S, int NT_T>
Status LaunchMasked(const AttendMmaArgs& a, int shared_chunks, int token_chunks, int sms, cudaStream_t s) {
  const int Hp = PaddedHeads(a.H);
  const size_t smem = std::max(TileBytes(a, NT_S, true), TileBytes(a, NT_T, false));
  const int shared_tiles = static_cast<int>(PartTiles(a, NT_S, true)), head_tiles = Hp / (8 * NT_T);
  const int64_t token_tiles = PartTiles(a, NT_T, false);
  const int shared_ranges = DeviceRanges(shared_chunks, shared_tiles, sms), token_ranges = DeviceRanges(token_chunks, token_tiles, sms);
  const int64_t blocks = static_cast<int64_t>(shared_ranges) * shared_tiles + token_ranges * token_tiles;
  const auto kernel = AttendMmaMaskedKernel<NT_S, NT_T>;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "mla attend (mma, masked): shared memory"));
  return LaunchPdl("mla attend (mma, masked)", kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, s, a.q_lat, a.q_pe, a.cache_c, a.cache_kpe, a.mask, a.T, a.H, Hp, a.R, a.dr,
                   WideRows(a), a.base, a.scale, a.max_chunks, shared_chunks, token_chunks, shared_ranges, shared_tiles, token_ranges, head_tiles, a.key_counts, a.partial);
}

template <bool SHARED>
Status LaunchTiles(const AttendMmaArgs& a, int chunks, int chunk0, int sms, cudaStream_t s) {
  switch (TileGroups(a, SHARED)) {
    case 2: return Launch<2, SHARED>(a, chunks, chunk0, sms, s);
    case 1: return Launch<1, SHARED>(a, chunks, chunk0, sms, s);
    default: return Unsupported("mla_attention: ", a.T, " new tokens with a mask need more shared memory than a block has; split the call");
  }
}

}  // namespace

bool AttendMmaFits(const AttendMmaArgs& a) {
  const auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  return a.R % 4 == 0 && a.dr % 4 == 0 && aligned8(a.cache_c) && aligned8(a.cache_kpe) && MmaLayout<1>::Bytes(PaddedDims(a.R + a.dr), 0, true) <= kMaxSmem;
}

Status LaunchAttendMma(const AttendMmaArgs& a, int shared_chunks, int token_chunks, int sms, cudaStream_t s) {
  if (shared_chunks > 0 && token_chunks > 0 && a.key_counts.base_on_device != nullptr) {
    // one launch where both parts' shared memory fits with the static arrays of two tile forms
    const int nt_s = TileGroups(a, true), nt_t = TileGroups(a, false);
    if (nt_s > 0 && nt_t > 0 && std::max(TileBytes(a, nt_s, true), TileBytes(a, nt_t, false)) + kMaskedStaticExtra <= kMaxSmem) {
      if (nt_s == 2 && nt_t == 2) return LaunchMasked<2, 2>(a, shared_chunks, token_chunks, sms, s);
      if (nt_s == 2 && nt_t == 1) return LaunchMasked<2, 1>(a, shared_chunks, token_chunks, sms, s);
      if (nt_s == 1 && nt_t == 1) return LaunchMasked<1, 1>(a, shared_chunks, token_chunks, sms, s);
    }
  }
  if (shared_chunks > 0) KDTREE_RETURN_IF_ERROR(LaunchTiles<true>(a, shared_chunks, 0, sms, s));
  if (token_chunks > 0) KDTREE_RETURN_IF_ERROR(LaunchTiles<false>(a, token_chunks, shared_chunks, sms, s));
  return Status::Ok();
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
