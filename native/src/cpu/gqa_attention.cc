// The CPU twin of gqaAttention (cuda/gqa_attention.cu), non-causal GQA attention: for query
// token t and head h (KV head h / (Hq / Hkv)),
//   keys = [context rows 0..context_length of the cache; the block's T rows]
//   out[t, h] = softmax(q . k^T * scale) . v
// in f32 with a fixed order per output (scores in key order, the max subtracted, the sum of the
// exponentials, then the weighted values in key order), so results do not depend on the threads.
#include "twins.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/half.h"

namespace kdtree {
namespace cpu {
namespace {

// Row `row` of a [rows, Hkv, D] tensor at KV head `head`, as f32 (widened into `scratch` for bf16).
const float* HeadRow(const Tensor& t, int64_t row, int64_t head, std::vector<float>& scratch) {
  const int64_t hkv = t.dim(1), d = t.dim(2);
  const int64_t at = (row * hkv + head) * d;
  if (t.dtype == DType::kF32) return t.as<const float>() + at;
  scratch.resize(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) scratch[i] = Bf16ToF32(t.as<const uint16_t>()[at + i]);
  return scratch.data();
}

}  // namespace

Status GqaAttention(const GqaAttentionArgs& a, ThreadPool& pool) {
  const int64_t t = a.q.dim(0), hq = a.q.dim(1), d = a.q.dim(2), hkv = a.k.dim(1);
  // a length on the device is read now (a replayed capture), clamped to its bound as on cuda
  const int64_t ctx = a.context_length_on_device.present() ? std::clamp<int64_t>(a.context_length_on_device.as<const int32_t>()[0], 0, a.context_length) : a.context_length;
  const int64_t keys = ctx + t, group = hq / hkv;
  const float scale = static_cast<float>(a.scale);
  pool.ParallelFor(t * hq, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(keys)), acc(static_cast<size_t>(d)), row;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ti = item / hq, head = item % hq, kv = head / group;
      const float* q = a.q.as<const float>() + item * d;
      float mx = -INFINITY;
      for (int64_t s = 0; s < keys; ++s) {
        const float* k = s < ctx ? HeadRow(a.k_cache, s, kv, row) : HeadRow(a.k, s - ctx, kv, row);
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot = std::fma(q[i], k[i], dot);
        scores[s] = dot * scale;
        mx = std::max(mx, scores[s]);
      }
      float sum = 0.f;
      for (float& s : scores) sum += (s = std::exp(s - mx));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < keys; ++s) {
        const float p = scores[s] / sum;
        const float* v = s < ctx ? HeadRow(a.v_cache, s, kv, row) : HeadRow(a.v, s - ctx, kv, row);
        for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p, v[i], acc[i]);
      }
      const int64_t out = (ti * hq + head) * d;
      for (int64_t i = 0; i < d; ++i) {
        if (a.out.dtype == DType::kF32) a.out.as<float>()[out + i] = acc[i];
        else a.out.as<uint16_t>()[out + i] = F32ToBf16(acc[i]);
      }
    }
  });
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
