// Stage 1 of MLA attention, the q absorption, on tensor cores, for a bf16 kv_b:
//   q_lat[t, h, :] = W_kb[h]^T q_nope[t, h, :]
// (W_kb[h] = kv_b rows h (dn + dv) .. + dn - 1, [dn, R]). kv_b values are exact bf16 operands and
// q_nope is split into three bf16 planes (SplitPair), so the products are exact and the MMA's f32
// sums the only roundings. Why: the CUDA-core kernel (mla_q_absorb.cu, QLatentKernel) reads a
// head's 128 KB of W_kb once per 8 tokens and spends an FMA per (token, i, r): ~140 us of a
// 512-token prefill and ~23 us of a 65-node verify under Nsight.
//  * q_lat^T [R, tokens] = W_kb^T [R, dn] . q_nope^T: r on the 16-row side (`ldmatrix.trans` of the
//    W_kb rows in shared memory, loaded once per block), tokens on the 8-wide side (their fragments
//    split from q_nope in registers).
//  * Every (t, r) value is one chain of MMAs over the dn / 16 slices x 3 planes whatever the block,
//    so a token's bits do not depend on the others (tree verify equals decoding).
#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace mla {
namespace {

constexpr int kAbsorbWarps = 4, kAbsorbThreads = 32 * kAbsorbWarps;
constexpr int kAbsorbMaxGroups = 4;                // column groups of 8 tokens per block, at most
constexpr int kAbsorbMaxSlices = 8;                // dn <= 128: a warp keeps its W_kb fragments in registers
// r values per block at MT tiles of 16 per warp, and bf16 per W_kb row in shared memory (+8: the
// ldmatrix rows of a step hit distinct banks).
template <int MT>
constexpr int kAbsorbR = 16 * MT * kAbsorbWarps;
template <int MT>
constexpr int kAbsorbStride = kAbsorbR<MT> + 8;

// A block per (head, kAbsorbR<MT> values of r, 8 `groups` tokens). (Prefetching its W_kb rows into
// L2 before the wait, as the projection does with W_vb, makes decode slower.)
template <int MT>
__global__ void __launch_bounds__(kAbsorbThreads) QLatentMmaKernel(const float* q_nope, const __nv_bfloat16* kv_b, int T, int H, int dn, int dv, int R, int groups, float* q_lat) {
  constexpr int kR = kAbsorbR<MT>, kStride = kAbsorbStride<MT>;
  extern __shared__ uint4 absorb_smem[];
  __nv_bfloat16* w = reinterpret_cast<__nv_bfloat16*>(absorb_smem);  // [dn][kStride]: W_kb[h][i][r0 ..]
  const int h = blockIdx.x, r0 = blockIdx.y * kR, t0 = blockIdx.z * 8 * groups;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const __nv_bfloat16* w_kb = kv_b + static_cast<int64_t>(h) * (dn + dv) * R;
  PdlWait();
  PdlLaunchDependents();
  for (int i = threadIdx.x; i < dn * (kR / 8); i += kAbsorbThreads) {  // 16-byte pieces, zero past R
    const int row = i / (kR / 8), r = r0 + 8 * (i % (kR / 8));
    CopyAsync16ZeroFill(static_cast<uint32_t>(__cvta_generic_to_shared(w + row * kStride + r - r0)), r < R ? w_kb + static_cast<int64_t>(row) * R + r : kv_b, r < R ? 16 : 0);
  }
  CopyAsyncWaitAll();
  __syncthreads();

  // this warp's r tiles m < MT (r0 + 16 (MT warp + m) ..): A = W_kb^T by ldmatrix.trans of rows i
  const int slices = dn / 16;
  uint32_t a[MT][kAbsorbMaxSlices][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int ks = 0; ks < kAbsorbMaxSlices; ++ks) {
      if (ks < slices) {
        LoadMatrixX4Trans(a[m][ks], static_cast<uint32_t>(__cvta_generic_to_shared(w + (16 * ks + (lane >> 4) * 8 + (lane & 7)) * kStride + 16 * (MT * warp + m) + ((lane >> 3) & 1) * 8)));
      }
    }
#pragma unroll 1
  for (int nt = 0; nt < groups; ++nt) {
    const int tok = t0 + 8 * nt + g;  // this lane's B column
    if (t0 + 8 * nt >= T) break;
    const float* q = q_nope + (static_cast<int64_t>(tok) * H + h) * dn + 2 * t4;
    float acc[MT][4] = {};
#pragma unroll
    for (int ks = 0; ks < kAbsorbMaxSlices; ++ks) {
      if (ks < slices) {
        const float2 x0 = tok < T ? *reinterpret_cast<const float2*>(q + 16 * ks) : make_float2(0.f, 0.f);
        const float2 x1 = tok < T ? *reinterpret_cast<const float2*>(q + 16 * ks + 8) : make_float2(0.f, 0.f);
        const Bf16Planes b0 = SplitPair(x0.x, x0.y), b1 = SplitPair(x1.x, x1.y);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          MmaBf16(acc[m], a[m][ks], b0.lo, b1.lo);
          MmaBf16(acc[m], a[m][ks], b0.mid, b1.mid);
          MmaBf16(acc[m], a[m][ks], b0.hi, b1.hi);
        }
      }
    }
    // acc[m] element e: r = r0 + 16 (MT warp + m) + g + 8 (e >> 1), token t0 + 8 nt + 2 t4 + (e & 1)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + 16 * (MT * warp + m) + g + 8 * (e >> 1), t = t0 + 8 * nt + 2 * t4 + (e & 1);
        if (r < R && t < T) q_lat[(static_cast<int64_t>(t) * H + h) * R + r] = acc[m][e];
      }
  }
}

}  // namespace

bool QLatentMmaFits(const void* kv_b, DType kvb_dtype, const float* q_nope, int dn, int R) {
  return kvb_dtype == DType::kBF16 && dn % 16 == 0 && dn <= 16 * kAbsorbMaxSlices && R % 8 == 0 && reinterpret_cast<uintptr_t>(kv_b) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(q_nope) % 8 == 0;
}

// Token groups per block: 4 from 256 tokens (W_kb fragments reused for 32 tokens), 2 from 128, else
// 1: a small verify wants the blocks (33 tokens in blocks of 32 is ~6% slower). Below 128 tokens a
// warp takes one r tile instead of two: twice the blocks (64 at decode on one rank).
Status LaunchQLatentMma(const float* q_nope, const __nv_bfloat16* kv_b, int T, int H, int dn, int dv, int R, float* q_lat, cudaStream_t s) {
  const int groups = T >= 256 ? 4 : T >= 128 ? 2 : 1;
  static_assert(kAbsorbMaxGroups == 4, "the rule above");
  const auto launch = [&](auto kernel, int r_per_block, int stride) {
    const dim3 grid(H, (R + r_per_block - 1) / r_per_block, (T + 8 * groups - 1) / (8 * groups));
    const size_t smem = static_cast<size_t>(dn) * stride * sizeof(__nv_bfloat16);
    return LaunchPdl("mla q_latent (mma)", kernel, grid, dim3(kAbsorbThreads), smem, s, q_nope, kv_b, T, H, dn, dv, R, groups, q_lat);
  };
  if (groups == 1) return launch(QLatentMmaKernel<1>, kAbsorbR<1>, kAbsorbStride<1>);
  return launch(QLatentMmaKernel<2>, kAbsorbR<2>, kAbsorbStride<2>);
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
