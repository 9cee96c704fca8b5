// MLA attention over the latent KV cache, in the absorbed form (DeepSeek-V3 / Kimi K2):
//   q_lat[t, h] = W_kb[h]^T q_nope[t, h]                       (R = kv_lora_rank values)
//   score_j     = (q_lat . c_j + q_pe . kpe_j) * scale          over the keys token t may see
//   ctx[t, h]   = sum_j softmax(score)_j c_j;   out[t, h] = W_vb[h] ctx[t, h]
// Keys: the `base` committed slots, then the new tokens the mask allows (causal without a mask;
// a DDTree verify passes the ancestor mask). One block per (token, head); keys go round-robin to
// warps with an online softmax, and warps combine in a fixed order, so a token's output depends
// only on the keys it sees (decode and tree verify give the same bits for the same prefix).
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kAttnWarps = 8;
constexpr int kMaxR = 1024;

__global__ void QLatentKernel(const float* q_nope, const void* kv_b, DType kvb_dtype, int H, int dn, int dv, int R, float* q_lat) {
  const int th = blockIdx.x, h = th % H;
  const float* q = q_nope + static_cast<int64_t>(th) * dn;
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    float s = 0.f;
    for (int i = 0; i < dn; ++i) s = fmaf(q[i], LoadAsF32(kv_b, kvb_dtype, static_cast<int64_t>(h * (dn + dv) + i) * R + r), s);
    q_lat[static_cast<int64_t>(th) * R + r] = s;
  }
}

__global__ void __launch_bounds__(kAttnWarps * 32) AttendKernel(const float* q_lat, const float* q_pe, const float* cache_c, const float* cache_kpe,
                                                              const uint8_t* mask, int T, int H, int R, int dr, int64_t base, float scale, float* ctx) {
  extern __shared__ float smem[];
  float* wctx = smem;                                   // [warps][R]
  float* wm = wctx + kAttnWarps * R;                    // [warps]
  float* wl = wm + kAttnWarps;                          // [warps]
  int* allowed = reinterpret_cast<int*>(wl + kAttnWarps);  // [T]
  __shared__ int n_allowed;
  const int th = blockIdx.x, t = th / H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    int n = 0;
    for (int j = 0; j < T; ++j) {
      if (mask ? mask[static_cast<int64_t>(t) * T + j] != 0 : j <= t) allowed[n++] = j;
    }
    n_allowed = n;
  }
  __syncthreads();
  const int64_t keys = base + n_allowed;
  const float* ql = q_lat + static_cast<int64_t>(th) * R;
  const float* qp = q_pe + static_cast<int64_t>(th) * dr;
  const int per_lane = (R + 31) / 32;
  float acc[kMaxR / 32];
  for (int i = 0; i < per_lane; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int64_t key = warp; key < keys; key += kAttnWarps) {
    const int64_t slot = key < base ? key : base + allowed[key - base];
    const float* c = cache_c + slot * R;
    float dot = 0.f;
    for (int i = 0; i < per_lane; ++i) {
      const int r = lane + 32 * i;
      if (r < R) dot = fmaf(ql[r], c[r], dot);
    }
    for (int i = lane; i < dr; i += 32) dot = fmaf(qp[i], cache_kpe[slot * dr + i], dot);
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float s = dot * scale;
    const float m_new = fmaxf(m, s);
    const float p = expf(s - m_new);
    const float keep = m == -INFINITY ? 0.f : expf(m - m_new);  // rescale what was accumulated
    l = l * keep + p;
    for (int i = 0; i < per_lane; ++i) {
      const int r = lane + 32 * i;
      if (r < R) acc[i] = fmaf(p, c[r], acc[i] * keep);
    }
    m = m_new;
  }
  for (int i = 0; i < per_lane; ++i) {
    const int r = lane + 32 * i;
    if (r < R) wctx[warp * R + r] = acc[i];
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
  __syncthreads();
  // combine the warps in order 0..7
  float mx = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, wm[w]);
  float denom = 0.f;
  for (int w = 0; w < kAttnWarps; ++w) denom += wm[w] == -INFINITY ? 0.f : wl[w] * expf(wm[w] - mx);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    float num = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) {
      if (wm[w] != -INFINITY) num = fmaf(expf(wm[w] - mx), wctx[w * R + r], num);
    }
    ctx[static_cast<int64_t>(th) * R + r] = num / denom;
  }
}

__global__ void OutKernel(const float* ctx, const void* kv_b, DType kvb_dtype, int H, int dn, int dv, int R, float* out) {
  const int th = blockIdx.x, h = th % H;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* c = ctx + static_cast<int64_t>(th) * R;
  for (int v = warp; v < dv; v += blockDim.x / 32) {
    const int64_t row = static_cast<int64_t>(h * (dn + dv) + dn + v) * R;
    float s = 0.f;
    for (int r = lane; r < R; r += 32) s = fmaf(LoadAsF32(kv_b, kvb_dtype, row + r), c[r], s);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) out[static_cast<int64_t>(th) * dv + v] = s;
  }
}

}  // namespace

Status LaunchMlaAttention(const MlaAttentionArgs& a, cudaStream_t s, Scratch& scratch) {
  const int T = static_cast<int>(a.q_nope.dim(0)), H = static_cast<int>(a.q_nope.dim(1)), dn = static_cast<int>(a.q_nope.dim(2));
  const int dr = static_cast<int>(a.q_pe.dim(2)), R = static_cast<int>(a.cache_c.dim(1)), dv = static_cast<int>(a.out.dim(2));
  const size_t smem = static_cast<size_t>(kAttnWarps) * R * 4 + 2 * kAttnWarps * 4 + static_cast<size_t>(T) * 4;
  if (smem > 200 * 1024) return Unsupported("mla_attention: ", T, " new tokens need more shared memory than a block has; split the call");
  const size_t per = static_cast<size_t>(T) * H * R * sizeof(float);
  KDTREE_RETURN_IF_ERROR(scratch.Reserve(2 * per, s));
  float* q_lat = static_cast<float*>(scratch.ptr);
  float* ctx = q_lat + static_cast<size_t>(T) * H * R;
  QLatentKernel<<<T * H, 256, 0, s>>>(a.q_nope.as<const float>(), a.kv_b.data, a.kv_b.dtype, H, dn, dv, R, q_lat);
  KDTREE_RETURN_IF_ERROR(LaunchStatus("mla q_latent"));
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaFuncSetAttribute(AttendKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)), "mla attend: shared memory"));
  AttendKernel<<<T * H, kAttnWarps * 32, smem, s>>>(q_lat, a.q_pe.as<const float>(), a.cache_c.as<const float>(), a.cache_kpe.as<const float>(),
                                                     a.mask.present() ? a.mask.as<const uint8_t>() : nullptr, T, H, R, dr, a.base, static_cast<float>(a.scale), ctx);
  KDTREE_RETURN_IF_ERROR(LaunchStatus("mla attend"));
  OutKernel<<<T * H, 256, 0, s>>>(ctx, a.kv_b.data, a.kv_b.dtype, H, dn, dv, R, a.out.as<float>());
  return LaunchStatus("mla out");
}

}  // namespace cuda
}  // namespace kdtree
