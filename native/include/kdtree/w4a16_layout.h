// The packed W4A16 weight layout ("kdtree tiled int4", v2) that the GEMM kernels read. The
// checkpoint layout (compressed-tensors pack-quantized: qw[N, K/8] int32, 8 codes per word along K,
// sc[N, K/G]) is repacked once at load time (op w4a16_pack) so that at decode, where the GEMM is a
// pure weight stream, each lane of a warp fetches exactly its tensor-core A fragments with two
// 16-byte loads per 128 k, and a warp's loads are 512 contiguous bytes.
//
// W rows are the M side of mma.m16n8k16 (16 rows per tile), tokens the N side (8 per MMA), so one
// token wastes nothing on the weight side. The packed tensors, per matrix (MoE: a leading E):
//   qw_packed i32 [Tiles(N), Steps(K), 256]: per (tile, step) [2 row halves h][32 lanes][4 blocks b]
//     word (h, lane, b) holds the 8 codes of row 16 tile + lane/4 + 8 h at k = 128 step + 32 b +
//     NibbleK(lane % 4, p) in nibble p (0..7): nibbles p and p + 4 are the (k, k + 1) pair of one
//     bf16x2 A register, so one LOP3 per pair makes the MMA operand.
//   sc_packed [Tiles(N), ScaleBlocks(K, G), 64] (sc's dtype): per (tile, block of 4 groups)
//     [8 row pairs r][2 row halves h][4 groups q] = scale(row 16 tile + r + 8 h, group 4 block + q):
//     the 8 scales a lane needs (its two rows, 4 groups) are one 16-byte load (32 in f32).
// Rows past N and k past K are padding: code 8 (q = 0) and scale 0, so they add exact zeros.
// With that k order, a lane's B fragment (x) for k16 slice s of block b is x[k0 .. k0 + 3] with
// k0 = 128 step + 32 b + 8 (lane % 4) + 4 s: both slices of a block are one 16-byte load of the
// activations as they are (v1 had k0 = ... + 16 s + 4 (lane % 4): an 8-byte load per slice, twice
// the load instructions, and at 2-8 tokens read in place twice the L1 wavefronts).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define KDTREE_HOST_DEVICE __host__ __device__
#else
#define KDTREE_HOST_DEVICE
#endif

namespace kdtree {
namespace w4 {

constexpr int kTileRows = 16;         // W rows per tile: the M side of one MMA
constexpr int kStepK = 128;           // k per step: 4 blocks of 32
constexpr int kWordsPerStep = 256;    // [2 row halves][32 lanes][4 blocks]
constexpr int kScalesPerBlock = 64;   // [8 row pairs][2 row halves][4 groups]
constexpr int kLayoutVersion = 2;

KDTREE_HOST_DEVICE inline int64_t Tiles(int64_t n) { return (n + kTileRows - 1) / kTileRows; }
KDTREE_HOST_DEVICE inline int64_t Steps(int64_t k) { return (k + kStepK - 1) / kStepK; }
KDTREE_HOST_DEVICE inline int64_t ScaleBlocks(int64_t k, int group) { return (Steps(k) * (kStepK / group) + 3) / 4; }

// k offset inside a 32-k block of nibble p of the word of the lane with lane % 4 == t.
KDTREE_HOST_DEVICE inline int NibbleK(int t, int p) {
  const int i = p & 3;
  return 8 * t + 4 * (i >> 1) + 2 * (i & 1) + (p >> 2);
}

// Word index inside a (tile, step) of (row half h, lane, block b), and the row/k it covers.
KDTREE_HOST_DEVICE inline int WordIndex(int h, int lane, int b) { return (h * 32 + lane) * 4 + b; }
KDTREE_HOST_DEVICE inline int WordRow(int word) { return (word >> 2 & 31) / 4 + 8 * (word >> 7); }  // row in the tile
KDTREE_HOST_DEVICE inline int WordLaneT(int word) { return (word >> 2) & 3; }
KDTREE_HOST_DEVICE inline int WordBlock(int word) { return word & 3; }

// The checkpoint row behind packed row `row` of a matrix of n rows, or -1 for padding. gate_up
// (n = 2I: gate rows, then up rows, packed for the SiLU epilogue): tile t holds gate rows 8t ..
// 8t + 7, then the same up rows, so the lane holding an MMA row g also holds its up row g + 8.
KDTREE_HOST_DEVICE inline int64_t PackedSourceRow(int64_t row, int64_t n, bool gate_up) {
  if (!gate_up) return row < n ? row : -1;
  const int64_t inter = n / 2, j = row / kTileRows * 8 + row % 8;
  return j >= inter ? -1 : row % kTileRows < 8 ? j : inter + j;
}

// Scale slot inside a (tile, block) -> row in the tile and group offset inside the block.
KDTREE_HOST_DEVICE inline int ScaleRow(int slot) { return (slot >> 3) + 8 * ((slot >> 2) & 1); }
KDTREE_HOST_DEVICE inline int ScaleGroup(int slot) { return slot & 3; }

}  // namespace w4
}  // namespace kdtree
