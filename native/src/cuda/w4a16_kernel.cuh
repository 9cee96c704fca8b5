// The pieces the W4A16 kernels share: the launch parameters, the code and scale decoding, the
// output store. w4a16_gemm.cu holds the stream-K decode kernel (sm_90) and
// the launchers; w4a16_wgmma.cu the warpgroup kernel for 17+ tokens on large N (sm_90a only).
#pragma once
#include <type_traits>

#include "common.cuh"
#include "kdtree/w4a16_layout.h"

namespace kdtree {
namespace cuda {
namespace w4a16 {

// Steps (16 rows x 128 k) per weight matrix, so that step indices and a range's end fit in 32 bits:
// 2^30 steps is 2^41 weights.
constexpr int64_t kMaxSteps = int64_t{1} << 30;
constexpr int kUint4PerStep = w4::kWordsPerStep / 4;

struct Tile {
  int expert, row_start, rows, pad;
};

// n / d for 0 <= n < 2^31 by a launch-constant d, without a division: floor(n * mul / 2^(32 + shift))
// with mul = ceil(2^(31 + l) / d), l = ceil(log2 d) (the error n * (mul - 2^(31+l) / d) / 2^(31+l) stays
// below 1/d). A division by a runtime value is a ~20-instruction dependent chain, and the ones that
// place a warp in the matrix come before its first weight load and in the combine at its end, on
// the critical path of a decode launch (0.2-0.4 us of it).
struct Divisor {
  int d;
  uint32_t mul;
  int shift;
  __device__ __forceinline__ int Div(int n) const { return d == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), mul) >> shift); }
};
inline Divisor MakeDivisor(int d) {
  Divisor v{d, 0u, 0};
  if (d > 1) {
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    v.mul = static_cast<uint32_t>(((uint64_t{1} << (31 + l)) + d - 1) / d);
    v.shift = l - 1;
  }
  return v;
}

struct GemmParams {
  const void* x;
  const uint4* qw;         // packed [E][tiles][steps][2][32] x 16 B
  const char* sc;          // packed [E][tiles][blocks][8 row pairs][2][4 groups] (bf16 or f32)
  bool sc_f32;
  int N, K, tiles, steps, blocks;
  int M;                   // dense rows; MoE (token, expert) pairs
  int tile_tokens;         // tokens per token tile: 8 x NT
  int tile_offset;         // first token tile of this launch
  const Tile* moe_tiles;   // MoE token tiles (device), or null for dense
  const int32_t* route_ids;  // MoE routed inside the kernel (RouteTile): ids [pairs]; or null (moe_tiles)
  int route_pairs, route_topk, route_experts;
  bool route_gather;
  const int* num_tiles;    // MoE: device count of token tiles
  int* x_row;              // logical row -> x row, or null (identity)
  int* out_row;            // logical row -> y row, or null (identity)
  int steps_per_block;     // the stream-K range of a block (>= steps: a tile spans at most two blocks)
  int steps_per_warp;      // a warp's share of its block's range
  Divisor by_steps, by_steps_per_warp, by_route_topk;  // division by `steps`, `steps_per_warp`, `route_topk`
  int range_blocks;        // blocks per matrix
  const void* xs;          // x staged in fragment order for this chunk (StageXKernel), or null (StagesX)
  int slices;              // k16 slices per staged token group: Steps(K) * 8 (zero past K)
  uint64_t* exchange;      // [chunk tiles][range_blocks][8 NT tokens][16 rows]: a boundary tile's
                           // first block sum (flag << 32 | f32 bits), zero between launches
  void* y;
  DType y_dtype;
  bool silu_mul;           // the SiLU epilogue: gate_up-packed weights (N = 2I rows), y [rows, I]
};

// Two codes (nibbles in bits 0-3 and 16-19 of `w`) -> two exact 16-bit floats q = u - 8: one
// LOP3 ((w & 0x000F000F) | magic: 128 + u in bf16, 1024 + u in f16; the magic passed in a register,
// as SASS LOP3 takes one immediate) and one HSUB2.
template <typename A>
__device__ __forceinline__ uint32_t Dequant2(uint32_t w, uint32_t magic) {
  uint32_t v, r;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;\n" : "=r"(v) : "r"(w), "r"(magic));  // (a & b) | c
  if constexpr (std::is_same<A, __half>::value) {
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(v), "r"(0x64086408u));  // - 1032
  } else {
    asm("sub.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(v), "r"(0x43084308u));  // - 136
  }
  return r;
}
template <typename A>
constexpr uint32_t kMagic = std::is_same<A, __half>::value ? 0x64006400u : 0x43004300u;

// The scales a lane needs for one scale block: rows g and g + 8, its 4 groups (16 B in bf16,
// 32 B in f32), loaded with the step's weights.
// A tile's scale block (16 rows x 4 groups) in 16-byte units: 8 in bf16, 16 in f32.
template <typename S>
constexpr int kScaleUint4 = w4::kScalesPerBlock * static_cast<int>(sizeof(S)) / 16;
template <typename S>
struct ScaleFrag {
  uint4 v[sizeof(S) / 2];
};
template <typename S>
__device__ __forceinline__ void ScalesOf(const ScaleFrag<S>& f, int q, float* s_lo, float* s_hi) {
  if constexpr (std::is_same<S, float>::value) {
    const uint32_t lo[4] = {f.v[0].x, f.v[0].y, f.v[0].z, f.v[0].w}, hi[4] = {f.v[1].x, f.v[1].y, f.v[1].z, f.v[1].w};
    *s_lo = __uint_as_float(lo[q]);
    *s_hi = __uint_as_float(hi[q]);
  } else {
    const uint32_t w[4] = {f.v[0].x, f.v[0].y, f.v[0].z, f.v[0].w};  // [row g: q0 q1, q2 q3][row g+8: q0 q1, q2 q3]
    const uint32_t lo = w[q / 2], hi = w[2 + q / 2];
    *s_lo = __uint_as_float(q % 2 ? lo & 0xFFFF0000u : lo << 16);
    *s_hi = __uint_as_float(q % 2 ? hi & 0xFFFF0000u : hi << 16);
  }
}

// The tile token of acc element i of n-tile j of a lane: MMA column 2 t + (i & 1) of token group j.
// In the even-column form (w4a16_gemm.cu: 2-4 tokens, token u in column 2 u) an even element
// holds token t; its callers never store the odd ones.
template <bool kEvenColumns>
__device__ __forceinline__ int TileToken(int j, int i, int t) { return kEvenColumns ? t : 8 * j + 2 * t + (i & 1); }

// acc element i of n-tile j of a lane: token TileToken, row g + 8 (i >> 1) of the tile.
template <bool kEvenColumns = false>
__device__ __forceinline__ void StoreElement(const GemmParams& p, float v, int j, int i, int tile, int row_start, int rows, int g, int t) {
  const int tok = TileToken<kEvenColumns>(j, i, t), n = tile * w4::kTileRows + g + 8 * (i >> 1);
  if (tok < rows && n < p.N) {
    const int lr = row_start + tok;
    const int out = p.out_row ? p.out_row[lr] : lr;
    StoreFromF32(p.y, p.y_dtype, static_cast<int64_t>(out) * p.N + n, v);
  }
}

// The SiLU epilogue's store of elements i and i + 2 of n-tile j of a lane (a gate_up tile: gate
// row g, its up row g + 8, one token): their activation at column 8 tile + g of y [rows, N / 2],
// after rounding each to y's dtype as a stored gate_up output would be.
template <bool kEvenColumns = false>
__device__ __forceinline__ void StoreSilu(const GemmParams& p, float gate, float up, int j, int i, int tile, int row_start, int rows, int g, int t) {
  const int tok = TileToken<kEvenColumns>(j, i, t), n = tile * 8 + g, width = p.N / 2;
  if (tok < rows && n < width) {
    const int lr = row_start + tok;
    const int out = p.out_row ? p.out_row[lr] : lr;
    StoreFromF32(p.y, p.y_dtype, static_cast<int64_t>(out) * width + n, SiluMulValue(RoundTo(p.y_dtype, gate), RoundTo(p.y_dtype, up)));
  }
}

// The warpgroup kernel (w4a16_wgmma.cu): bf16 x, 17 or more tokens, in token tiles of 32.
// Available when the binary holds sm_90a code and the device runs it.
constexpr int kWgmmaTileTokens = policy::kWgmmaTileTokens;
bool WgmmaAvailable();
// Warpgroups per token tile: one per 4 tiles of 16 rows.
int WgmmaTileGroups(int tiles);
// Scratch for the staged x of one token tile (its B-operand order, in copies).
size_t WgmmaStagedBytes(int steps, int tiles);
// Stages x and runs the GEMM for token tiles [p.tile_offset, + token_tiles) with p's stream-K
// ranges (whose rounding it replays) on a device of `sms` SMs; `xs` holds WgmmaStagedBytes per
// token tile.
Status LaunchW4A16Wgmma(GemmParams p, int group, int token_tiles, int sms, void* xs, cudaStream_t s);

// The prefill kernel (w4a16_prefill.cu): bf16 x in token tiles of 128; the same bits as the other
// kernels. Same availability as the warpgroup kernel (WgmmaAvailable).
constexpr int kPrefillTileTokens = policy::kPrefillTileTokens;
// Groups 32 (bf16 scales) and 64 (bf16 or f32 scales).
bool PrefillSupports(int group, bool sc_f32);
// Scratch for the staged x of one token tile.
size_t PrefillStagedBytes(int steps);
// Stages x and runs the GEMM for token tiles [p.tile_offset, + token_tiles) of kPrefillTileTokens.
Status LaunchW4A16Prefill(GemmParams p, int group, int token_tiles, int sms, void* xs, cudaStream_t s);

}  // namespace w4a16
}  // namespace cuda
}  // namespace kdtree
