// What the CPU twins share: a tensor element as f32 and back (the dtypes' roundings as the cuda
// kernels round), and the checks more than one op family makes.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/half.h"
#include "kdtree/status.h"
#include "kdtree/tensor.h"

namespace kdtree {
namespace cpu {

inline float LoadF(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32: return t.as<const float>()[i];
    case DType::kBF16: return Bf16ToF32(t.as<const uint16_t>()[i]);
    case DType::kF16: return F16ToF32(t.as<const uint16_t>()[i]);
    case DType::kF64: return static_cast<float>(t.as<const double>()[i]);
    default: return 0.f;
  }
}

// Row `row` of a 2-D f32 or bf16 tensor (a latent cache) as f32: the row itself, or its values
// widened into `scratch`.
inline const float* RowAsF32(const Tensor& t, int64_t row, std::vector<float>& scratch) {
  const int64_t w = t.dim(1);
  if (t.dtype == DType::kF32) return t.as<const float>() + row * w;
  scratch.resize(static_cast<size_t>(w));
  for (int64_t j = 0; j < w; ++j) scratch[j] = LoadF(t, row * w + j);
  return scratch.data();
}

inline std::vector<float> LoadAll(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = LoadF(t, i);
  return v;
}

inline void StoreF(const Tensor& t, int64_t i, float v) {
  switch (t.dtype) {
    case DType::kF32: t.as<float>()[i] = v; break;
    case DType::kBF16: t.as<uint16_t>()[i] = F32ToBf16(v); break;
    case DType::kF16: t.as<uint16_t>()[i] = F32ToF16(v); break;
    default: break;
  }
}

// v as a tensor of `dtype` holds it (rounded to nearest even for bf16 and f16).
inline float RoundTo(DType dtype, float v) {
  switch (dtype) {
    case DType::kBF16: return Bf16ToF32(F32ToBf16(v));
    case DType::kF16: return F16ToF32(F32ToF16(v));
    default: return v;
  }
}

// silu(g) * u as silu_mul computes it (the W4A16 SiLU epilogue too, on gate and up rounded to its
// output's dtype, so that fused and unfused give the same bits).
inline float SiluMulValue(float g, float u) { return g / (1.f + std::exp(-g)) * u; }

// ids[t, j] in [0, experts): the cuda kernels skip the others, the twin rejects them.
inline Status CheckExpertIds(const Tensor& ids, int64_t experts) {
  const int64_t pairs = ids.numel(), topk = ids.dim(1);
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t id = ids.as<const int32_t>()[i];
    if (id < 0 || id >= experts) return Invalid("moe_gemm: ids[", i / topk, ", ", i % topk, "] = ", id, " is not an expert in [0, ", experts, ")");
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
