// Hopper's warpgroup MMA (wgmma, sm_90a only): shared-memory descriptors, the fences and waits
// around the asynchronous MMAs, and the mbarriers that hand stages between warpgroups. The kernels
// that use them: w4a16_wgmma.cu, w4a16_prefill.cu, gemm_wgmma.cu.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace kdtree {
namespace cuda {

// wgmma shared-memory descriptor of a no-swizzle operand: start, leading byte offset (the next
// core matrix along k), stride byte offset (the next 8 tokens), in 16-byte units.
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 | static_cast<uint64_t>(sbo >> 4) << 32;
}
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of the warpgroup's committed wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void WgmmaWait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Makes this thread's completed shared-memory writes (cp.async included) visible to the tensor
// cores' reads (the async proxy).
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarriers in shared memory: a stage handed between warps that do not share a block barrier.
__device__ __forceinline__ void BarrierInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(count) : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))) : "memory");
}
__device__ __forceinline__ void BarrierWait(uint64_t* bar, int parity) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n .reg .pred done;\n wait:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait;\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}

// Whether the current device runs `kernel`: the wgmma kernels exist only as sm_90a machine code,
// so on any other device there is no image to run. Asked once per device (a host may mix GPUs)
// and kept in `known` (0 unknown, 1 yes, 2 no).
constexpr int kMaxKnownDevices = 64;
inline bool DeviceRunsKernel(const void* kernel, std::atomic<int> (&known)[kMaxKnownDevices]) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxKnownDevices) {
    cudaGetLastError();
    return false;
  }
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    cudaFuncAttributes attributes;
    state = cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess ? 1 : 2;
    cudaGetLastError();  // clear the lookup's error
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

}  // namespace cuda
}  // namespace kdtree
