// What the `gemm` kernels share (16-bit weights as stored, gemm.cu): the launch parameters, the
// output store, and the warpgroup form's entry points (gemm_wgmma.cu, sm_90a only).
#pragma once
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace gemm {

constexpr int kChunkK = 32;  // k per chunk: a lane's 8 k of a row are one 16-byte load
constexpr int kTileRows = 16;

struct Params {
  const void* x;       // [M, K]
  const uint4* w;      // [N, K] as 16-byte units
  void* y;             // [M, N]
  DType y_dtype;
  int M, N, K;
  int chunks;          // ceil(K / 32)
  int ranges, range_chunks;
  int tiles;           // ceil(N / 16)
  int token_tile0;     // the launch's first token tile
  float* partials;     // split and tiled forms across blocks: [token tiles of the launch][tiles][ranges][NT * 4][32]
  int* counters;       // [token tiles of the launch][tiles], zero between launches
};

// Element i of token tile j of a lane: token 8 j + 2 t + (i & 1), row g + 8 (i >> 1) of the tile.
__device__ __forceinline__ void StoreOut(const Params& p, float v, int tile, int token0, int j, int i, int lane) {
  const int token = token0 + 8 * j + 2 * (lane & 3) + (i & 1), n = tile * kTileRows + (lane >> 2) + 8 * (i >> 1);
  if (token < p.M && n < p.N) StoreFromF32(p.y, p.y_dtype, static_cast<int64_t>(token) * p.N + n, v);
}

// The warpgroup form (gemm_wgmma.cu): 16-bit x and weights of one type, blocks of 128 weight
// rows x 128 tokens (two MMA warpgroups and a copy warpgroup).
constexpr int kWgmmaRows = 128;
constexpr int kWgmmaTokens = 128;
// Whether this binary and device run it (sm_90a machine code).
bool WgmmaAvailable();
// Whether its block fits the shape: a thread's copy offsets within 128 rows are 32-bit.
inline bool WgmmaFits(const Params& p) { return int64_t{kWgmmaRows} * p.K * 2 < (int64_t{1} << 32); }
// Scratch for one token tile's x staged in its B-operand order.
size_t WgmmaStagedBytes(const Params& p);
// Stages x and runs token tiles [p.token_tile0, + token_tiles) of kWgmmaTokens; xs holds
// WgmmaStagedBytes per token tile.
Status LaunchWgmma(const Params& p, bool f16, int token_tiles, void* xs, cudaStream_t s);

}  // namespace gemm
}  // namespace cuda
}  // namespace kdtree
