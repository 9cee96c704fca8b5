// The CPU twins of the W4A16 GEMMs (cuda/w4a16_gemm.cu and its warpgroup and prefill forms):
// w4a16Gemm and moeGemm with packed INT4 experts. A packed tile is unpacked back to row order once
// per call and reused for every row (or every pair of its expert); each output is W4Dot, which
// groups the sum as the cuda kernels do (per scale group, then scaled).
#include <algorithm>
#include <map>
#include <vector>

#include "common.h"
#include "kdtree/w4a16_layout.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

namespace {

// One 16-row tile of a packed W4A16 matrix (w4a16_layout.h) back in row order: codes q = u - 8
// [16][K] and f32 scales [16][K/G]. Rows past N come out as zeros (the packing's padding).
struct W4Tile {
  std::vector<int8_t> q;
  std::vector<float> s;
};

void UnpackW4Tile(const int32_t* qwp, const Tensor& scp, int64_t sc_offset, int64_t k, int group, W4Tile* out) {
  const int64_t steps = w4::Steps(k), groups = k / group;
  out->q.assign(static_cast<size_t>(w4::kTileRows * k), 0);
  out->s.assign(static_cast<size_t>(w4::kTileRows * groups), 0.f);
  for (int64_t st = 0; st < steps; ++st) {
    for (int word = 0; word < w4::kWordsPerStep; ++word) {
      const uint32_t w = static_cast<uint32_t>(qwp[st * w4::kWordsPerStep + word]);
      const int row = w4::WordRow(word), t = w4::WordLaneT(word);
      for (int p = 0; p < 8; ++p) {
        const int64_t kk = st * w4::kStepK + 32 * w4::WordBlock(word) + w4::NibbleK(t, p);
        if (kk < k) out->q[row * k + kk] = static_cast<int8_t>(static_cast<int>((w >> (4 * p)) & 0xF) - 8);
      }
    }
  }
  for (int64_t b = 0; b < w4::ScaleBlocks(k, group); ++b) {
    for (int slot = 0; slot < w4::kScalesPerBlock; ++slot) {
      const int64_t grp = 4 * b + w4::ScaleGroup(slot);
      if (grp < groups) out->s[w4::ScaleRow(slot) * groups + grp] = LoadF(scp, sc_offset + b * w4::kScalesPerBlock + slot);
    }
  }
}

// dot(x_row, dequant(W row)) with the CUDA kernels' grouping: per group the f32 sum of x * q,
// then scaled; groups accumulate in f32, in order.
float W4Dot(const float* x, const int8_t* q, const float* scales, int64_t k, int group) {
  float acc = 0.f;
  for (int64_t g = 0; g < k / group; ++g) {
    float part = 0.f;
    for (int64_t j = g * group; j < (g + 1) * group; ++j) part += x[j] * static_cast<float>(q[j]);
    acc = std::fma(part, scales[g], acc);
  }
  return acc;
}

// Row `row` of y from the 16 rows of packed tile `ti` (rows past y's width dropped): as they are,
// or with the SiLU epilogue (a gate_up tile) y[row, 8 ti + r] = silu(rows[r]) * rows[8 + r].
void StoreTileRow(const Tensor& y, int64_t row, int64_t ti, const float* rows, bool silu) {
  const int64_t width = y.dim(1);
  if (!silu) {
    for (int r = 0; r < w4::kTileRows && ti * w4::kTileRows + r < width; ++r) StoreF(y, row * width + ti * w4::kTileRows + r, rows[r]);
    return;
  }
  for (int r = 0; r < 8 && ti * 8 + r < width; ++r) StoreF(y, row * width + ti * 8 + r, SiluMulValue(RoundTo(y.dtype, rows[r]), RoundTo(y.dtype, rows[8 + r])));
}
}  // namespace

Status W4A16Gemm(const W4A16GemmArgs& a, ThreadPool& pool) {
  const int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.y.dim(1);
  const bool silu = a.epilogue == Epilogue::kSiluMul;
  const std::vector<float> x = LoadAll(a.x);
  pool.ParallelFor(w4::Tiles(WeightRows(a.y, a.epilogue)), [&](int64_t b, int64_t e) {
    W4Tile tile;
    float rows[w4::kTileRows];
    for (int64_t ti = b; ti < e; ++ti) {
      UnpackW4Tile(a.qw.as<const int32_t>() + ti * w4::Steps(k) * w4::kWordsPerStep, a.sc, ti * w4::ScaleBlocks(k, a.group) * w4::kScalesPerBlock, k, a.group, &tile);
      for (int64_t row = 0; row < m; ++row) {
        for (int r = 0; r < w4::kTileRows; ++r) rows[r] = W4Dot(&x[row * k], &tile.q[r * k], &tile.s[r * (k / a.group)], k, a.group);
        StoreTileRow(a.y, row, ti, rows, silu);
      }
    }
  });
  return Status::Ok();
}

Status MoeGemm(const MoeGemmArgs& a, ThreadPool& pool) {
  const int64_t e_count = a.qw.dim(0), k = a.x.dim(1), t = a.ids.dim(0), topk = a.ids.dim(1);
  const bool silu = a.epilogue == Epilogue::kSiluMul;
  const int64_t n = WeightRows(a.y, a.epilogue);
  const int32_t* ids = a.ids.as<const int32_t>();
  KDTREE_RETURN_IF_ERROR(CheckExpertIds(a.ids, e_count));
  const std::vector<float> x = LoadAll(a.x);
  const int64_t tiles = w4::Tiles(n), q_tile = w4::Steps(k) * w4::kWordsPerStep, s_tile = w4::ScaleBlocks(k, a.group) * w4::kScalesPerBlock;
  const int64_t pairs = t * topk, groups = k / a.group;
  std::map<int64_t, std::vector<int64_t>> pairs_of;  // expert -> its (token, slot) pairs, in order
  for (int64_t p = 0; p < pairs; ++p) pairs_of[ids[p]].push_back(p);
  pool.ParallelFor(tiles, [&](int64_t b, int64_t end) {
    W4Tile tile;
    std::vector<float> out(static_cast<size_t>(pairs * w4::kTileRows));  // [pair][row in tile]
    for (int64_t ti = b; ti < end; ++ti) {
      const int rows = silu ? w4::kTileRows : static_cast<int>(std::min<int64_t>(w4::kTileRows, n - ti * w4::kTileRows));
      for (const auto& [e, expert_pairs] : pairs_of) {  // each used expert's tile unpacked once
        UnpackW4Tile(a.qw.as<const int32_t>() + (e * tiles + ti) * q_tile, a.sc, (e * tiles + ti) * s_tile, k, a.group, &tile);
        for (const int64_t p : expert_pairs) {
          const float* xr = &x[(a.mode == MoeMode::kGather ? p / topk : p) * k];
          for (int r = 0; r < rows; ++r) out[p * w4::kTileRows + r] = W4Dot(xr, &tile.q[r * k], &tile.s[r * groups], k, a.group);
        }
      }
      if (a.mode == MoeMode::kGather) {
        for (int64_t p = 0; p < pairs; ++p) StoreTileRow(a.y, p, ti, &out[p * w4::kTileRows], silu);
        continue;
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t col = ti * w4::kTileRows + r;
        for (int64_t tok = 0; tok < t; ++tok) {
          float acc = 0.f;
          for (int64_t j = 0; j < topk; ++j) acc = std::fma(a.weights.as<const float>()[tok * topk + j], out[(tok * topk + j) * w4::kTileRows + r], acc);
          StoreF(a.y, tok * n + col, acc);
        }
      }
    }
  });
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
