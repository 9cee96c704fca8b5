// Checkpoint -> packed W4A16 layout (w4a16_layout.h), once per weight at load time. A gather: one
// thread per packed word (8 codes) or packed scale, so padding slots are written too and the
// writes are coalesced; the reads hit two 32-byte pieces of a checkpoint row per word.
#include "common.cuh"
#include "kdtree/w4a16_layout.h"

namespace kdtree {
namespace cuda {
namespace {

struct PackShape {
  int64_t experts, n, k, tiles, steps, blocks, groups;
  bool gate_up;
};

__global__ void PackCodesKernel(const uint32_t* qw, uint32_t* qwp, PackShape s) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_tile = s.steps * w4::kWordsPerStep;
  if (i >= s.experts * s.tiles * per_tile) return;
  const int64_t et = i / per_tile, e = et / s.tiles, tile = et % s.tiles;
  const int64_t st = (i % per_tile) / w4::kWordsPerStep;
  const int word = static_cast<int>(i % w4::kWordsPerStep);
  const int64_t row = w4::PackedSourceRow(tile * w4::kTileRows + w4::WordRow(word), s.n, s.gate_up);
  const int t = w4::WordLaneT(word);
  const int64_t k0 = st * w4::kStepK + 32 * w4::WordBlock(word);
  uint32_t v = 0;
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    const int64_t kk = k0 + w4::NibbleK(t, p);
    uint32_t code = 8;  // q = 0
    if (row >= 0 && kk < s.k) code = (qw[(e * s.n + row) * (s.k / 8) + kk / 8] >> (4 * (kk % 8))) & 0xFu;
    v |= code << (4 * p);
  }
  qwp[i] = v;
}

template <typename S>
__global__ void PackScalesKernel(const S* sc, S* scp, PackShape s) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_tile = s.blocks * w4::kScalesPerBlock;
  if (i >= s.experts * s.tiles * per_tile) return;
  const int64_t et = i / per_tile, e = et / s.tiles, tile = et % s.tiles;
  const int slot = static_cast<int>(i % w4::kScalesPerBlock);
  const int64_t row = w4::PackedSourceRow(tile * w4::kTileRows + w4::ScaleRow(slot), s.n, s.gate_up);
  const int64_t grp = 4 * ((i % per_tile) / w4::kScalesPerBlock) + w4::ScaleGroup(slot);
  scp[i] = row >= 0 && grp < s.groups ? sc[(e * s.n + row) * s.groups + grp] : S(0);
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace

Status LaunchW4A16Pack(const W4A16PackArgs& a, cudaStream_t stream) {
  const int lead = a.qw.rank() - 2;
  PackShape s;
  s.experts = lead ? a.qw.dim(0) : 1;
  s.n = a.qw.dim(lead);
  s.k = a.qw.dim(lead + 1) * 8;
  s.tiles = w4::Tiles(s.n);
  s.steps = w4::Steps(s.k);
  s.blocks = w4::ScaleBlocks(s.k, a.group);
  s.groups = s.k / a.group;
  s.gate_up = a.gate_up;
  const int64_t words = s.experts * s.tiles * s.steps * w4::kWordsPerStep;
  const int64_t scales = s.experts * s.tiles * s.blocks * w4::kScalesPerBlock;
  if (words == 0) return Status::Ok();
  PackCodesKernel<<<Blocks(words), 256, 0, stream>>>(a.qw.as<const uint32_t>(), a.qw_packed.as<uint32_t>(), s);
  KDTREE_RETURN_IF_ERROR(LaunchStatus("w4a16 pack codes"));
  if (a.sc.dtype == DType::kF32) {
    PackScalesKernel<float><<<Blocks(scales), 256, 0, stream>>>(a.sc.as<const float>(), a.sc_packed.as<float>(), s);
  } else {
    PackScalesKernel<uint16_t><<<Blocks(scales), 256, 0, stream>>>(a.sc.as<const uint16_t>(), a.sc_packed.as<uint16_t>(), s);
  }
  return LaunchStatus("w4a16 pack scales");
}

}  // namespace cuda
}  // namespace kdtree
