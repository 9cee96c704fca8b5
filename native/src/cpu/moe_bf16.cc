// The CPU twin of moeGemm with bf16 experts as stored (cuda/moe_bf16.cu): every (pair, weight row)
// one dot product in the cuda warp's order (WarpOrderDot), so both backends give the same bits.
#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "common.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

namespace {

// dot(x, w) over k (a multiple of 8) in the order of the cuda bf16 MoE GEMM's warp (moe_bf16.cu):
// lane l sums chunks of 8 k, l, l + 32, ..., one FMA after another; the 32 lane sums meet in an
// xor butterfly. The same bits on both backends, and for a row whatever else is in the call.
float WarpOrderDot(const float* x, const float* w, int64_t k) {
  float lanes[32];
  for (int l = 0; l < 32; ++l) {
    float acc = 0.f;
    for (int64_t c = 8 * l; c < k; c += 8 * 32) {
      for (int j = 0; j < 8; ++j) acc = std::fma(x[c + j], w[c + j], acc);
    }
    lanes[l] = acc;
  }
  for (int off = 16; off > 0; off >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ off];
    std::copy(next, next + 32, lanes);
  }
  return lanes[0];
}
}  // namespace

// bf16 experts as stored: every (pair, row) one WarpOrderDot; each used expert's row widened
// once per call.
Status MoeGemmBf16(const MoeGemmArgs& a, ThreadPool& pool) {
  const int64_t experts = a.w.dim(0), n = a.w.dim(1), k = a.x.dim(1), t = a.ids.dim(0), topk = a.ids.dim(1), pairs = t * topk;
  KDTREE_RETURN_IF_ERROR(CheckExpertIds(a.ids, experts));
  const std::vector<float> x = LoadAll(a.x);
  const int32_t* ids = a.ids.as<const int32_t>();
  std::map<int64_t, std::vector<int64_t>> pairs_of;  // expert -> its (token, slot) pairs
  for (int64_t p = 0; p < pairs; ++p) pairs_of[ids[p]].push_back(p);
  std::vector<float> out(static_cast<size_t>(pairs * n));  // [pair][weight row], f32
  pool.ParallelFor(n, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(k));
    for (int64_t row = begin; row < end; ++row) {
      for (const auto& [e, expert_pairs] : pairs_of) {
        for (int64_t i = 0; i < k; ++i) w[i] = LoadF(a.w, (e * n + row) * k + i);
        for (const int64_t p : expert_pairs) out[p * n + row] = WarpOrderDot(&x[(a.mode == MoeMode::kGather ? p / topk : p) * k], w.data(), k);
      }
    }
  }, std::max<int64_t>(1, 4096 / k));
  const int64_t cols = a.y.dim(1);
  if (a.mode == MoeMode::kSum) {
    for (int64_t tok = 0; tok < t; ++tok) {
      for (int64_t col = 0; col < cols; ++col) {
        float acc = 0.f;
        for (int64_t j = 0; j < topk; ++j) acc = std::fma(a.weights.as<const float>()[tok * topk + j], out[(tok * topk + j) * n + col], acc);
        StoreF(a.y, tok * cols + col, acc);
      }
    }
  } else if (a.epilogue == Epilogue::kSiluMul) {  // rows [gate; up]: column j from rows j and I + j
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t j = 0; j < cols; ++j) StoreF(a.y, p * cols + j, SiluMulValue(RoundTo(a.y.dtype, out[p * n + j]), RoundTo(a.y.dtype, out[p * n + cols + j])));
    }
  } else {
    for (int64_t i = 0; i < pairs * n; ++i) StoreF(a.y, i, out[i]);
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
