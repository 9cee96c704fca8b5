// The small ops of a forward pass: embedding, RMSNorm, RoPE/YaRN, SiLU-and-multiply, residual
// add, argmax and top-k, the latent-cache write and MLA's fused inputs (the MoE router:
// moe_router.cu). Reductions use fixed trees
// (no atomics), so every result is deterministic and independent of the batch.
#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

// Block-wide sum in a fixed order (warp trees, then warp 0 over the warp sums).
__device__ float BlockSum(float v, float* shared32) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) shared32[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x + 31) / 32; ++w) total += shared32[w];
    shared32[0] = total;
  }
  __syncthreads();
  total = shared32[0];
  __syncthreads();
  return total;
}

// One block per token; its row's loads issued four at a time per thread (a decode step's embedding
// is one block, bound by load latency: one load at a time is ~1.7x slower for a 7168-wide bf16 row).
constexpr int kEmbedThreads = 512;
__global__ void __launch_bounds__(kEmbedThreads) EmbeddingKernel(const void* table, DType dtype, int64_t rows, int H, const int32_t* ids, float* out) {
  PdlWait();
  PdlLaunchDependents();
  const int t = blockIdx.x;
  const int id = ids[t];
#pragma unroll 4
  for (int j = threadIdx.x; j < H; j += kEmbedThreads) {
    out[static_cast<int64_t>(t) * H + j] = id >= 0 && id < rows ? LoadAsF32(table, dtype, static_cast<int64_t>(id) * H + j) : 0.f;
  }
}

// One block per row, summing in kRmsNormThreads' order (ops.h): it depends only on H, so a row has
// the same bits in any call, whether its loads are float4 (kVector: H % 4 == 0, x and out on 16
// bytes) or not. A decode step's row is one block, bound by the latency of its loads: a thread issues
// kNormUnroll chunks at a time, keeps the first round (all of a row up to H 8192) in registers for
// the output, and loads its weights before the reduction (one float per thread in sequence is ~3.5x
// slower for H 7168).
constexpr int kNormThreads = kRmsNormThreads;
constexpr int kNormUnroll = 4;
template <bool kVector>
__device__ __forceinline__ float4 LoadChunk(const float* row, int c, int H) {
  if constexpr (kVector) {
    return *reinterpret_cast<const float4*>(row + 4 * c);
  } else {
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = 4 * c + k < H ? row[4 * c + k] : 0.f;
    return make_float4(v[0], v[1], v[2], v[3]);
  }
}
template <bool kVector>
__device__ __forceinline__ void StoreChunk(float* row, int c, int H, float4 y) {
  if constexpr (kVector) {
    *reinterpret_cast<float4*>(row + 4 * c) = y;
  } else {
    const float ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (4 * c + k < H) row[4 * c + k] = ys[k];
    }
  }
}
// A bf16 output (the input of the next GEMM, which then takes its one-plane bf16-x path): rounded
// to nearest even, 8 bytes per chunk when vectorised.
template <bool kVector>
__device__ __forceinline__ void StoreChunk(__nv_bfloat16* row, int c, int H, float4 y) {
  if constexpr (kVector) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(y.x, y.y), hi = __floats2bfloat162_rn(y.z, y.w);
    uint2 v;
    v.x = *reinterpret_cast<const uint32_t*>(&lo);
    v.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(row + 4 * c) = v;
  } else {
    const float ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (4 * c + k < H) row[4 * c + k] = __float2bfloat16_rn(ys[k]);
    }
  }
}
__device__ __forceinline__ void StoreValue(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreValue(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ float4 LoadWeightChunk(const void* w, DType wt, int c, int H) {
  float v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = 4 * c + k < H ? LoadAsF32(w, wt, 4 * c + k) : 0.f;
  return make_float4(v[0], v[1], v[2], v[3]);
}
// One row's norm by the block (kNormThreads threads, all of which must call it: it syncs). With
// residual_row the norm is of row + residual_row, which sum_row receives.
template <bool kVector, typename OutT>
__device__ __forceinline__ void NormRow(const float* row, const float* residual_row, float* sum_row, const void* w, DType wt, int H, float eps, OutT* out_row,
                                        __nv_bfloat16* copy_row, float* red) {
  const int chunks = (H + 3) / 4;
  constexpr int kRound = kNormUnroll * kNormThreads;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 first[kNormUnroll], weight[kNormUnroll];  // the first round's chunks and their weights
  float ss = 0.f;
  for (int c0 = threadIdx.x; c0 < chunks; c0 += kRound) {
    float4 v[kNormUnroll];
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) v[u] = c0 + u * kNormThreads < chunks ? LoadChunk<kVector>(row, c0 + u * kNormThreads, H) : zero;
    if (residual_row != nullptr) {  // the fused residual add, element by element as add does it
#pragma unroll
      for (int u = 0; u < kNormUnroll; ++u) {
        const int c = c0 + u * kNormThreads;
        if (c >= chunks) break;
        const float4 r = LoadChunk<kVector>(residual_row, c, H);
        v[u] = make_float4(v[u].x + r.x, v[u].y + r.y, v[u].z + r.z, v[u].w + r.w);
        StoreChunk<kVector>(sum_row, c, H, v[u]);
      }
    }
    if (c0 == static_cast<int>(threadIdx.x)) {
#pragma unroll
      for (int u = 0; u < kNormUnroll; ++u) {
        first[u] = v[u];
        weight[u] = c0 + u * kNormThreads < chunks ? LoadWeightChunk(w, wt, c0 + u * kNormThreads, H) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) {
      ss = fmaf(v[u].x, v[u].x, ss);
      ss = fmaf(v[u].y, v[u].y, ss);
      ss = fmaf(v[u].z, v[u].z, ss);
      ss = fmaf(v[u].w, v[u].w, ss);
    }
  }
  ss = BlockSum(ss, red);
  const float inv = 1.f / sqrtf(ss / static_cast<float>(H) + eps);
  const float* normed = residual_row != nullptr ? sum_row : row;  // past the first round: re-read (sum may be x itself)
  for (int c0 = threadIdx.x; c0 < chunks; c0 += kRound) {
    const bool kept = c0 == static_cast<int>(threadIdx.x);
#pragma unroll
    for (int u = 0; u < kNormUnroll; ++u) {
      const int c = c0 + u * kNormThreads;
      if (c >= chunks) break;
      const float4 v = kept ? first[u] : LoadChunk<kVector>(normed, c, H), g = kept ? weight[u] : LoadWeightChunk(w, wt, c, H);
      const float4 y = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
      StoreChunk<kVector>(out_row, c, H, y);
      if (copy_row != nullptr) StoreChunk<kVector>(copy_row, c, H, y);
    }
  }
}

template <bool kVector, typename OutT>
__global__ void __launch_bounds__(kNormThreads) RmsNormKernel(const float* x, const float* residual, float* sum, const void* w, DType wt, int H, float eps, OutT* out,
                                                             __nv_bfloat16* out_bf16) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float red[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * H;
  NormRow<kVector>(x + offset, residual != nullptr ? residual + offset : nullptr, sum != nullptr ? sum + offset : nullptr, w, wt, H, eps, out + offset,
                   out_bf16 != nullptr ? out_bf16 + offset : nullptr, red);
}

// One rotated pair of RoPE: angles in f64, as every rope kernel here computes them (same bits).
__device__ __forceinline__ void RotatePair(float& v0, float& v1, int pos, double inv_freq, double factor) {
  double sn, cs;
  sincos(static_cast<double>(pos) * inv_freq, &sn, &cs);
  cs *= factor;
  sn *= factor;
  const double x0 = v0, x1 = v1;
  v0 = static_cast<float>(x0 * cs - x1 * sn);
  v1 = static_cast<float>(x1 * cs + x0 * sn);
}

// Angles in f64: position x inv_freq reaches ~1e5 rad at long context, beyond f32's precision.
__global__ void RopeKernel(float* x, const int32_t* pos, const double* inv_freq, int T, int heads, int hd, int half, int64_t offset, double factor, bool interleave) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(T) * heads * half) return;
  const int f = static_cast<int>(i % half);
  const int64_t th = i / half;
  const int t = static_cast<int>(th / heads);
  float* v = x + th * hd + offset;
  const int a = interleave ? 2 * f : f, b = interleave ? 2 * f + 1 : f + half;
  RotatePair(v[a], v[b], pos[t], inv_freq[f], factor);
}

// mla_inputs (ops.h): block (t, 0) writes token t's latent KV into its cache slot (the norm of c,
// the rotated k_pe), block (t, 1) the normed q_a part. One launch replaces a decode step's
// rms_norm, rope and kv_write of the latent (and the rms_norm of q_a), each of which was a kernel
// bound by its launch and one row's load latency.
template <bool kVector, typename QOut, typename CacheT>
__global__ void __launch_bounds__(kNormThreads) MlaInputsKernel(const float* x, int W, const void* q_norm, DType q_wt, int Q, QOut* q_out, const void* kv_norm, DType kv_wt, int R,
                                                               int dr, CacheT* cache_c, CacheT* cache_kpe, const int32_t* slots, int64_t S, const int32_t* pos,
                                                               const double* inv_freq, double factor, bool interleave, float eps) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float red[32];
  const int t = blockIdx.x;
  const float* row = x + static_cast<int64_t>(t) * W;
  if (blockIdx.y == 1) {
    NormRow<kVector>(row, nullptr, nullptr, q_norm, q_wt, Q, eps, q_out + static_cast<int64_t>(t) * Q, static_cast<__nv_bfloat16*>(nullptr), red);
    return;
  }
  const int slot = slots[t];
  if (slot < 0 || slot >= S) return;  // out-of-range slots are not written (as kv_write)
  const float* kpe = row + W - dr;
  CacheT* kpe_out = cache_kpe + static_cast<int64_t>(slot) * dr;
  const int half = dr / 2;
  for (int f = threadIdx.x; f < half; f += blockDim.x) {
    const int a = interleave ? 2 * f : f, b = interleave ? 2 * f + 1 : f + half;
    float v0 = kpe[a], v1 = kpe[b];
    RotatePair(v0, v1, pos[t], inv_freq[f], factor);
    StoreValue(kpe_out + a, v0);
    StoreValue(kpe_out + b, v1);
  }
  NormRow<kVector>(row + W - R - dr, nullptr, nullptr, kv_norm, kv_wt, R, eps, cache_c + static_cast<int64_t>(slot) * R, static_cast<__nv_bfloat16*>(nullptr), red);
}

// mla_query (ops.h): one thread per copied nope value or rotated rope pair of a token's heads.
__global__ void MlaQueryKernel(const float* x, int W, int T, int H, int dn, int dr, float* q_nope, float* q_pe, const int32_t* pos, const double* inv_freq, double factor,
                               bool interleave) {
  PdlWait();
  PdlLaunchDependents();
  const int half = dr / 2;
  const int64_t per = static_cast<int64_t>(H) * (dn + half);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(T) * per) return;
  const int t = static_cast<int>(i / per);
  const int64_t j = i % per;
  const float* row = x + static_cast<int64_t>(t) * W;
  if (j < static_cast<int64_t>(H) * dn) {
    q_nope[static_cast<int64_t>(t) * H * dn + j] = row[j];
    return;
  }
  const int p = static_cast<int>(j - static_cast<int64_t>(H) * dn), h = p / half, f = p % half;
  const int a = interleave ? 2 * f : f, b = interleave ? 2 * f + 1 : f + half;
  const float* src = row + static_cast<int64_t>(H) * dn + static_cast<int64_t>(h) * dr;
  float v0 = src[a], v1 = src[b];
  RotatePair(v0, v1, pos[t], inv_freq[f], factor);
  float* out = q_pe + (static_cast<int64_t>(t) * H + h) * dr;
  out[a] = v0;
  out[b] = v1;
}

__global__ void SiluMulKernel(const void* x, DType xt, int64_t T, int I, void* out, DType ot) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * I) return;
  const int64_t r = i / I, j = i % I;
  StoreFromF32(out, ot, i, SiluMulValue(LoadAsF32(x, xt, r * 2 * I + j), LoadAsF32(x, xt, r * 2 * I + I + j)));
}

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

// argmax per row: the largest value, the lowest index among equal ones, in two launches. Blocks over
// (segment, row) take the best of kArgmaxSegment values each (float4 loads where the rows allow, four
// in flight per thread), then a warp per row the best of its segments. The pair order makes the
// result the row's argmax however the row is cut (one 1024-thread block per row, 160 loads in
// sequence per thread, is ~9x slower for a 163840-wide row).
constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxSegment = 4096;
__device__ __forceinline__ void KeepBest(float& v, int& i, float ov, int oi) {
  if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) {
    v = ov;
    i = oi;
  }
}
__device__ __forceinline__ void WarpKeepBest(float& v, int& i) {
  for (int off = 16; off > 0; off >>= 1) KeepBest(v, i, __shfl_xor_sync(0xffffffffu, v, off), __shfl_xor_sync(0xffffffffu, i, off));
}
template <bool kVector>
__global__ void __launch_bounds__(kArgmaxThreads) ArgmaxSegmentKernel(const float* x, int rows, int V, int segments, float* part_v, int* part_i) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float warp_v[kArgmaxThreads / 32];
  __shared__ int warp_i[kArgmaxThreads / 32];
  const int seg = blockIdx.x, begin = seg * kArgmaxSegment, end = min(V, begin + kArgmaxSegment);
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    const float* r = x + static_cast<int64_t>(row) * V;
    float best = -INFINITY;
    int idx = -1;
#pragma unroll 4
    for (int i = begin + 4 * threadIdx.x; i < end; i += 4 * kArgmaxThreads) {
      float v[4];
      if (kVector) {  // V % 4 == 0: a chunk never crosses the end
        const float4 q = *reinterpret_cast<const float4*>(r + i);
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = i + k < end ? r[i + k] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (i + k < end) KeepBest(best, idx, v[k], i + k);
      }
    }
    WarpKeepBest(best, idx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
      warp_v[warp] = best;
      warp_i[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
      best = lane < kArgmaxThreads / 32 ? warp_v[lane] : -INFINITY;
      idx = lane < kArgmaxThreads / 32 ? warp_i[lane] : -1;
      WarpKeepBest(best, idx);
      if (lane == 0) {
        part_v[static_cast<int64_t>(row) * segments + seg] = best;
        part_i[static_cast<int64_t>(row) * segments + seg] = idx;
      }
    }
    __syncthreads();
  }
}
__global__ void ArgmaxCombineKernel(const float* part_v, const int* part_i, int rows, int segments, int32_t* out) {
  PdlWait();
  PdlLaunchDependents();
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (row >= rows) return;
  float best = -INFINITY;
  int idx = -1;
  for (int s = lane; s < segments; s += 32) KeepBest(best, idx, part_v[static_cast<int64_t>(row) * segments + s], part_i[static_cast<int64_t>(row) * segments + s]);
  WarpKeepBest(best, idx);
  if (lane == 0) out[row] = idx;
}

// f32 rows into an f32 or bf16 cache (rounded to nearest even, as @kdtree/format does). Row t's
// R + dr values are spread over the gridDim.y blocks (t, *), a value a thread per 256-value chunk:
// a row as wide as a hidden state (7168 values, the DFlash drafter's held taps) on one block would
// be 28 load-store rounds a thread, each waiting for its load, where this is one.
__global__ void KvWriteKernel(const float* __restrict__ c, const float* __restrict__ kpe, void* cache_c, void* cache_kpe, DType cache_dtype, const int32_t* slots, int T, int R, int dr,
                              int64_t S) {
  PdlWait();
  PdlLaunchDependents();
  const int t = blockIdx.x;
  const int slot = slots[t];
  if (slot < 0 || slot >= S) return;  // out-of-range slots are not written
  for (int j = blockIdx.y * blockDim.x + threadIdx.x; j < R + dr; j += gridDim.y * blockDim.x) {
    if (j < R) StoreFromF32(cache_c, cache_dtype, static_cast<int64_t>(slot) * R + j, c[static_cast<int64_t>(t) * R + j]);
    else StoreFromF32(cache_kpe, cache_dtype, static_cast<int64_t>(slot) * dr + (j - R), kpe[static_cast<int64_t>(t) * dr + (j - R)]);
  }
}

// One block: every thread reads the start before any writes, so out may be start_on_device itself.
__global__ void __launch_bounds__(1024) ArangeKernel(int64_t start, const int32_t* start_on_device, int32_t* out, int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  start += start_on_device ? *start_on_device : 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(start + i);
}

unsigned Blocks(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace

Status LaunchEmbedding(const EmbeddingArgs& a, cudaStream_t s) {
  if (a.ids.dim(0) == 0) return Status::Ok();
  return LaunchPdl("embedding", EmbeddingKernel, dim3(static_cast<unsigned>(a.ids.dim(0))), dim3(kEmbedThreads), 0, s, a.table.data, a.table.dtype, a.table.dim(0),
                   static_cast<int>(a.table.dim(1)), a.ids.as<const int32_t>(), a.out.as<float>());
}
Status LaunchRmsNorm(const RmsNormArgs& a, cudaStream_t s) {
  if (a.x.dim(0) == 0) return Status::Ok();
  const int H = static_cast<int>(a.x.dim(1));
  const bool fused = a.residual.present();
  const auto aligned = [](const Tensor& t) { return !t.present() || reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  const bool vector = H % 4 == 0 && aligned(a.x) && aligned(a.out) && aligned(a.residual) && aligned(a.sum) && aligned(a.out_bf16);
  const float* residual = fused ? a.residual.as<const float>() : nullptr;
  float* sum = fused ? a.sum.as<float>() : nullptr;
  const float eps = static_cast<float>(a.eps);
  const dim3 grid(static_cast<unsigned>(a.x.dim(0))), block(kNormThreads);
  if (a.out.dtype == DType::kBF16) {
    return LaunchPdl("rms_norm", vector ? RmsNormKernel<true, __nv_bfloat16> : RmsNormKernel<false, __nv_bfloat16>, grid, block, 0, s, a.x.as<const float>(), residual, sum,
                     a.weight.data, a.weight.dtype, H, eps, a.out.as<__nv_bfloat16>(), static_cast<__nv_bfloat16*>(nullptr));
  }
  return LaunchPdl("rms_norm", vector ? RmsNormKernel<true, float> : RmsNormKernel<false, float>, grid, block, 0, s, a.x.as<const float>(), residual, sum, a.weight.data,
                   a.weight.dtype, H, eps, a.out.as<float>(), a.out_bf16.present() ? a.out_bf16.as<__nv_bfloat16>() : nullptr);
}
Status LaunchRope(const RopeArgs& a, cudaStream_t s) {
  const int64_t n = a.x.dim(0) * a.x.dim(1) * a.inv_freq.dim(0);
  if (n == 0) return Status::Ok();
  return LaunchPdl("rope", RopeKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, a.x.as<float>(), a.positions.as<const int32_t>(), a.inv_freq.as<const double>(),
                   static_cast<int>(a.x.dim(0)), static_cast<int>(a.x.dim(1)), static_cast<int>(a.x.dim(2)), static_cast<int>(a.inv_freq.dim(0)), a.offset,
                   a.attention_factor, a.interleave);
}
Status LaunchSiluMul(const SiluMulArgs& a, cudaStream_t s) {
  const int64_t n = a.out.numel();
  if (n == 0) return Status::Ok();
  return LaunchPdl("silu_mul", SiluMulKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, static_cast<const void*>(a.x.data), a.x.dtype, a.out.dim(0), static_cast<int>(a.out.dim(1)),
                   a.out.data, a.out.dtype);
}
Status LaunchAdd(const AddArgs& a, cudaStream_t s) {
  const int64_t n = a.out.numel();
  if (n == 0) return Status::Ok();
  return LaunchPdl("add", AddKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, a.a.as<const float>(), a.b.as<const float>(), a.out.as<float>(), n);
}
Status LaunchArgmax(const ArgmaxArgs& a, cudaStream_t s, Scratch& scratch) {
  const int64_t rows = a.x.dim(0), V = a.x.dim(1);
  if (rows == 0) return Status::Ok();
  if (V > INT32_MAX - kArgmaxSegment || rows > INT32_MAX) return Unsupported("argmax: rows of up to 2^31 - ", kArgmaxSegment, " values and 2^31 rows are supported, got [", rows, ", ", V, "]");
  const int segments = static_cast<int>((V + kArgmaxSegment - 1) / kArgmaxSegment);
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(static_cast<size_t>(rows) * segments * (sizeof(float) + sizeof(int)), s));
  float* part_v = static_cast<float*>(scratch.ptr);
  int* part_i = reinterpret_cast<int*>(part_v + rows * segments);
  const bool vector = V % 4 == 0 && reinterpret_cast<uintptr_t>(a.x.data) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(segments), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  KDTREE_RETURN_IF_ERROR(LaunchPdl("argmax segments", vector ? ArgmaxSegmentKernel<true> : ArgmaxSegmentKernel<false>, grid, dim3(kArgmaxThreads), 0, s, a.x.as<const float>(),
                                   static_cast<int>(rows), static_cast<int>(V), segments, part_v, part_i));
  return LaunchPdl("argmax combine", ArgmaxCombineKernel, dim3(Blocks(rows, 8)), dim3(256), 0, s, static_cast<const float*>(part_v), static_cast<const int*>(part_i), static_cast<int>(rows),
                   segments, a.out.as<int32_t>());
}
Status LaunchTopk(const TopkArgs& a, cudaStream_t s, Scratch& scratch) {
  if (a.x.dim(0) == 0) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(TopkScratchBytes(a.x.dim(0), a.k, a.x.dim(1)), s));
  return LaunchRowTopk(a.x.as<const float>(), a.x.dim(0), a.x.dim(1), a.k, a.values.as<float>(), a.ids.as<int32_t>(), scratch.ptr, s);
}
Status LaunchKvWrite(const KvWriteArgs& a, cudaStream_t s) {
  if (a.c.dim(0) == 0) return Status::Ok();
  constexpr int kThreads = 256, kMaxParts = 64;  // a value a thread up to rows of 16384 values
  const int64_t row_values = a.c.dim(1) + a.kpe.dim(1);
  const unsigned parts = static_cast<unsigned>(std::min<int64_t>(kMaxParts, std::max<int64_t>(1, (row_values + kThreads - 1) / kThreads)));
  return LaunchPdl("kv_write", KvWriteKernel, dim3(static_cast<unsigned>(a.c.dim(0)), parts), dim3(kThreads), 0, s, a.c.as<const float>(), a.kpe.as<const float>(), a.cache_c.data,
                   a.cache_kpe.data, a.cache_c.dtype, a.slots.as<const int32_t>(), static_cast<int>(a.c.dim(0)), static_cast<int>(a.c.dim(1)), static_cast<int>(a.kpe.dim(1)),
                   a.cache_c.dim(0));
}

namespace {
template <typename QOut, typename CacheT>
Status LaunchMlaInputsAs(const MlaInputsArgs& a, cudaStream_t s) {
  const int64_t T = a.x.dim(0);
  const int W = static_cast<int>(a.x.dim(1)), R = static_cast<int>(a.cache_c.dim(1)), dr = static_cast<int>(a.cache_kpe.dim(1));
  const int Q = a.q_a_norm.present() ? static_cast<int>(a.q_a_norm.dim(0)) : 0;
  const auto aligned = [](const Tensor& t) { return !t.present() || reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  // float4 rows: every segment starts on 16 bytes (x's rows, the kv part, the cache rows)
  const bool vector = W % 4 == 0 && Q % 4 == 0 && R % 4 == 0 && (R + dr) % 4 == 0 && aligned(a.x) && aligned(a.q_a_out) && aligned(a.cache_c);
  const dim3 grid(static_cast<unsigned>(T), Q > 0 ? 2 : 1);
  return LaunchPdl("mla_inputs", vector ? MlaInputsKernel<true, QOut, CacheT> : MlaInputsKernel<false, QOut, CacheT>, grid, dim3(kNormThreads), 0, s, a.x.as<const float>(), W,
                   Q > 0 ? a.q_a_norm.data : nullptr, Q > 0 ? a.q_a_norm.dtype : DType::kF32, Q, Q > 0 ? a.q_a_out.as<QOut>() : nullptr, a.kv_a_norm.data, a.kv_a_norm.dtype, R, dr,
                   a.cache_c.as<CacheT>(), a.cache_kpe.as<CacheT>(), a.slots.as<const int32_t>(), a.cache_c.dim(0), a.positions.as<const int32_t>(),
                   a.inv_freq.as<const double>(), a.attention_factor, a.interleave, static_cast<float>(a.eps));
}
template <typename QOut>
Status LaunchMlaInputsQ(const MlaInputsArgs& a, cudaStream_t s) {
  return a.cache_c.dtype == DType::kBF16 ? LaunchMlaInputsAs<QOut, __nv_bfloat16>(a, s) : LaunchMlaInputsAs<QOut, float>(a, s);
}
}  // namespace

Status LaunchMlaInputs(const MlaInputsArgs& a, cudaStream_t s) {
  if (a.x.dim(0) == 0) return Status::Ok();
  const bool bf16_q = a.q_a_out.present() && a.q_a_out.dtype == DType::kBF16;
  return bf16_q ? LaunchMlaInputsQ<__nv_bfloat16>(a, s) : LaunchMlaInputsQ<float>(a, s);
}
Status LaunchMlaQuery(const MlaQueryArgs& a, cudaStream_t s) {
  const int64_t T = a.x.dim(0), H = a.q_nope.dim(1), dn = a.q_nope.dim(2), dr = a.q_pe.dim(2);
  const int64_t n = T * H * (dn + dr / 2);
  if (n == 0) return Status::Ok();
  return LaunchPdl("mla_query", MlaQueryKernel, dim3(Blocks(n, 256)), dim3(256), 0, s, a.x.as<const float>(), static_cast<int>(a.x.dim(1)), static_cast<int>(T),
                   static_cast<int>(H), static_cast<int>(dn), static_cast<int>(dr), a.q_nope.as<float>(), a.q_pe.as<float>(), a.positions.as<const int32_t>(),
                   a.inv_freq.as<const double>(), a.attention_factor, a.interleave);
}

Status LaunchArange(const ArangeArgs& a, cudaStream_t s) {
  if (a.out.dim(0) == 0) return Status::Ok();
  return LaunchPdl("arange", ArangeKernel, dim3(1), dim3(1024), 0, s, a.start, OnDevice(a.start_on_device), a.out.as<int32_t>(), a.out.dim(0));
}

}  // namespace cuda
}  // namespace kdtree
