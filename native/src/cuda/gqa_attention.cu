// Non-causal GQA attention of a block over cached context keys and its own keys (a DFlash drafter's
// layer; the CPU twin is cpu/gqa_attention.cc):
//   keys = [context rows 0..context_length of the cache; the block's T rows]
//   out[t, h] = softmax(q[t, h] . k^T * scale) . v        KV head h / (Hq / Hkv)
//
// A plain kernel, one block per (query token, head): each of its 8 warps walks every 8th key with an
// online softmax (a running max, the sum of exponentials and the weighted values rescaled when the
// max grows), lane i holding dims i, i + 32, ... of the head; the warps' partial results meet in
// shared memory in warp order. The split depends on the key count only, so a row's bits do not
// depend on T or on the other rows (batch-invariant). A drafter's block is a few tokens over at
// most a few thousand context keys: the kernel reads each key row once per query head, which is
// small next to the drafter's GEMMs.
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kPerLane = static_cast<int>(kMaxGqaHeadDim / 32);

struct GqaParams {
  const float* q;
  const void* k_cache;
  const void* v_cache;
  DType cache_dtype;
  const float* k;
  const float* v;
  void* out;
  DType out_dtype;
  int t, hq, hkv, d;
  int64_t context_length;                 // the length, or its bound with context_length_on_device
  const int32_t* context_length_on_device;
  float scale;
};

// Element `i` of key/value row `s` (context rows first, then the block's) at KV head `kv`.
__device__ __forceinline__ float KeyValue(const GqaParams& p, int64_t context, const void* cache, const float* block, int64_t s, int kv, int i) {
  if (s < context) return LoadAsF32(cache, p.cache_dtype, (s * p.hkv + kv) * static_cast<int64_t>(p.d) + i);
  return block[((s - context) * p.hkv + kv) * static_cast<int64_t>(p.d) + i];
}

__global__ void __launch_bounds__(kWarps * 32) GqaAttentionKernel(GqaParams p) {
  PdlWait();
  // a length on the device (written by the step before) is clamped to the bound the host checked
  const int64_t context = p.context_length_on_device ? min(max(static_cast<int64_t>(*p.context_length_on_device), int64_t{0}), p.context_length) : p.context_length;
  const int item = blockIdx.x;  // t * Hq + head
  const int head = item % p.hq;
  const int kv = head / (p.hq / p.hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* q = p.q + static_cast<int64_t>(item) * p.d;
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int i = lane + 32 * j;
    qv[j] = i < p.d ? q[i] : 0.f;
    acc[j] = 0.f;
  }
  float mx = -INFINITY, sum = 0.f;
  const int64_t keys = context + p.t;
  for (int64_t s = warp; s < keys; s += kWarps) {
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < p.d) dot = fmaf(qv[j], KeyValue(p, context, p.k_cache, p.k, s, kv, i), dot);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float score = dot * p.scale;
    const float next = fmaxf(mx, score);
    const float rescale = expf(mx - next);  // 0 on the first key (mx = -inf)
    const float w = expf(score - next);
    sum = sum * rescale + w;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int i = lane + 32 * j;
      acc[j] = acc[j] * rescale + (i < p.d ? w * KeyValue(p, context, p.v_cache, p.v, s, kv, i) : 0.f);
    }
    mx = next;
  }
  PdlLaunchDependents();
  __shared__ float warp_max[kWarps], warp_sum[kWarps];
  __shared__ float warp_acc[kWarps][kMaxGqaHeadDim];
  if (lane == 0) warp_max[warp] = mx, warp_sum[warp] = sum;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i < p.d) warp_acc[warp][i] = acc[j];
  }
  __syncthreads();
  float all_max = -INFINITY;
  for (int w = 0; w < kWarps; ++w) all_max = fmaxf(all_max, warp_max[w]);
  float total = 0.f;
  for (int w = 0; w < kWarps; ++w) total += warp_max[w] == -INFINITY ? 0.f : warp_sum[w] * expf(warp_max[w] - all_max);
  const OutRows out{p.out, p.out_dtype};
  for (int i = threadIdx.x; i < p.d; i += blockDim.x) {
    float value = 0.f;
    for (int w = 0; w < kWarps; ++w) value += warp_max[w] == -INFINITY ? 0.f : warp_acc[w][i] * expf(warp_max[w] - all_max);
    out.Store(static_cast<int64_t>(item) * p.d + i, value / total);
  }
}

}  // namespace

Status LaunchGqaAttention(const GqaAttentionArgs& a, cudaStream_t s) {
  const int64_t items = a.q.dim(0) * a.q.dim(1);
  if (items == 0) return Status::Ok();
  if (items > INT32_MAX) return Unsupported("gqa_attention: ", items, " (token, head) pairs exceed one grid");
  GqaParams p{a.q.as<const float>(), a.k_cache.data, a.v_cache.data, a.k_cache.dtype, a.k.as<const float>(), a.v.as<const float>(), a.out.data, a.out.dtype,
              static_cast<int>(a.q.dim(0)), static_cast<int>(a.q.dim(1)), static_cast<int>(a.k.dim(1)), static_cast<int>(a.q.dim(2)), a.context_length, OnDevice(a.context_length_on_device), static_cast<float>(a.scale)};
  return LaunchPdl("gqa_attention", GqaAttentionKernel, dim3(static_cast<unsigned>(items)), dim3(kWarps * 32), 0, s, p);
}

}  // namespace cuda
}  // namespace kdtree
