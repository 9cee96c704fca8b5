// Stage 4 of MLA attention, the output projection of few rows on tensor cores (mla_project_mma.cuh
// has the design): ctx f32 [T H, R] -> out [T, H, dv]; the many-row form runs inside the merge
// kernel (mla_merge.cu).
#include "mla_project_mma.cuh"

namespace kdtree {
namespace cuda {
namespace mla {
namespace {

constexpr int kProjectThreads = 32 * kProjectChains;  // a warp per chain
constexpr int kProjectStep = kProjectChains * kProjectBlock;  // r between a chain's blocks
constexpr int kProjectInFlight = 4;  // a warp's blocks loaded before their MMAs

// A block per (head, 8 tokens, 16 values of v); warp c sums chain c and warp 0 adds the chains.
__global__ void __launch_bounds__(kProjectThreads) ProjectOutMmaKernel(const float* ctx, const __nv_bfloat16* kv_b, int T, int H, int R, int dn, int dv, OutRows out) {
  __shared__ float partial[kProjectChains][32][4];
  const int h = blockIdx.x, t0 = 8 * blockIdx.y, v0 = 16 * blockIdx.z, rows = min(8, T - t0);
  const int chain = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const __nv_bfloat16* w_vb = kv_b + static_cast<int64_t>(h * (dn + dv) + dn) * R;
  // the tile's W_vb rows (contiguous) into L2 while the merge still runs
  const char* w_rows = reinterpret_cast<const char*>(w_vb + static_cast<int64_t>(v0) * R);
  const int w_bytes = min(16, dv - v0) * R * static_cast<int>(sizeof(__nv_bfloat16));
  for (int off = 128 * static_cast<int>(threadIdx.x); off < w_bytes; off += 128 * kProjectThreads) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(w_rows + off) : "memory");
  }
  PdlWait();
  PdlLaunchDependents();
  const int64_t th0 = static_cast<int64_t>(t0) * H + h;  // row n: th0 + n H
  const ProjectLane l(w_vb, v0, dv, R, ctx + th0 * R, static_cast<int64_t>(H) * R, rows);
  float acc[4] = {};
  for (int r0 = chain * kProjectBlock; r0 < R; r0 += kProjectInFlight * kProjectStep) {
    ProjectOperands o[kProjectInFlight];
#pragma unroll
    for (int i = 0; i < kProjectInFlight; ++i) {
      if (r0 + i * kProjectStep < R) o[i] = LoadProjectOperands(l, r0 + i * kProjectStep);
    }
#pragma unroll
    for (int i = 0; i < kProjectInFlight; ++i) {
      if (r0 + i * kProjectStep < R) ProjectBlockMma(acc, o[i]);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) partial[chain][lane][e] = acc[e];
  __syncthreads();
  if (chain != 0) return;
  float chains[kProjectChains][4];
#pragma unroll
  for (int c = 0; c < kProjectChains; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) chains[c][e] = partial[c][lane][e];
  StoreProjectTile(chains, v0, dv, rows, out + th0 * dv, static_cast<int64_t>(H) * dv);
}

}  // namespace

Status LaunchProjectOutMma(const float* ctx, const __nv_bfloat16* kv_b, int T, int H, int R, int dn, int dv, OutRows out, cudaStream_t s) {
  const dim3 grid(H, (T + 7) / 8, (dv + 15) / 16);
  return LaunchPdl("mla out projection (mma)", ProjectOutMmaKernel, grid, dim3(kProjectThreads), 0, s, ctx, kv_b, T, H, R, dn, dv, out);
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
