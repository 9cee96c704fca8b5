// Stage 1 of MLA attention, the q absorption, on CUDA cores:
//   q_lat[t, h, :] = W_kb[h]^T q_nope[t, h, :]
//   q_nope f32 [T, H, dn], W_kb[h] = kv_b rows h (dn + dv) .. + dn - 1 ([dn, R], bf16 or f32)
//   -> q_lat f32 [T H, R]
// so that a score is q_lat . c_j over the R latent values of a key instead of q_nope . (W_kb c_j).
// It takes the calls the tensor-core form (mla_q_absorb_mma.cu) does not; either way a token's
// q_lat does not depend on the other tokens of the call.
#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace {

using namespace mla;

constexpr int kQLatR = 32;        // q_lat values per block (one per lane)
constexpr int kQLatSplit = 8;     // warps per block, each summing dn / 8 of the terms
constexpr int kQLatTokens = 8;    // tokens per block (<= kQLatSplit: warp k writes token k)
static_assert(kQLatTokens <= kQLatSplit, "a warp writes each token's sum");

// q_lat[t, h, r] = sum_i q_nope[t, h, i] kv_b[h * (dn + dv) + i, r]: a block owns 32 values of r
// of one head (a warp's loads are 128 contiguous bytes of a kv_b row) for up to kQLatTokens
// tokens, so each kv_b value is read once for all of them (once per token costs a 65-node verify
// ~48 us); its 8 warps split i and add up in warp order through shared memory (deterministic, the
// same order for every token count). One thread per r over all of i would leave 32 blocks on the
// GPU, each walking 128 rows (~54 us for a decode token).
__global__ void __launch_bounds__(kQLatR * kQLatSplit) QLatentKernel(const float* q_nope, const void* kv_b, DType kvb_dtype, int T, int H, int dn, int dv, int R,
                                                                   float* q_lat) {
  PdlWait();
  PdlLaunchDependents();
  __shared__ float part[kQLatSplit][kQLatTokens][kQLatR];
  const int h = blockIdx.x, t0 = blockIdx.z * kQLatTokens, tokens = min(kQLatTokens, T - t0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.y * kQLatR + lane;
  const int64_t col = static_cast<int64_t>(h) * (dn + dv) * R + r;
  float s[kQLatTokens];
#pragma unroll
  for (int k = 0; k < kQLatTokens; ++k) s[k] = 0.f;
  if (r < R) {
    for (int i = warp; i < dn; i += kQLatSplit) {
      const float w = LoadAsF32(kv_b, kvb_dtype, col + static_cast<int64_t>(i) * R);
#pragma unroll
      for (int k = 0; k < kQLatTokens; ++k) {
        if (k < tokens) s[k] = fmaf(q_nope[(static_cast<int64_t>(t0 + k) * H + h) * dn + i], w, s[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kQLatTokens; ++k) part[warp][k][lane] = s[k];
  __syncthreads();
  // warp k sums token k's parts in warp order
  if (warp < tokens && r < R) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kQLatSplit; ++w) sum += part[w][warp][lane];
    q_lat[(static_cast<int64_t>(t0 + warp) * H + h) * R + r] = sum;
  }
}

}  // namespace

namespace mla {

Status LaunchQLatent(const float* q_nope, const void* kv_b, DType kvb_dtype, int T, int H, int dn, int dv, int R, float* q_lat, cudaStream_t s) {
  return LaunchPdl("mla q_latent", QLatentKernel, dim3(H, (R + kQLatR - 1) / kQLatR, (T + kQLatTokens - 1) / kQLatTokens), dim3(kQLatR * kQLatSplit), 0, s,
                   q_nope, kv_b, kvb_dtype, T, H, dn, dv, R, q_lat);
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
