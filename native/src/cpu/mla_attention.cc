// The CPU twin of mlaAttention (cuda/mla_attention.cu and its stages), per (token, head) row:
//   q_lat = W_kb^T q_nope; scores over the committed slots and the new tokens the row sees (the
//   mask, or causal); softmax; ctx = sum p c; out = W_vb ctx
// in f32 with one order per output. The cuda stages cut the keys into chunks and merge them, so
// their roundings differ from these.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

Status MlaAttention(const MlaAttentionArgs& a, ThreadPool& pool) {
  int64_t base = a.base;
  if (a.base_on_device.present()) {
    base = a.base_on_device.as<const int32_t>()[0];
    if (base < 0 || base > a.base) return Invalid("mla_attention: baseOnDevice holds ", base, ", outside [0, base = ", a.base, "] (base bounds it)");
  }
  const int64_t t = a.q_nope.dim(0), h = a.q_nope.dim(1), dn = a.q_nope.dim(2), dr = a.q_pe.dim(2);
  const int64_t r = a.cache_c.dim(1), dv = a.out.dim(2);
  const bool masked = a.mask.present();
  pool.ParallelFor(t * h, [&](int64_t b, int64_t e) {
    std::vector<float> q_lat(static_cast<size_t>(r)), ctx(static_cast<size_t>(r)), scores, c_row, kpe_row;
    std::vector<int64_t> keys;
    for (int64_t item = b; item < e; ++item) {
      const int64_t ti = item / h, hi = item % h;
      const float* qn = a.q_nope.as<const float>() + (ti * h + hi) * dn;
      const float* qp = a.q_pe.as<const float>() + (ti * h + hi) * dr;
      const int64_t kb = hi * (dn + dv);  // this head's rows of kv_b: [dn rows of W_kb, dv rows of W_vb]
      for (int64_t j = 0; j < r; ++j) {
        float s = 0.f;
        for (int64_t i = 0; i < dn; ++i) s = std::fma(qn[i], LoadF(a.kv_b, (kb + i) * r + j), s);
        q_lat[j] = s;
      }
      keys.clear();
      for (int64_t s = 0; s < base; ++s) keys.push_back(s);
      for (int64_t j = 0; j < t; ++j) {
        if (masked ? a.mask.as<const uint8_t>()[ti * t + j] != 0 : j <= ti) keys.push_back(base + j);
      }
      scores.assign(keys.size(), 0.f);
      float mx = -INFINITY;
      for (size_t i = 0; i < keys.size(); ++i) {
        const float* c = RowAsF32(a.cache_c, keys[i], c_row);
        const float* kp = RowAsF32(a.cache_kpe, keys[i], kpe_row);
        float s = 0.f;
        for (int64_t j = 0; j < r; ++j) s = std::fma(q_lat[j], c[j], s);
        for (int64_t j = 0; j < dr; ++j) s = std::fma(qp[j], kp[j], s);
        scores[i] = s * static_cast<float>(a.scale);
        mx = std::max(mx, scores[i]);
      }
      float sum = 0.f;
      for (float& s : scores) sum += (s = std::exp(s - mx));
      std::fill(ctx.begin(), ctx.end(), 0.f);
      for (size_t i = 0; i < keys.size(); ++i) {
        const float p = scores[i] / sum;
        const float* c = RowAsF32(a.cache_c, keys[i], c_row);
        for (int64_t j = 0; j < r; ++j) ctx[j] = std::fma(p, c[j], ctx[j]);
      }
      const int64_t out = (ti * h + hi) * dv;
      for (int64_t v = 0; v < dv; ++v) {
        float s = 0.f;
        for (int64_t j = 0; j < r; ++j) s = std::fma(LoadF(a.kv_b, (kb + dn + v) * r + j), ctx[j], s);
        StoreF(a.out, out + v, s);
      }
    }
  });
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
