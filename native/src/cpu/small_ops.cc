// The CPU twins of the small ops (cuda/small_ops.cu): embedding, rmsNorm (with the fused residual
// add), rope, siluMul, add, argmax, topk, kvWrite, MLA's fused inputs (mlaInputs, mlaQuery) and
// arange. rmsNorm sums its squares in the cuda kernel's order (RmsSumOfSquares).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

namespace {

// A row's sum of squares in the cuda kernel's order (kRmsNormThreads, ops.h).
float RmsSumOfSquares(const float* x, int64_t h) {
  float part[kRmsNormThreads];
  const int64_t chunks = (h + 3) / 4;
  for (int t = 0; t < kRmsNormThreads; ++t) {
    float ss = 0.f;
    for (int64_t c = t; c < chunks; c += kRmsNormThreads) {
      for (int64_t j = 4 * c; j < std::min(4 * c + 4, h); ++j) ss = std::fma(x[j], x[j], ss);
    }
    part[t] = ss;
  }
  float total = 0.f;
  for (int w = 0; w < kRmsNormThreads / 32; ++w) {
    float* lanes = part + 32 * w;
    for (int off = 16; off > 0; off >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ off];
      std::copy(next, next + 32, lanes);
    }
    total += lanes[0];
  }
  return total;
}

// out[j] = x[j] / rms(x) * weight[j] (f32 math, stored in out's dtype), at element `at` of out,
// and of `copy` too when it is present (one sum of squares for both).
void NormRowInto(const float* x, int64_t h, const Tensor& weight, double eps, const Tensor& out, int64_t at, const Tensor* copy = nullptr) {
  const float inv = 1.f / std::sqrt(RmsSumOfSquares(x, h) / static_cast<float>(h) + static_cast<float>(eps));
  for (int64_t j = 0; j < h; ++j) {
    const float y = x[j] * inv * LoadF(weight, j);
    StoreF(out, at + j, y);
    if (copy != nullptr) StoreF(*copy, at + j, y);
  }
}

// Rotates `half` pairs of v at position pos, as Rope does (f64 angles and products).
void RotatePairs(float* v, double pos, const double* inv_freq, int64_t half, double factor, bool interleave) {
  for (int64_t i = 0; i < half; ++i) {
    const double angle = pos * inv_freq[i];
    const double c = std::cos(angle) * factor, s = std::sin(angle) * factor;
    const int64_t i0 = interleave ? 2 * i : i, i1 = interleave ? 2 * i + 1 : i + half;
    const double x0 = v[i0], x1 = v[i1];
    v[i0] = static_cast<float>(x0 * c - x1 * s);
    v[i1] = static_cast<float>(x1 * c + x0 * s);
  }
}
}  // namespace

Status Embedding(const EmbeddingArgs& a, ThreadPool& pool) {
  const int64_t v = a.table.dim(0), hdim = a.table.dim(1);
  for (int64_t i = 0; i < a.ids.dim(0); ++i) {
    const int32_t id = a.ids.as<const int32_t>()[i];
    if (id < 0 || id >= v) return Invalid("embedding: ids[", i, "] = ", id, " is outside the table's ", v, " rows");
    for (int64_t j = 0; j < hdim; ++j) a.out.as<float>()[i * hdim + j] = LoadF(a.table, id * hdim + j);
  }
  return Status::Ok();
}

Status RmsNorm(const RmsNormArgs& a, ThreadPool& pool) {
  const int64_t rows = a.x.dim(0), hdim = a.x.dim(1);
  pool.ParallelFor(rows, [&](int64_t b, int64_t e) {
    std::vector<float> sum;
    for (int64_t r = b; r < e; ++r) {
      const float* x = a.x.as<const float>() + r * hdim;
      if (a.residual.present()) {  // the fused residual add: x + residual, also stored to `sum`
        const float* res = a.residual.as<const float>() + r * hdim;
        sum.resize(static_cast<size_t>(hdim));
        for (int64_t j = 0; j < hdim; ++j) sum[j] = x[j] + res[j];
        std::copy(sum.begin(), sum.end(), a.sum.as<float>() + r * hdim);
        x = sum.data();
      }
      NormRowInto(x, hdim, a.weight, a.eps, a.out, r * hdim, a.out_bf16.present() ? &a.out_bf16 : nullptr);
    }
  });
  return Status::Ok();
}

Status Rope(const RopeArgs& a, ThreadPool& pool) {
  const int64_t t = a.x.dim(0), heads = a.x.dim(1), hd = a.x.dim(2), half = a.inv_freq.dim(0);
  for (int64_t ti = 0; ti < t; ++ti) {
    const double pos = a.positions.as<const int32_t>()[ti];
    for (int64_t hh = 0; hh < heads; ++hh) RotatePairs(a.x.as<float>() + (ti * heads + hh) * hd + a.offset, pos, a.inv_freq.as<const double>(), half, a.attention_factor, a.interleave);
  }
  return Status::Ok();
}

Status SiluMul(const SiluMulArgs& a, ThreadPool& pool) {
  const int64_t t = a.out.dim(0), inter = a.out.dim(1);
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t j = 0; j < inter; ++j) {
      StoreF(a.out, r * inter + j, SiluMulValue(LoadF(a.x, r * 2 * inter + j), LoadF(a.x, r * 2 * inter + inter + j)));
    }
  }
  return Status::Ok();
}

Status Add(const AddArgs& a, ThreadPool& pool) {
  for (int64_t i = 0; i < a.a.numel(); ++i) a.out.as<float>()[i] = a.a.as<const float>()[i] + a.b.as<const float>()[i];
  return Status::Ok();
}

Status Argmax(const ArgmaxArgs& a, ThreadPool& pool) {
  const int64_t t = a.x.dim(0), v = a.x.dim(1);
  for (int64_t r = 0; r < t; ++r) {
    const float* x = a.x.as<const float>() + r * v;
    int64_t best = 0;
    for (int64_t i = 1; i < v; ++i) if (x[i] > x[best]) best = i;
    a.out.as<int32_t>()[r] = static_cast<int32_t>(best);
  }
  return Status::Ok();
}

Status Topk(const TopkArgs& a, ThreadPool& pool) {
  const int64_t t = a.x.dim(0), v = a.x.dim(1);
  std::vector<int> order(static_cast<size_t>(v));
  for (int64_t r = 0; r < t; ++r) {
    const float* x = a.x.as<const float>() + r * v;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + a.k, order.end(), [&](int p, int q) { return x[p] > x[q] || (x[p] == x[q] && p < q); });
    for (int j = 0; j < a.k; ++j) {
      a.values.as<float>()[r * a.k + j] = x[order[j]];
      a.ids.as<int32_t>()[r * a.k + j] = order[j];
    }
  }
  return Status::Ok();
}

Status KvWrite(const KvWriteArgs& a, ThreadPool& pool) {
  const int64_t t = a.c.dim(0), r = a.c.dim(1), dr = a.kpe.dim(1), s = a.cache_c.dim(0);
  for (int64_t i = 0; i < t; ++i) {
    const int32_t slot = a.slots.as<const int32_t>()[i];
    if (slot < 0 || slot >= s) return Invalid("kv_write: slots[", i, "] = ", slot, " is outside the cache's ", s, " slots");
    for (int64_t j = 0; j < r; ++j) StoreF(a.cache_c, slot * r + j, a.c.as<const float>()[i * r + j]);
    for (int64_t j = 0; j < dr; ++j) StoreF(a.cache_kpe, slot * dr + j, a.kpe.as<const float>()[i * dr + j]);
  }
  return Status::Ok();
}

Status MlaInputs(const MlaInputsArgs& a, ThreadPool& pool) {
  const int64_t t = a.x.dim(0), w = a.x.dim(1), r = a.cache_c.dim(1), dr = a.cache_kpe.dim(1), s = a.cache_c.dim(0);
  const int64_t q = a.q_a_norm.present() ? a.q_a_norm.dim(0) : 0;
  std::vector<float> kpe(static_cast<size_t>(dr));
  for (int64_t i = 0; i < t; ++i) {
    const float* row = a.x.as<const float>() + i * w;
    if (q > 0) NormRowInto(row, q, a.q_a_norm, a.eps, a.q_a_out, i * q);
    const int32_t slot = a.slots.as<const int32_t>()[i];
    if (slot < 0 || slot >= s) return Invalid("mla_inputs: slots[", i, "] = ", slot, " is outside the cache's ", s, " slots");
    NormRowInto(row + w - r - dr, r, a.kv_a_norm, a.eps, a.cache_c, slot * r);
    std::copy(row + w - dr, row + w, kpe.begin());
    RotatePairs(kpe.data(), a.positions.as<const int32_t>()[i], a.inv_freq.as<const double>(), dr / 2, a.attention_factor, a.interleave);
    for (int64_t j = 0; j < dr; ++j) StoreF(a.cache_kpe, slot * dr + j, kpe[j]);
  }
  return Status::Ok();
}

Status MlaQuery(const MlaQueryArgs& a, ThreadPool& pool) {
  const int64_t t = a.x.dim(0), w = a.x.dim(1), h = a.q_nope.dim(1), dn = a.q_nope.dim(2), dr = a.q_pe.dim(2);
  for (int64_t i = 0; i < t; ++i) {
    const float* row = a.x.as<const float>() + i * w;
    std::copy(row, row + h * dn, a.q_nope.as<float>() + i * h * dn);
    float* pe = a.q_pe.as<float>() + i * h * dr;
    std::copy(row + h * dn, row + h * (dn + dr), pe);
    for (int64_t hh = 0; hh < h; ++hh) RotatePairs(pe + hh * dr, a.positions.as<const int32_t>()[i], a.inv_freq.as<const double>(), dr / 2, a.attention_factor, a.interleave);
  }
  return Status::Ok();
}

Status Arange(const ArangeArgs& a, ThreadPool& pool) {
  const int64_t start = a.start + (a.start_on_device.present() ? a.start_on_device.as<const int32_t>()[0] : 0);  // read before out is written: they may be one
  for (int64_t i = 0; i < a.out.dim(0); ++i) a.out.as<int32_t>()[i] = static_cast<int32_t>(start + i);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
