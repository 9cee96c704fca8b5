// The MLA output projection on tensor cores, for a bf16 kv_b: out[t, h, v] = W_vb[h, v, :] . ctx[t, h, :]
// (W_vb[h] = kv_b rows h (dn + dv) + dn .. + dv - 1, [dv, R]). Why: on CUDA cores a many-row merge
// re-read each row's ctx from shared memory for every v and reduced every (row, v) by a shuffle
// tree: ~155 us of a 512-token prefill (L1 84% busy) and ~46 us of a 65-node verify under Nsight.
//  * out^T [v, rows] = W_vb [v, R] . ctx^T: v on the 16-row side (a lane's W_vb values straight from
//    global memory, 16 bytes per row), up to 8 rows of one head on the 8-wide side. W_vb values are
//    exact bf16 operands and ctx is split into three bf16 planes (SplitPair), so every product is
//    exact and the MMA's f32 sums are the only roundings.
//  * k order: in a 32-wide block of r, lane (g, t4) holds r = 8 t4 .. 8 t4 + 7 of its W_vb rows and
//    of its ctx row, as the k pairs (2 t4, 2 t4 + 8) of two MMA slices; A and B follow the same map,
//    so the sum is over every r once, and one 16-byte load feeds two slices.
//  * R is summed in kProjectChains chains (block j of 32 r goes to chain j % 4), added in chain
//    order at the end: four independent MMA chains per warp, or a warp per chain when rows are few.
//    Every (row, v) output is this one sequence whatever the call, so a row's bits do not depend on
//    the other rows (tree verify equals decoding).
#pragma once
#include "common.cuh"

namespace kdtree {
namespace cuda {
namespace mla {

constexpr int kProjectChains = 4;
constexpr int kProjectBlock = 32;  // r per block: two MMA k slices

// Whether the tensor-core projection takes this call: bf16 kv_b, R in whole blocks, rows on 16 bytes.
inline bool ProjectMmaFits(const void* kv_b, DType kvb_dtype, int R) {
  return kvb_dtype == DType::kBF16 && R % kProjectBlock == 0 && reinterpret_cast<uintptr_t>(kv_b) % 16 == 0;
}

// A warp's operands for one (16 v, 8 rows) tile: the lane's two W_vb rows (v0 + g, v0 + g + 8) and
// its ctx row (g), each at the lane's offset 8 t4 and nullptr where the row is past dv or the rows.
struct ProjectLane {
  const __nv_bfloat16* w_lo;
  const __nv_bfloat16* w_hi;
  const float* ctx;

  __device__ ProjectLane(const __nv_bfloat16* w_vb, int v0, int dv, int R, const float* ctx_rows, int64_t ctx_stride, int rows) {
    const int lane = threadIdx.x & 31, g = lane >> 2, off = 8 * (lane & 3);
    w_lo = v0 + g < dv ? w_vb + static_cast<int64_t>(v0 + g) * R + off : nullptr;
    w_hi = v0 + g + 8 < dv ? w_vb + static_cast<int64_t>(v0 + g + 8) * R + off : nullptr;
    ctx = g < rows ? ctx_rows + g * ctx_stride + off : nullptr;
  }
};

// One block of 32 r (at r0) of a lane's operands.
struct ProjectOperands {
  uint4 w_lo, w_hi;
  float4 c0, c1;
};
__device__ __forceinline__ ProjectOperands LoadProjectOperands(const ProjectLane& l, int r0) {
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  ProjectOperands o;
  o.w_lo = l.w_lo ? *reinterpret_cast<const uint4*>(l.w_lo + r0) : zero;
  o.w_hi = l.w_hi ? *reinterpret_cast<const uint4*>(l.w_hi + r0) : zero;
  o.c0 = l.ctx ? *reinterpret_cast<const float4*>(l.ctx + r0) : make_float4(0.f, 0.f, 0.f, 0.f);
  o.c1 = l.ctx ? *reinterpret_cast<const float4*>(l.ctx + r0 + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
  return o;
}

// acc += the block's products: two k slices, each ctx plane lo, mid, hi in that order.
__device__ __forceinline__ void ProjectBlockMma(float (&acc)[4], const ProjectOperands& o) {
  const Bf16Planes p0 = SplitPair(o.c0.x, o.c0.y), p1 = SplitPair(o.c0.z, o.c0.w), p2 = SplitPair(o.c1.x, o.c1.y), p3 = SplitPair(o.c1.z, o.c1.w);
  const uint32_t a0[4] = {o.w_lo.x, o.w_hi.x, o.w_lo.y, o.w_hi.y}, a1[4] = {o.w_lo.z, o.w_hi.z, o.w_lo.w, o.w_hi.w};
  MmaBf16(acc, a0, p0.lo, p1.lo);
  MmaBf16(acc, a0, p0.mid, p1.mid);
  MmaBf16(acc, a0, p0.hi, p1.hi);
  MmaBf16(acc, a1, p2.lo, p3.lo);
  MmaBf16(acc, a1, p2.mid, p3.mid);
  MmaBf16(acc, a1, p2.hi, p3.hi);
}

// The chains' sum, in chain order, and its store: acc element e is v = v0 + g + 8 (e >> 1), row
// 2 t4 + (e & 1); out rows out_stride apart.
__device__ __forceinline__ void StoreProjectTile(const float (&chains)[kProjectChains][4], int v0, int dv, int rows, OutRows out, int64_t out_stride) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float sum = ((chains[0][e] + chains[1][e]) + chains[2][e]) + chains[3][e];
    const int v = v0 + g + 8 * (e >> 1), row = 2 * t4 + (e & 1);
    if (v < dv && row < rows) out.Store(row * out_stride + v, sum);
  }
}

// A whole (16 v from v0, `rows` <= 8) tile by one warp: the four chains side by side, each block
// loaded right before its MMAs. Against 2 or 4 blocks loaded ahead (76 and 117 registers), this
// keeps the merge kernel that runs it at 4 blocks per SM, which is 2-10% faster for a prefill and
// a verify than the loads ahead.
__device__ __forceinline__ void ProjectTileMma(const __nv_bfloat16* w_vb, int v0, int dv, int R, const float* ctx_rows, int64_t ctx_stride, int rows, OutRows out, int64_t out_stride) {
  const ProjectLane l(w_vb, v0, dv, R, ctx_rows, ctx_stride, rows);
  float chains[kProjectChains][4] = {};
  for (int r0 = 0; r0 < R; r0 += kProjectChains * kProjectBlock) {
#pragma unroll
    for (int c = 0; c < kProjectChains; ++c) {
      if (r0 + c * kProjectBlock < R) ProjectBlockMma(chains[c], LoadProjectOperands(l, r0 + c * kProjectBlock));
    }
  }
  StoreProjectTile(chains, v0, dv, rows, out, out_stride);
}

// Few rows (decode, a small verify): ctx in global memory ([T * H, R]); a block per (head, 8
// tokens, 16 v) and a warp per chain, so a decode's 1 MB of W_vb (Kimi K2 rank) is read by 256
// warps of 4 KB. Launched programmatically dependent on the merge: its W_vb rows go to L2 first.
Status LaunchProjectOutMma(const float* ctx, const __nv_bfloat16* kv_b, int T, int H, int R, int dn, int dv, OutRows out, cudaStream_t s);

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
