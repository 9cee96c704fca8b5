// The CPU twin of w4a16Pack (cuda/w4a16_pack.cu): checkpoint INT4 codes and scales into the
// packed tile layout of kdtree/w4a16_layout.h, bit for bit what the cuda kernel writes.
#include <cstring>

#include "common.h"
#include "kdtree/w4a16_layout.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

// Checkpoint -> packed, one output word (or scale) at a time: a gather, so every padding slot is
// written too.
void W4A16Pack(const W4A16PackArgs& a, ThreadPool& pool) {
  const int lead = a.qw.rank() - 2;
  const int64_t experts = lead ? a.qw.dim(0) : 1, n = a.qw.dim(lead), k = a.qw.dim(lead + 1) * 8, group = a.group;
  const int64_t tiles = w4::Tiles(n), steps = w4::Steps(k), blocks = w4::ScaleBlocks(k, a.group), groups = k / group;
  const int32_t* qw = a.qw.as<const int32_t>();
  int32_t* qwp = a.qw_packed.as<int32_t>();
  const int esize = DTypeSize(a.sc.dtype);
  pool.ParallelFor(experts * tiles, [&](int64_t begin, int64_t end) {
    for (int64_t et = begin; et < end; ++et) {
      const int64_t e = et / tiles, tile = et % tiles;
      for (int64_t st = 0; st < steps; ++st) {
        for (int word = 0; word < w4::kWordsPerStep; ++word) {
          const int64_t row = w4::PackedSourceRow(tile * w4::kTileRows + w4::WordRow(word), n, a.gate_up);
          uint32_t v = 0;
          for (int p = 0; p < 8; ++p) {
            const int64_t kk = st * w4::kStepK + 32 * w4::WordBlock(word) + w4::NibbleK(w4::WordLaneT(word), p);
            uint32_t code = 8;
            if (row >= 0 && kk < k) code = (static_cast<uint32_t>(qw[(e * n + row) * (k / 8) + kk / 8]) >> (4 * (kk % 8))) & 0xF;
            v |= code << (4 * p);
          }
          qwp[(et * steps + st) * w4::kWordsPerStep + word] = static_cast<int32_t>(v);
        }
      }
      for (int64_t b = 0; b < blocks; ++b) {
        for (int slot = 0; slot < w4::kScalesPerBlock; ++slot) {
          const int64_t row = w4::PackedSourceRow(tile * w4::kTileRows + w4::ScaleRow(slot), n, a.gate_up), grp = 4 * b + w4::ScaleGroup(slot);
          char* dst = static_cast<char*>(a.sc_packed.data) + ((et * blocks + b) * w4::kScalesPerBlock + slot) * esize;
          if (row >= 0 && grp < groups) std::memcpy(dst, static_cast<const char*>(a.sc.data) + ((e * n + row) * groups + grp) * esize, esize);
          else std::memset(dst, 0, esize);
        }
      }
    }
  });
}

}  // namespace cpu
}  // namespace kdtree
