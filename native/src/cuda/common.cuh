// Device helpers shared by the kernels, and the launcher declarations of each .cu file.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/dispatch_policy.h"
#include "kdtree/ops.h"
#include "kdtree/status.h"

namespace kdtree {
namespace cuda {

// Per-stream work space: grows on demand (after the stream drains), never shrinks.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  Status Reserve(size_t need, cudaStream_t stream);
  // Work space that is all zero between launches (each user resets what it used): the W4A16
  // split-tile exchange slots.
  void* zeroed = nullptr;
  size_t zeroed_bytes = 0;
  Status Zeroed(size_t need, cudaStream_t stream, void** out);
  // While any stream captures: the captured kernels keep the blocks they were given, so a block
  // outgrown meanwhile is kept (in `retired`), not freed, and nothing waits for the stream (a
  // capturing stream cannot be synchronized; cudaFree would wait for the whole device).
  bool capturing = false;
  std::vector<void*> retired;
  void Release();  // frees every block
};

inline Status FromCuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return MakeStatus(e == cudaErrorMemoryAllocation ? Code::kOutOfMemory : Code::kDeviceError, what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

// After a launch: a configuration error shows up immediately; faults surface at the next sync.
inline Status LaunchStatus(const char* kernel) { return FromCuda(cudaGetLastError(), kernel); }

// Programmatic dependent launch (PDL): a kernel launched with LaunchPdl may start while the
// previous kernel in the stream drains, which hides the launch gap between the short kernels of
// a layer. It must call PdlWait() before it reads anything an earlier kernel wrote or writes
// anything an earlier kernel reads; PdlLaunchDependents() lets the next kernel start early. A
// wait returns when the previous kernel has completed, and that kernel completed only after its
// own wait, so results are ordered as in a plain stream. The one read before waiting is the W4A16
// GEMM's weight ring (weights are packed at load time, by kernels that never trigger early).
// (Without a PDL launch both are no-ops.)
__device__ __forceinline__ void PdlWait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void PdlLaunchDependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// A scalar argument given by the host, or left on the device by earlier work (a committed length,
// a token): read after PdlWait(), so one captured graph serves every step.
__device__ __forceinline__ int64_t HostOrDevice(int64_t host, const int32_t* on_device) { return on_device ? static_cast<int64_t>(*on_device) : host; }
// The pointer HostOrDevice reads: the optional i32 [1] tensor's, or null when it is not given.
inline const int32_t* OnDevice(const Tensor& t) { return t.present() ? t.as<const int32_t>() : nullptr; }
// LaunchPdl whose blocks form thread-block clusters of `cluster` blocks along x (grid.x a multiple
// of it; 0: no clusters), for kernels whose blocks share their shared memory (cooperative_groups::
// this_cluster()).
template <typename... Params, typename... Args>
Status LaunchPdlCluster(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, unsigned cluster, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = s;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = cluster;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = cluster > 0 ? 2 : 1;
  return FromCuda(cudaLaunchKernelEx(&config, kernel, args...), what);
}
template <typename... Params, typename... Args>
Status LaunchPdl(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args) {
  return LaunchPdlCluster(what, kernel, grid, block, smem, s, 0, args...);
}

// Two f32 values as one bf16x2 register (rounded to nearest even), and back.
__device__ __forceinline__ uint32_t Bf16Pair(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// A float as an unsigned key in the same order (larger float -> larger key; -0 below +0), and back:
// the top-k radix select and sorts, and the router's warp picks, compare keys.
__device__ __forceinline__ uint32_t OrderKey(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float FromOrderKey(uint32_t key) { return __uint_as_float(key & 0x80000000u ? key & 0x7FFFFFFFu : ~key); }
__device__ __forceinline__ float2 Bf16PairToF32(uint32_t v) { return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u)); }
// Two f32 values as three bf16x2 planes, hi + mid + lo = the values to 24 bits (each residual is
// exact in f32): the tensor-core operands of f32 data, so that every product with a bf16 operand
// is exact and the MMA's f32 sum is the only rounding.
struct Bf16Planes {
  uint32_t hi, mid, lo;
};
__device__ __forceinline__ Bf16Planes SplitPair(float x, float y) {
  const uint32_t hi = Bf16Pair(x, y);
  const float2 h = Bf16PairToF32(hi);
  const float rx = x - h.x, ry = y - h.y;
  const uint32_t mid = Bf16Pair(rx, ry);
  const float2 m = Bf16PairToF32(mid);
  return {hi, mid, Bf16Pair(rx - m.x, ry - m.y)};
}

// Tensor-core pieces: four 8x8 b16 matrices from shared memory (lane l gives the row address of row
// l % 8 of matrix l / 8), as stored or transposed, and mma.m16n8k16 with f32 sums on A codes
// (bf16 or f16).
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// d = a . b + d, or with `fresh` d = a . b (a group's first MMA: no zeroing moves).
#define KDTREE_MMA(TYPE)                                                                                                  \
  if (fresh) {                                                                                                            \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n" \
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                                  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));                                       \
  } else {                                                                                                                \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                                  \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                                  \
  }
template <typename A>
__device__ __forceinline__ void Mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1, bool fresh) {
  if constexpr (std::is_same<A, __nv_bfloat16>::value) {
    KDTREE_MMA("bf16")
  } else {
    KDTREE_MMA("f16")
  }
}
#undef KDTREE_MMA
// d += a . b, bf16
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { Mma<__nv_bfloat16>(d, a, b0, b1, false); }

// 16-byte asynchronous copies global -> shared (cp.async.cg: L2 only, so streamed data keeps out
// of L1). `dst` is a shared-memory address (__cvta_generic_to_shared). The zero-fill form copies
// src_bytes (0 or 16) and zeroes the rest.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CopyAsync16ZeroFill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 8 bytes (8-byte aligned both sides), zero-filled past src_bytes: for shared-memory rows whose
// pitch is 8 bytes modulo 16.
__device__ __forceinline__ void CopyAsync8ZeroFill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 16 bytes from a shared-memory address (__cvta_generic_to_shared): no generic-to-shared conversion
// at the load.
__device__ __forceinline__ uint4 LoadShared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Whether this block is the last of `blocks` to get here (threadFenceReduction's pattern): the
// others' global writes before this point are then visible to it. The last block zeroes the counter
// again for the next launch; `last` is a flag in shared memory. The split gemm's range sums and the
// fused DDTree build's tree run in that block.
__device__ __forceinline__ bool LastOfBlocks(int* counter, int blocks, volatile bool* last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(counter, 1) == blocks - 1;
  __syncthreads();
  if (!*last) return false;
  __threadfence();
  if (threadIdx.x == 0) *counter = 0;
  return true;
}

__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CopyAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Loads of activations (x, q, anything the kernel before this one wrote). Under PDL the writer may
// still be running while this kernel starts, and the read-only path (__ldg, ld.global.nc) is
// coherent only for data nothing writes during the reader's lifetime: activations take ordinary
// loads, ordered after PdlWait() by `volatile`; weights keep the .nc path (written at load time).
__device__ __forceinline__ uint4 LoadActivation(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float4 LoadActivation(const float4* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint2 LoadActivation(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}

// Streaming 16-byte load of weights: read once, so keep it out of L1 (x lives there).
__device__ __forceinline__ uint4 LoadStream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Asks the copy engine to bring `bytes` (a multiple of 16, from a 16-byte aligned address) into L2:
// one instruction, no registers, no completion to wait for.
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ float LoadAsF32(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void StoreFromF32(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::kF16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// An output of f32 or bf16 rows (f32 sums stored in the dtype the next op reads): pointer
// arithmetic in elements, stores rounded to nearest even.
struct OutRows {
  void* data;
  DType dtype;
  __host__ __device__ __forceinline__ OutRows operator+(int64_t i) const { return {static_cast<char*>(data) + i * (dtype == DType::kF32 ? 4 : 2), dtype}; }
  __device__ __forceinline__ void Store(int64_t i, float v) const { StoreFromF32(data, dtype, i, v); }
};

// v as a tensor of dtype t holds it (rounded to nearest even for bf16 and f16).
__device__ __forceinline__ float RoundTo(DType t, float v) {
  switch (t) {
    case DType::kBF16: return __bfloat162float(__float2bfloat16_rn(v));
    case DType::kF16: return __half2float(__float2half_rn(v));
    default: return v;
  }
}

// silu(g) * u: silu_mul's arithmetic, shared with the W4A16 SiLU epilogue (which passes gate and up
// rounded to its output's dtype) so that fused and unfused give the same bits.
__device__ __forceinline__ float SiluMulValue(float g, float u) { return g / (1.f + expf(-g)) * u; }

// Exclusive prefix sums of two per-thread counts over the block, in thread order (blockDim.x a
// multiple of 32, at most 1024). `warp_sums` is shared memory for one int2 per warp; `total`
// receives the block's sums. Ends with a barrier, so the caller may reuse warp_sums at once.
__device__ __forceinline__ int2 BlockExclusiveScan(int2 v, int2* total, int2* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int2 inc = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int x = __shfl_up_sync(0xffffffffu, inc.x, d), y = __shfl_up_sync(0xffffffffu, inc.y, d);
    if (lane >= d) inc.x += x, inc.y += y;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int2 w = lane < warps ? warp_sums[lane] : make_int2(0, 0);
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, w.x, d), y = __shfl_up_sync(0xffffffffu, w.y, d);
      if (lane >= d) w.x += x, w.y += y;
    }
    if (lane < warps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int2 before = warp == 0 ? make_int2(0, 0) : warp_sums[warp - 1];
  *total = warp_sums[warps - 1];
  __syncthreads();
  return make_int2(before.x + inc.x - v.x, before.y + inc.y - v.y);
}

// What a GEMM launcher reads of its backend (the device's SMs, the forced forms as parsed at the
// backend's creation or by setForcedForms), and where it reports the form the call runs: a static
// name (dispatch_policy.h), which the backend returns as lastForm().
struct GemmContext {
  int sms = 0;
  policy::ForcedForms forced;
  const char** form = nullptr;
};

// Launchers (one per op), defined in the .cu file of the op.
Status LaunchW4A16Pack(const W4A16PackArgs& a, cudaStream_t s);
Status LaunchW4A16Gemm(const W4A16GemmArgs& a, cudaStream_t s, Scratch& scratch, const GemmContext& ctx);
Status LaunchGemm(const GemmArgs& a, cudaStream_t s, Scratch& scratch, const GemmContext& ctx);
Status LaunchMoeGemm(const MoeGemmArgs& a, cudaStream_t s, Scratch& scratch, const GemmContext& ctx);
Status LaunchMoeGemmBf16(const MoeGemmArgs& a, cudaStream_t s);  // a.w: bf16 experts as stored
Status LaunchMlaAttention(const MlaAttentionArgs& a, cudaStream_t s, Scratch& scratch, int sms);
Status LaunchEmbedding(const EmbeddingArgs& a, cudaStream_t s);
Status LaunchRmsNorm(const RmsNormArgs& a, cudaStream_t s);
Status LaunchRope(const RopeArgs& a, cudaStream_t s);
Status LaunchSiluMul(const SiluMulArgs& a, cudaStream_t s);
Status LaunchGqaAttention(const GqaAttentionArgs& a, cudaStream_t s);
Status LaunchAdd(const AddArgs& a, cudaStream_t s);
Status LaunchRouter(const RouterArgs& a, cudaStream_t s);
Status LaunchArgmax(const ArgmaxArgs& a, cudaStream_t s, Scratch& scratch);
Status LaunchTopk(const TopkArgs& a, cudaStream_t s, Scratch& scratch);
Status LaunchKvWrite(const KvWriteArgs& a, cudaStream_t s);
Status LaunchMlaInputs(const MlaInputsArgs& a, cudaStream_t s);
Status LaunchMlaQuery(const MlaQueryArgs& a, cudaStream_t s);
// form: the build that ran (policy::DdtreeBuildFormName), set before the launch.
Status LaunchDdtreeBuild(const DdtreeBuildArgs& a, cudaStream_t s, Scratch& scratch, const char** form);
Status LaunchDdtreeAccept(const DdtreeAcceptArgs& a, cudaStream_t s);
Status LaunchKvCommit(const KvCommitArgs& a, cudaStream_t s);
Status LaunchArange(const ArangeArgs& a, cudaStream_t s);

// Row-wise top-k of f32 rows (descending, ties to the lower index) used by topk and ddtree_build:
// a radix select of the k-th largest key, then a sort of the <= k survivors, one block per row; a
// long row is first cut into segments whose k best become its candidates (TopkSegments).
// `values`/`ids` are [rows, k]; `scratch` must hold TopkScratchBytes(rows, k, cols).
size_t TopkScratchBytes(int64_t rows, int k, int64_t cols);
Status LaunchRowTopk(const float* x, int64_t rows, int64_t cols, int k, float* values, int32_t* ids, void* scratch, cudaStream_t s);

}  // namespace cuda
}  // namespace kdtree
