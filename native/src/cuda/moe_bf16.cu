// The grouped MoE GEMM over bf16 experts as the checkpoint stores them (w [E, N, K], no packing):
// the routed experts of a float bundle. One warp per output value: its 32 lanes stride K in chunks
// of 8 (one 16-byte load of weights per chunk), each summing its chunks in order with FMAs, and
// the lane sums meet in an xor butterfly. A value's bits then depend only on its x row and weight
// row, never on the other pairs of the call (batch-invariant), and they equal the cpu twin's
// (WarpOrderDot in cpu_backend.cc). This form is correct, not tuned: every pair streams its
// expert's rows once, with no reuse of a weight row across the pairs of one expert and no tensor
// cores, so it reads (pairs x N x K x 2) bytes where the W4A16 form reads each used expert once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kWarps = 8;  // per block: one output column each

// 8 consecutive x values (a 16-byte-aligned chunk) as f32.
__device__ __forceinline__ void LoadX8(const void* x, DType t, int64_t i, float out[8]) {
  if (t == DType::kBF16) {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(x) + i);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    for (int j = 0; j < 4; ++j) {
      const float2 f = Bf16PairToF32(words[j]);
      out[2 * j] = f.x;
      out[2 * j + 1] = f.y;
    }
    return;
  }
  const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
  const float4 a = p[0], b = p[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// dot(x row, w row) over k in the warp order described above; every lane returns the sum.
__device__ __forceinline__ float WarpDot(const void* x, DType xt, int64_t x_row, const __nv_bfloat16* w_row, int64_t k, int lane) {
  float acc = 0.f;
  for (int64_t c = 8 * lane; c < k; c += 8 * 32) {
    float xv[8];
    LoadX8(x, xt, x_row * k + c, xv);
    const uint4 v = *reinterpret_cast<const uint4*>(w_row + c);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    for (int j = 0; j < 4; ++j) {
      const float2 f = Bf16PairToF32(words[j]);
      acc = fmaf(xv[2 * j], f.x, acc);
      acc = fmaf(xv[2 * j + 1], f.y, acc);
    }
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

struct MoeBf16Params {
  const void* x;
  DType xt;
  const __nv_bfloat16* w;  // [E, N, K]
  const int32_t* ids;      // [T, topk]
  const float* weights;    // [T, topk], sum mode
  void* y;
  DType yt;
  int64_t tokens, topk, experts, n, k, cols;  // n: weight rows; cols: y's columns
  bool sum, silu;
};

// Block (blockIdx.x, blockIdx.y): a pair (gather) or a token (sum), and kWarps columns of y per
// step of gridDim.y. An id outside [0, E) contributes zeros (the cpu twin rejects it).
__global__ void __launch_bounds__(32 * kWarps) MoeBf16Kernel(const MoeBf16Params p) {
  PdlWait();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t item = blockIdx.x;  // pair (gather) or token (sum)
  for (int64_t col = static_cast<int64_t>(blockIdx.y) * kWarps + warp; col < p.cols; col += static_cast<int64_t>(gridDim.y) * kWarps) {
    float value = 0.f;
    if (p.sum) {
      for (int64_t j = 0; j < p.topk; ++j) {
        const int64_t pair = item * p.topk + j;
        const int e = p.ids[pair];
        const float d = e >= 0 && e < p.experts ? WarpDot(p.x, p.xt, pair, p.w + (e * p.n + col) * p.k, p.k, lane) : 0.f;
        value = fmaf(p.weights[pair], d, value);
      }
    } else {
      const int e = p.ids[item];
      const bool ok = e >= 0 && e < p.experts;
      const int64_t x_row = item / p.topk;
      const float gate = ok ? WarpDot(p.x, p.xt, x_row, p.w + (e * p.n + col) * p.k, p.k, lane) : 0.f;
      if (p.silu) {  // rows [gate; up]: y column col from rows col and I + col, rounded to y's dtype first
        const float up = ok ? WarpDot(p.x, p.xt, x_row, p.w + (e * p.n + p.cols + col) * p.k, p.k, lane) : 0.f;
        value = SiluMulValue(RoundTo(p.yt, gate), RoundTo(p.yt, up));
      } else {
        value = gate;
      }
    }
    if (lane == 0) StoreFromF32(p.y, p.yt, item * p.cols + col, value);
  }
}

}  // namespace

Status LaunchMoeGemmBf16(const MoeGemmArgs& a, cudaStream_t s) {
  MoeBf16Params p{a.x.data, a.x.dtype, a.w.as<const __nv_bfloat16>(), a.ids.as<const int32_t>(), a.weights.present() ? a.weights.as<const float>() : nullptr, a.y.data, a.y.dtype,
                  a.ids.dim(0), a.ids.dim(1), a.w.dim(0), a.w.dim(1), a.x.dim(1), a.y.dim(1), a.mode == MoeMode::kSum, a.epilogue == Epilogue::kSiluMul};
  const int64_t items = p.sum ? p.tokens : p.tokens * p.topk;
  if (items == 0 || p.cols == 0) return Status::Ok();
  if (items > INT32_MAX) return Unsupported("moe_gemm: ", items, " (token, expert) pairs are more than one launch holds");
  const int64_t column_blocks = std::min<int64_t>((p.cols + kWarps - 1) / kWarps, 65535);
  return LaunchPdl("moe_gemm (bf16 experts)", MoeBf16Kernel, dim3(static_cast<unsigned>(items), static_cast<unsigned>(column_blocks)), dim3(32 * kWarps), 0, s, p);
}

}  // namespace cuda
}  // namespace kdtree
