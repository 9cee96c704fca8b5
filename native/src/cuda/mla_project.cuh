// The CUDA-core MLA output projection's device pieces, out[t, h, v] = W_vb[h, v, :] . ctx[t, h, :]
// (W_vb[h] = kv_b rows h (dn + dv) + dn .. + dv - 1, [dv, R], bf16 or f32): run by the few-row
// projection kernel (mla_project.cu) and inside the many-row merge (mla_merge.cu), so a row's
// output has one order whichever runs it. A bf16 kv_b in whole 32-value blocks takes the
// tensor-core pieces instead (mla_project_mma.cuh).
#pragma once
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace mla {

// Eight consecutive values of a bf16 or f32 tensor (kv_b's dtypes) from element i (16-byte
// aligned) as f32.
__device__ __forceinline__ void Load8AsF32(const void* p, DType t, int64_t i, float (&v)[8]) {
  if (t == DType::kF32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p) + i)), b = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p) + i) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
  const uint4 q = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i));
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
  }
}

// out[g][v] = W_vb[h, v] . ctx[g] for the `rows` (<= G) rows of one head (ctx [G][R], out rows
// out_stride apart) and v in [v_begin, v_end), one warp per v at a time. Each W_vb value is loaded
// once for all the rows, and each row's sum has the one-row order (a lane's FMA chain over its r,
// then the xor tree), so a row's bits do not depend on G.
template <int G>
__device__ __forceinline__ void ProjectOut(const float* ctx, int rows, const void* kv_b, DType kvb_dtype, bool vector_rows, int h, int R, int dn, int dv, int v_begin, int v_end,
                                           OutRows out, int64_t out_stride) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int v = v_begin + warp; v < v_end; v += blockDim.x / 32) {
    const int64_t row = static_cast<int64_t>(h * (dn + dv) + dn + v) * R;
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    if (vector_rows) {
      // 8 values per lane and load (16 bytes of bf16): a 512-wide row in two loads per lane
      // instead of 16 dependent 2-byte ones
      for (int r = 8 * lane; r < R; r += 256) {
        float w[8];
        Load8AsF32(kv_b, kvb_dtype, row + r, w);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g >= rows) continue;
          const float4 c0 = *reinterpret_cast<const float4*>(ctx + g * R + r), c1 = *reinterpret_cast<const float4*>(ctx + g * R + r + 4);
          const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) s[g] = fmaf(w[i], c[i], s[g]);
        }
      }
    } else {
      for (int r = lane; r < R; r += 32) {
        const float w = LoadAsF32(kv_b, kvb_dtype, row + r);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g < rows) s[g] = fmaf(w, ctx[g * R + r], s[g]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= rows) continue;  // rows is block-uniform
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], off);
      if (lane == 0) out.Store(g * out_stride + v, s[g]);
    }
  }
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
