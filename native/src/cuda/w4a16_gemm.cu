// W4A16 GEMM: y[M, N] = x[M, K] . dequant(qw[N, K/8], sc[N, K/G])^T, and its grouped MoE form.
//
// bf16/f16 activations run on tensor cores (mma.sync m16n8k16, f32 accumulation):
//  * Decode is a pure weight stream: a block owns 64 W rows and a range of K (split-K), and pulls
//    one 128 B line per row per stage, with the stage's scales, through a 5-deep cp.async ring in
//    shared memory (~32 KB in flight per block, no registers held, no load latency between MMAs).
//  * K is permuted inside every 8-k word so that a lane's B pair (k, k+4) sits in nibbles (t, t+4)
//    of one word: one shift and one LOP3 give two bf16 codes (128 + u) in a register, one HSUB2
//    turns them into q = u - 8. The same permutation is applied to x when it is staged in shared
//    memory, so A fragments are plain 32-bit loads; only the rows that exist are staged.
//  * Codes are exact small integers in bf16/f16, so the MMA computes sum_k x*q exactly per group;
//    the f32 group sum is then scaled: y = sum_g s_g * (sum_{k in g} x_k q_k).
//  * Split-K partials are summed in split order by the last block of each tile (no second launch).
//  * Every output element is computed in the same order whatever M is (MMA rows are independent;
//    split-K depends only on N, K and the device), so results are batch-invariant.
// f32 activations run a SIMT kernel with the same grouping and f32 FMAs (tensor cores would round
// x to bf16/tf32).
#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

// Warps per block, side by side along N. (Two warps per 16 rows, splitting the groups, measured
// ~15% slower at boost clocks: runs 11 vs 12 of docs/gpu/notes.md.)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = 16;                 // W rows per warp: two n8 MMA tiles
constexpr int kBlockRows = kWarps * kWarpRows;
constexpr int kStepK = 256;                   // k per pipeline stage: one 128 B line of each of the block's 64 W rows
constexpr int kStages = 4;                    // cp.async stages: 3 x 8 KB of weights in flight per block
constexpr int kWRowBytes = 144;               // 128 B of codes + 16 B padding: conflict-free fragment loads
constexpr int kScWords = 8;                   // 4-byte words of scales per row and stage (8 groups of 32 in f32)
constexpr int kScRowBytes = kScWords * 4;
constexpr int kStageBytes = kBlockRows * (kWRowBytes + kScRowBytes);
constexpr int kPad = 8;                       // halfs of padding per staged x row: conflict-free A loads
constexpr int kXSmemBudget = 75 * 1024 - kStages * kStageBytes;  // x per block: 3 blocks fit an SM at decode

struct Tile {
  int expert, row_start, rows, pad;
};

struct GemmParams {
  const void* x;
  const int32_t* qw;       // [E, N, K/8]
  const void* sc;          // [E, N, K/G]
  bool sc_f32;
  int N, K, G;
  int M;                   // logical rows (dense); MoE: pairs
  int tile_rows;           // rows per tile (16 x MF)
  const Tile* tiles;       // MoE tile list (device) or null for dense
  const int* num_tiles;    // MoE: device count of tiles
  const int* x_row;        // logical row -> x row, or null (identity)
  const int* out_row;      // logical row -> output row, or null (identity)
  int splits, groups_per_split;
  int chunk_k;             // k of x staged in shared memory at once (a multiple of kStepK)
  int x_rows;              // x rows staged per tile: min(tile_rows, rows that can exist); the rest read as 0
  int64_t sc_bytes;        // size of sc, so the rounded-out scale words never read past it
  bool direct;             // write y (dtype) directly; else partial f32 [splits][out_rows][N]
  bool fixup;              // with partials: the last block of a tile sums them into y
  int* counters;           // [grid.y * grid.x] arrival counters for the fixup, zero between calls
  void* y;
  DType y_dtype;
  float* partial;
  int out_rows;
};

// d = a . b + d, or with `fresh` d = a . b (the first slice of a group: no zeroing moves needed).
#define KDTREE_MMA(TYPE)                                                                                                  \
  if (fresh) {                                                                                                            \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n" \
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                                  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));                                       \
  } else {                                                                                                                \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                                  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                                  \
  }
template <typename T>
__device__ __forceinline__ void Mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1, bool fresh) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    KDTREE_MMA("bf16")
  } else {
    KDTREE_MMA("f16")
  }
}
#undef KDTREE_MMA

// Two codes (nibbles in bits 0-3 and 16-19 of `w`) -> two exact 16-bit floats q = u - 8.
template <typename T>
__device__ __forceinline__ uint32_t Dequant2(uint32_t w);
template <>
__device__ __forceinline__ uint32_t Dequant2<__nv_bfloat16>(uint32_t w) {
  uint32_t v = (w & 0x000F000Fu) | 0x43004300u;  // bf16 128 + u (ulp 1 in [128, 256))
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&v), __floats2bfloat162_rn(136.f, 136.f));
  return *reinterpret_cast<uint32_t*>(&r);
}
template <>
__device__ __forceinline__ uint32_t Dequant2<__half>(uint32_t w) {
  uint32_t v = (w & 0x000F000Fu) | 0x64006400u;  // f16 1024 + u (ulp 1 in [1024, 2048))
  __half2 r = __hsub2(*reinterpret_cast<__half2*>(&v), __floats2half2_rn(1032.f, 1032.f));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ float ScaleAt(const GemmParams& p, int64_t row, int g) {
  const int64_t i = row * (p.K / p.G) + g;
  return p.sc_f32 ? static_cast<const float*>(p.sc)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(p.sc)[i]);
}

// Resolves this block's tile: logical rows [row_start, row_start + rows) of one expert.
__device__ __forceinline__ bool BlockTile(const GemmParams& p, int* expert, int* row_start, int* rows) {
  if (p.tiles != nullptr) {
    if (static_cast<int>(blockIdx.y) >= *p.num_tiles) return false;
    const Tile t = p.tiles[blockIdx.y];
    *expert = t.expert;
    *row_start = t.row_start;
    *rows = t.rows;
  } else {
    *expert = 0;
    *row_start = blockIdx.y * p.tile_rows;
    *rows = min(p.tile_rows, p.M - *row_start);
  }
  return *rows > 0;
}

__device__ __forceinline__ void StoreOut(const GemmParams& p, int logical_row, int n, float v) {
  const int out = p.out_row ? p.out_row[logical_row] : logical_row;
  if (p.direct) StoreFromF32(p.y, p.y_dtype, static_cast<int64_t>(out) * p.N + n, v);
  else p.partial[(static_cast<int64_t>(blockIdx.z) * p.out_rows + out) * p.N + n] = v;
}

// Split-K fixup: the last block to finish a tile (arrival counter) sums every split's partial in
// split order, so the result is deterministic and needs no second launch; it resets the counter.
__device__ void FixupTile(const GemmParams& p, int row_start, int rows) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) last = atomicAdd(&p.counters[tile], 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int n0 = blockIdx.x * kBlockRows;
  for (int i = threadIdx.x; i < rows * kBlockRows; i += blockDim.x) {
    const int r = i / kBlockRows, n = n0 + i % kBlockRows;
    if (n >= p.N) continue;
    const int lr = row_start + r;
    const int out = p.out_row ? p.out_row[lr] : lr;
    float v = 0.f;
    for (int sp = 0; sp < p.splits; ++sp) v += __ldcg(&p.partial[(static_cast<int64_t>(sp) * p.out_rows + out) * p.N + n]);
    StoreFromF32(p.y, p.y_dtype, static_cast<int64_t>(out) * p.N + n, v);
  }
  if (threadIdx.x == 0) p.counters[tile] = 0;
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: fill with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// G is a template parameter so that group boundaries inside the unrolled stage are compile-time.
template <typename T, int MF, int G>
__global__ void __launch_bounds__(kThreads) W4A16MmaKernel(const GemmParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // [kStages] x {codes [64 rows][144 B], scales [64 rows][32 B]}, then x [x_rows][chunk_k + kPad]
  T* xs = reinterpret_cast<T*>(smem_raw + kStages * kStageBytes);
  const int xstride = p.chunk_k + kPad;
  int expert, row_start, rows;
  if (!BlockTile(p, &expert, &row_start, &rows)) return;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x * kBlockRows;
  const int groups = p.K / G;
  const int g_begin = blockIdx.z * p.groups_per_split;
  const int g_end = min(groups, g_begin + p.groups_per_split);
  const int k_begin = g_begin * G, k_end = g_end * G;
  const int n_warp = n_block + warp * kWarpRows;
  const int words = p.K / 8;
  const int vecs = (k_end - k_begin) / 32;  // 16-byte vectors per W row in this split
  const int steps = (k_end - k_begin + kStepK - 1) / kStepK;
  const int esize = p.sc_f32 ? 4 : 2;
  const char* sc_bytes = static_cast<const char*>(p.sc);

  // Weights and their scales stream HBM -> shared memory with cp.async, kStages deep, so ~32 KB per
  // block are in flight without holding registers, and no load latency sits between the MMAs.
  // Codes: each thread copies 4 of a stage's 512 16-byte pieces (a row's 128 B = one line).
  // Scales: a row's groups of the stage are a contiguous run, copied as the 4-byte words that
  // cover it (bf16 runs may start mid-word; the read below adds the offset back).
  const int32_t* wbase = p.qw + (static_cast<int64_t>(expert) * p.N + n_block) * words + k_begin / 8;
  // byte of row r's first scale of this split; stage s starts kStepK / G scales further
  auto scale_base = [&](int row) { return ((static_cast<int64_t>(expert) * p.N + n_block + row) * groups + g_begin) * esize; };
  constexpr int kGroupsPerStage = kStepK / G;
  constexpr int kCopies = kBlockRows * 8 / kThreads;  // 16-byte code pieces (and scale words) per thread per stage
  int64_t copy_base[kCopies];  // this thread's scale rows (c / 8 for c = tid + kThreads i)
#pragma unroll
  for (int i = 0; i < kCopies; ++i) copy_base[i] = scale_base((threadIdx.x + i * kThreads) >> 3);
  auto issue_stage = [&](int s) {
    unsigned char* stage = smem_raw + (s % kStages) * kStageBytes;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = threadIdx.x + i * kThreads;  // 0..511
      const int row = c >> 3, q = c & 7;
      const int v = s * 8 + q;
      const bool valid = s < steps && n_block + row < p.N && v < vecs;
      CpAsync16(stage + row * kWRowBytes + q * 16, valid ? wbase + static_cast<int64_t>(row) * words + v * 4 : p.qw, valid);
    }
    unsigned char* sc_stage = stage + kBlockRows * kWRowBytes;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = threadIdx.x + i * kThreads;  // 0..511: row c / 8, word c % 8
      const int row = c >> 3, w = c & 7;
      int src = 0;
      int64_t word_byte = 0;
      if (s < steps && n_block + row < p.N) {
        const int64_t first = copy_base[i] + static_cast<int64_t>(s) * kGroupsPerStage * esize;
        const int run = min(kGroupsPerStage, (k_end - k_begin) / G - s * kGroupsPerStage) * esize;
        word_byte = (first & ~int64_t{3}) + 4 * w;
        if (word_byte < first + run) src = static_cast<int>(p.sc_bytes - word_byte < 4 ? p.sc_bytes - word_byte : 4);
      }
      CpAsync4(sc_stage + row * kScRowBytes + w * 4, src > 0 ? sc_bytes + word_byte : sc_bytes, max(src, 0));
    }
    CpAsyncCommit();  // always commit (possibly empty) so group counting stays uniform
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue_stage(st);

  float acc[MF][2][4], part[MF][2][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < 2; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mf][nf][i] = part[mf][nf][i] = 0.f;

  const int wrow[2] = {warp * kWarpRows + g, warp * kWarpRows + 8 + g};  // this lane's rows in a stage
  // A-fragment rows of this lane (32-bit word offsets in xs); rows past x_rows read the zero row
  // staged after them, so the inner loop has no per-load selects
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xs);
  int arow[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) arow[mf][h] = min(mf * 16 + g + 8 * h, p.x_rows) * (xstride / 2);
  int64_t read_base[2][2];  // scale rows this lane reads: 2t, 2t + 1 of each n8 tile
#pragma unroll
  for (int nf = 0; nf < 2; ++nf)
#pragma unroll
    for (int j = 0; j < 2; ++j) read_base[nf][j] = scale_base(warp * kWarpRows + nf * 8 + 2 * t + j);
  for (int chunk = k_begin; chunk < k_end; chunk += p.chunk_k) {
    const int clen = min(p.chunk_k, k_end - chunk);
    if (chunk != k_begin) __syncthreads();  // the previous chunk's A reads are done
    // stage x[rows, chunk .. chunk + clen) permuted within each 8-k word: (k, k+4) pairs adjacent
    const int wpr = clen / 8;
    for (int i = threadIdx.x; i < (p.x_rows + 1) * wpr; i += kThreads) {  // + the zero row
      const int r = i / wpr, w = i % wpr;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < rows) {
        const int lr = row_start + r;
        const int xr = p.x_row ? p.x_row[lr] : lr;
        v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + static_cast<int64_t>(xr) * p.K + chunk + w * 8);
      }
      uint4 o;
      o.x = __byte_perm(v.x, v.z, 0x5410);
      o.y = __byte_perm(v.x, v.z, 0x7632);
      o.z = __byte_perm(v.y, v.w, 0x5410);
      o.w = __byte_perm(v.y, v.w, 0x7632);
      *reinterpret_cast<uint4*>(&xs[r * xstride + w * 8]) = o;
    }
    const int first = (chunk - k_begin) / kStepK, last = (chunk - k_begin + clen + kStepK - 1) / kStepK;
    for (int s = first; s < last; ++s) {
      CpAsyncWait<kStages - 2>();  // stage s has landed (for this thread's copies)
      __syncthreads();             // ... and for everyone's; stage s-1's buffer is free again
      issue_stage(s + kStages - 1);
      const unsigned char* ws = smem_raw + (s % kStages) * kStageBytes;
      const unsigned char* ss = ws + kBlockRows * kWRowBytes;
      // where each of this lane's 4 scale rows starts inside its word-aligned run
      int sc_off[2][2];
#pragma unroll
      for (int nf = 0; nf < 2; ++nf)
#pragma unroll
        for (int j = 0; j < 2; ++j) sc_off[nf][j] = static_cast<int>((read_base[nf][j] + static_cast<int64_t>(s) * kGroupsPerStage * esize) & 3);
#pragma unroll
      for (int q16 = 0; q16 < kStepK / 16; ++q16) {  // sixteen k16 slices per stage
        const int k0 = k_begin + s * kStepK + q16 * 16;  // absolute k of this slice
        if (k0 >= k_end) break;
        uint32_t b[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint2 v = *reinterpret_cast<const uint2*>(ws + wrow[r] * kWRowBytes + q16 * 8);  // words 2j, 2j+1
          b[r][0] = Dequant2<T>(v.x >> (4 * t));
          b[r][1] = Dequant2<T>(v.y >> (4 * t));
        }
        const int col = (k0 - chunk) / 2 + t;  // 32-bit word of the (k, k+4) pair in the staged x row
        const bool fresh = (q16 * 16) % G == 0;  // compile-time once unrolled
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          const uint32_t a[4] = {xw[arow[mf][0] + col], xw[arow[mf][1] + col], xw[arow[mf][0] + col + 4], xw[arow[mf][1] + col + 4]};
#pragma unroll
          for (int nf = 0; nf < 2; ++nf) Mma<T>(part[mf][nf], a, b[nf][0], b[nf][1], fresh);
        }
        if ((q16 * 16 + 16) % G == 0) {  // a group ends (compile-time): scale its exact sums into acc
          const int gi = q16 * 16 / G;  // group index inside the stage
#pragma unroll
          for (int nf = 0; nf < 2; ++nf) {
            const int r0 = warp * kWarpRows + nf * 8 + 2 * t;
            const unsigned char* s0 = ss + r0 * kScRowBytes + sc_off[nf][0] + gi * esize;
            const unsigned char* s1 = ss + (r0 + 1) * kScRowBytes + sc_off[nf][1] + gi * esize;
            const float sc0 = p.sc_f32 ? *reinterpret_cast<const float*>(s0) : __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(s0));
            const float sc1 = p.sc_f32 ? *reinterpret_cast<const float*>(s1) : __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(s1));
#pragma unroll
            for (int mf = 0; mf < MF; ++mf) {
              acc[mf][nf][0] = fmaf(part[mf][nf][0], sc0, acc[mf][nf][0]);
              acc[mf][nf][1] = fmaf(part[mf][nf][1], sc1, acc[mf][nf][1]);
              acc[mf][nf][2] = fmaf(part[mf][nf][2], sc0, acc[mf][nf][2]);
              acc[mf][nf][3] = fmaf(part[mf][nf][3], sc1, acc[mf][nf][3]);
            }
          }
        }
      }
    }
  }
  CpAsyncWait<0>();
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int nf = 0; nf < 2; ++nf) {
      const int n = n_warp + nf * 8 + 2 * t;
      const int m0 = mf * 16 + g, m1 = m0 + 8;
      if (m0 < rows && n < p.N) StoreOut(p, row_start + m0, n, acc[mf][nf][0]);
      if (m0 < rows && n + 1 < p.N) StoreOut(p, row_start + m0, n + 1, acc[mf][nf][1]);
      if (m1 < rows && n < p.N) StoreOut(p, row_start + m1, n, acc[mf][nf][2]);
      if (m1 < rows && n + 1 < p.N) StoreOut(p, row_start + m1, n + 1, acc[mf][nf][3]);
    }
  }
  if (p.fixup) FixupTile(p, row_start, rows);
}

// f32 activations: one warp per W row, lane l on 8-k words l, l + 32, ... (128 B per warp per step,
// coalesced), f32 FMAs, each word's dot scaled by its group's scale; 8 x rows per pass; lanes
// reduced in a fixed shuffle tree, so the result does not depend on M.
constexpr int kSimtRows = 8;
__global__ void __launch_bounds__(256) W4A16SimtKernel(const GemmParams p) {
  int expert, row_start, rows;
  if (!BlockTile(p, &expert, &row_start, &rows)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * (blockDim.x / 32) + warp;
  if (n >= p.N) return;
  const int words = p.K / 8, wpg = p.G / 8;
  const int w_begin = blockIdx.z * p.groups_per_split * wpg;
  const int w_end = min(words, w_begin + p.groups_per_split * wpg);
  const int64_t wrow = static_cast<int64_t>(expert) * p.N + n;
  const int32_t* q = p.qw + wrow * words;
  const float* x = static_cast<const float*>(p.x);
  for (int pass = 0; pass < rows; pass += kSimtRows) {
    float acc[kSimtRows];
    int64_t xoff[kSimtRows];
#pragma unroll
    for (int m = 0; m < kSimtRows; ++m) {
      acc[m] = 0.f;
      const int lr = row_start + pass + m;
      xoff[m] = pass + m < rows ? static_cast<int64_t>(p.x_row ? p.x_row[lr] : lr) * p.K : -1;
    }
    for (int w = w_begin + lane; w < w_end; w += 32) {
      const uint32_t word = static_cast<uint32_t>(__ldcs(q + w));
      const float s = ScaleAt(p, wrow, w / wpg);
      float qv[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[i] = __int_as_float(0x4B000000 | ((word >> (4 * i)) & 0xF)) - 8388616.f;  // 2^23 + u - (2^23 + 8)
#pragma unroll
      for (int m = 0; m < kSimtRows; ++m) {
        if (xoff[m] < 0) continue;
        const float4 a = *reinterpret_cast<const float4*>(x + xoff[m] + w * 8);
        const float4 b = *reinterpret_cast<const float4*>(x + xoff[m] + w * 8 + 4);
        float d = a.x * qv[0];
        d = fmaf(a.y, qv[1], d);
        d = fmaf(a.z, qv[2], d);
        d = fmaf(a.w, qv[3], d);
        d = fmaf(b.x, qv[4], d);
        d = fmaf(b.y, qv[5], d);
        d = fmaf(b.z, qv[6], d);
        d = fmaf(b.w, qv[7], d);
        acc[m] = fmaf(d, s, acc[m]);
      }
    }
#pragma unroll
    for (int m = 0; m < kSimtRows; ++m) {
      for (int off = 16; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < kSimtRows; ++m) {
        if (xoff[m] >= 0) StoreOut(p, row_start + pass + m, n, acc[m]);
      }
    }
  }
}

// Sums split-K partials (and, for MoE sum mode, the weighted experts of each token) in a fixed order.
__global__ void FinalizeKernel(const float* partial, int splits, int part_rows, int N, int out_rows, int topk,
                               const float* weights, void* y, DType y_dtype) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(out_rows) * N) return;
  const int r = static_cast<int>(i / N), n = static_cast<int>(i % N);
  float out = 0.f;
  const int pairs = weights ? topk : 1;
  for (int j = 0; j < pairs; ++j) {
    const int src = weights ? r * topk + j : r;
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += partial[(static_cast<int64_t>(s) * part_rows + src) * N + n];
    out = weights ? fmaf(weights[r * topk + j], v, out) : v;
  }
  StoreFromF32(y, y_dtype, i, out);
}

// MoE: counts pairs per expert, orders them by expert and cuts tiles of <= tile_rows rows.
// Positions inside an expert are not deterministic, and need not be: rows are independent.
__global__ void MoeSortKernel(const int32_t* ids, int pairs, int topk, int experts, bool gather, int tile_rows,
                              int* x_row, int* out_row, Tile* tiles, int* num_tiles, int* counts) {
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int offset = 0, n = 0;
    for (int e = 0; e < experts; ++e) {
      const int c = counts[e];
      for (int r = 0; r < c; r += tile_rows) tiles[n++] = Tile{e, offset + r, min(tile_rows, c - r), 0};
      counts[e] = offset;  // becomes the insertion cursor
      offset += c;
    }
    *num_tiles = n;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e < 0 || e >= experts) continue;  // an invalid id contributes nothing (its row stays unwritten)
    const int pos = atomicAdd(&counts[e], 1);
    x_row[pos] = gather ? p / topk : p;
    out_row[pos] = p;
  }
}

// Split-K from the shape and the device only (never from M, so rows stay batch-invariant). Blocks
// run in waves of kBlocksPerSm x SMs; a partial last wave costs as much as a full one, so pick the
// split count with the least waves per unit of work, plus a small price per split (partials and
// the fixup), each split at least two pipeline stages. `matrices` is how many weight matrices one
// launch streams at decode: 1 dense, top-k for MoE (the experts of one token).
constexpr int kBlocksPerSm = 3;
void ChooseSplits(int n, int groups, int group_size, int matrices, int sms, int* splits, int* per) {
  const int64_t blocks = static_cast<int64_t>((n + kBlockRows - 1) / kBlockRows) * matrices;
  const int64_t wave = static_cast<int64_t>(kBlocksPerSm) * sms;
  const int max_splits = std::max(1, std::min(32, groups / std::max(1, 2 * kStepK / group_size)));
  int best = 1;
  double best_cost = 1e30;
  for (int sp = 1; sp <= max_splits; ++sp) {
    const double cost = static_cast<double>((blocks * sp + wave - 1) / wave) / sp + 0.02 * sp;
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = sp;
    }
  }
  *per = (groups + best - 1) / best;
  *splits = (groups + *per - 1) / *per;
}

// x staged per block: the whole split if it fits the shared-memory budget, else chunks of whole
// pipeline stages.
int ChunkK(int split_k, int rows, int elem) {
  const int unit = kStepK;
  const int fit = (kXSmemBudget / (rows * elem) - kPad) / unit * unit;
  const int whole = (split_k + unit - 1) / unit * unit;
  return std::max(unit, std::min(fit, whole));
}

int Mf(int rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : 4; }

Status Aligned(const Tensor& t, int bytes, const char* op) {
  if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) return Invalid(op, ": ", t.Describe(), " must start on a ", bytes, "-byte boundary (check its offset)");
  return Status::Ok();
}

template <typename T, int MF, int G>
Status LaunchMmaMf(GemmParams p, dim3 grid, cudaStream_t s) {
  p.x_rows = std::max(1, std::min(p.x_rows, MF * 16));
  p.chunk_k = ChunkK(p.groups_per_split * p.G, p.x_rows + 1, sizeof(T));
  const int smem = kStages * kStageBytes + (p.x_rows + 1) * (p.chunk_k + kPad) * static_cast<int>(sizeof(T));
  // per device and kernel; cheap enough to set on every launch
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(W4A16MmaKernel<T, MF, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "w4a16: shared memory"));
  W4A16MmaKernel<T, MF, G><<<grid, kThreads, smem, s>>>(p);
  return LaunchStatus("w4a16 mma kernel");
}

template <typename T, int MF>
Status LaunchMmaG(GemmParams p, dim3 grid, cudaStream_t s) {
  switch (p.G) {
    case 32: return LaunchMmaMf<T, MF, 32>(p, grid, s);
    case 64: return LaunchMmaMf<T, MF, 64>(p, grid, s);
    default: return LaunchMmaMf<T, MF, 128>(p, grid, s);  // validated: 32, 64 or 128
  }
}

template <typename T>
Status LaunchMma(GemmParams p, int mf, dim3 grid, cudaStream_t s) {
  switch (mf) {
    case 1: return LaunchMmaG<T, 1>(p, grid, s);
    case 2: return LaunchMmaG<T, 2>(p, grid, s);
    default: return LaunchMmaG<T, 4>(p, grid, s);
  }
}

Status RunGemm(GemmParams p, DType x_dtype, int grid_tiles, int tile_rows_for_mf, cudaStream_t s) {
  if (x_dtype == DType::kF32) {
    const dim3 grid((p.N + 7) / 8, grid_tiles, p.splits);
    W4A16SimtKernel<<<grid, 256, 0, s>>>(p);
    return LaunchStatus("w4a16 simt kernel");
  }
  const dim3 grid((p.N + kBlockRows - 1) / kBlockRows, grid_tiles, p.splits);
  const int mf = Mf(tile_rows_for_mf);
  return x_dtype == DType::kBF16 ? LaunchMma<__nv_bfloat16>(p, mf, grid, s) : LaunchMma<__half>(p, mf, grid, s);
}

// The fields every launch shares: operands, shape, group, logical rows and their tiling.
GemmParams WeightParams(const Tensor& x, const Tensor& qw, const Tensor& sc, int group, int rows, int tile_rows) {
  GemmParams p{};
  p.x = x.data;
  p.qw = qw.as<const int32_t>();
  p.sc = sc.data;
  p.sc_f32 = sc.dtype == DType::kF32;
  p.N = static_cast<int>(qw.dim(qw.rank() - 2));
  p.K = static_cast<int>(x.dim(1));
  p.G = group;
  p.M = rows;
  p.tile_rows = tile_rows;
  p.x_rows = std::min(rows, tile_rows);
  p.sc_bytes = sc.bytes;
  return p;
}

}  // namespace

Status LaunchW4A16Gemm(const W4A16GemmArgs& a, cudaStream_t s, Scratch& scratch, int sms) {
  const int m = static_cast<int>(a.x.dim(0)), k = static_cast<int>(a.x.dim(1)), n = static_cast<int>(a.qw.dim(0));
  if (m == 0 || n == 0) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(Aligned(a.qw, 16, "w4a16_gemm"));
  KDTREE_RETURN_IF_ERROR(Aligned(a.x, 16, "w4a16_gemm"));
  KDTREE_RETURN_IF_ERROR(Aligned(a.sc, 4, "w4a16_gemm"));
  const bool simt = a.x.dtype == DType::kF32;
  GemmParams p = WeightParams(a.x, a.qw, a.sc, a.group, m, simt ? 64 : 16 * Mf(m));
  ChooseSplits(n, k / a.group, a.group, 1, sms, &p.splits, &p.groups_per_split);
  p.direct = p.splits == 1;
  p.fixup = !p.direct && !simt;
  p.y = a.y.data;
  p.y_dtype = a.y.dtype;
  p.out_rows = m;
  const int tiles = (m + p.tile_rows - 1) / p.tile_rows;
  if (!p.direct) {
    KDTREE_RETURN_IF_ERROR(scratch.Reserve(static_cast<size_t>(p.splits) * m * n * sizeof(float), s));
    p.partial = static_cast<float*>(scratch.ptr);
  }
  if (p.fixup) KDTREE_RETURN_IF_ERROR(scratch.Counters(static_cast<size_t>(tiles) * ((n + kBlockRows - 1) / kBlockRows), s, &p.counters));
  KDTREE_RETURN_IF_ERROR(RunGemm(p, a.x.dtype, tiles, std::min(m, p.tile_rows), s));
  if (!p.direct && !p.fixup) {
    const int64_t total = static_cast<int64_t>(m) * n;
    FinalizeKernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, s>>>(p.partial, p.splits, m, n, m, 1, nullptr, a.y.data, a.y.dtype);
    KDTREE_RETURN_IF_ERROR(LaunchStatus("w4a16 finalize"));
  }
  return Status::Ok();
}

Status LaunchMoeGemm(const MoeGemmArgs& a, cudaStream_t s, Scratch& scratch, int sms) {
  const int experts = static_cast<int>(a.qw.dim(0)), n = static_cast<int>(a.qw.dim(1)), k = static_cast<int>(a.x.dim(1));
  const int t = static_cast<int>(a.ids.dim(0)), topk = static_cast<int>(a.ids.dim(1)), pairs = t * topk;
  if (pairs == 0 || n == 0) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(Aligned(a.qw, 16, "moe_gemm"));
  KDTREE_RETURN_IF_ERROR(Aligned(a.x, 16, "moe_gemm"));
  KDTREE_RETURN_IF_ERROR(Aligned(a.sc, 4, "moe_gemm"));
  const bool gather = a.mode == MoeMode::kGather;
  const int tile_rows = a.x.dtype == DType::kF32 ? 64 : 16 * Mf(std::min(pairs, 64));
  const int max_tiles = (pairs + tile_rows - 1) / tile_rows + std::min(experts, pairs);
  GemmParams p = WeightParams(a.x, a.qw, a.sc, a.group, pairs, tile_rows);
  ChooseSplits(n, k / a.group, a.group, topk, sms, &p.splits, &p.groups_per_split);
  p.direct = gather && p.splits == 1;
  const bool simt = a.x.dtype == DType::kF32;
  p.fixup = gather && !p.direct && !simt;
  // scratch: x_row[pairs] out_row[pairs] counts[experts] num_tiles tiles[max_tiles] partial[splits, pairs, n]
  auto align = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t off_out = align(pairs * sizeof(int));
  const size_t off_counts = off_out + align(pairs * sizeof(int));
  const size_t off_num = off_counts + align(experts * sizeof(int));
  const size_t off_tiles = off_num + 256;
  const size_t off_partial = off_tiles + align(max_tiles * sizeof(Tile));
  const size_t total = off_partial + (p.direct ? 0 : static_cast<size_t>(p.splits) * pairs * n * sizeof(float));
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(total, s));
  char* base = static_cast<char*>(scratch.ptr);
  int* x_row = reinterpret_cast<int*>(base);
  int* out_row = reinterpret_cast<int*>(base + off_out);
  int* counts = reinterpret_cast<int*>(base + off_counts);
  int* num_tiles = reinterpret_cast<int*>(base + off_num);
  Tile* tiles = reinterpret_cast<Tile*>(base + off_tiles);
  MoeSortKernel<<<1, 1024, 0, s>>>(a.ids.as<const int32_t>(), pairs, topk, experts, gather, tile_rows, x_row, out_row, tiles, num_tiles, counts);
  KDTREE_RETURN_IF_ERROR(LaunchStatus("moe sort"));
  p.tiles = tiles;
  p.num_tiles = num_tiles;
  p.x_row = x_row;
  p.out_row = out_row;
  p.y = a.y.data;
  p.y_dtype = a.y.dtype;
  p.partial = reinterpret_cast<float*>(base + off_partial);
  p.out_rows = pairs;
  if (p.fixup) KDTREE_RETURN_IF_ERROR(scratch.Counters(static_cast<size_t>(max_tiles) * ((n + kBlockRows - 1) / kBlockRows), s, &p.counters));
  KDTREE_RETURN_IF_ERROR(RunGemm(p, a.x.dtype, max_tiles, tile_rows, s));
  if (!p.direct && !p.fixup) {
    const int rows_out = gather ? pairs : t;
    const int64_t count = static_cast<int64_t>(rows_out) * n;
    FinalizeKernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, s>>>(p.partial, p.splits, pairs, n, rows_out, topk,
                                                                              gather ? nullptr : a.weights.as<const float>(), a.y.data, a.y.dtype);
    KDTREE_RETURN_IF_ERROR(LaunchStatus("moe finalize"));
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace kdtree
