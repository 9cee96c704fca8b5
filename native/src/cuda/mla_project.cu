// Stage 4 of MLA attention, the output projection of few rows on CUDA cores (decode, a small tree):
//   ctx f32 [T H, R] (from mla_merge.cu's LaunchMergeContext) -> out [T, H, dv] (f32 or bf16),
//   out[t, h, v] = W_vb[h, v, :] . ctx[t, h, :]
// A block per (row, kOutVPerBlock values of v), launched programmatically dependent on the merge:
// its W_vb rows go to L2 while the merge runs. Many rows project inside the merge kernel instead.
#include "mla_project.cuh"
#include "mla_stages.cuh"

namespace kdtree {
namespace cuda {
namespace {

using namespace mla;

constexpr int kOutVPerBlock = 8;    // output values per merge block when rows are few (8 rather than 32: more blocks for a decode's few rows, ~1.3x faster)

__global__ void __launch_bounds__(256) ProjectOutKernel(const float* ctx_in, int H, int R, const void* kv_b, DType kvb_dtype, bool vector_rows, int dn, int dv, int v_per_block,
                                                        OutRows out) {
  extern __shared__ float ctx[];  // [R]
  const int th = blockIdx.x, h = th % H;
  const int v_begin = blockIdx.y * v_per_block, v_end = min(dv, v_begin + v_per_block);
  // this block's W_vb rows (contiguous) into L2 while the merge still runs
  const int elem = kvb_dtype == DType::kF32 ? 4 : 2;
  const char* rows = static_cast<const char*>(kv_b) + static_cast<int64_t>(h * (dn + dv) + dn + v_begin) * R * elem;
  const int bytes = (v_end - v_begin) * R * elem;  // v_per_block rows
  for (int off = 128 * static_cast<int>(threadIdx.x); off < bytes; off += 128 * static_cast<int>(blockDim.x)) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(rows + off) : "memory");
  }
  PdlWait();
  for (int r = threadIdx.x; r < R; r += blockDim.x) ctx[r] = ctx_in[static_cast<int64_t>(th) * R + r];
  __syncthreads();
  ProjectOut<1>(ctx, 1, kv_b, kvb_dtype, vector_rows, h, R, dn, dv, v_begin, v_end, out + static_cast<int64_t>(th) * dv, 0);
}

}  // namespace

namespace mla {

Status LaunchProjectOut(const float* ctx, int T, int H, int R, const void* kv_b, DType kvb_dtype, bool vector_rows, int dn, int dv, OutRows out, cudaStream_t s) {
  return LaunchPdl("mla out projection", ProjectOutKernel, dim3(T * H, (dv + kOutVPerBlock - 1) / kOutVPerBlock), dim3(256), R * sizeof(float), s, ctx, H, R, kv_b, kvb_dtype,
                   vector_rows, dn, dv, kOutVPerBlock, out);
}

}  // namespace mla
}  // namespace cuda
}  // namespace kdtree
