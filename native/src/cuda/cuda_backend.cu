// The cuda backend: device memory, streams, events, per-stream scratch, and dispatch of every op
// to its launcher. All ops are asynchronous on their stream; faults surface at synchronize().
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.cuh"
#include "kdtree/backend.h"

namespace kdtree {
namespace cuda {

Status Scratch::Reserve(size_t need, cudaStream_t stream) {
  if (need <= bytes) return Status::Ok();
  // The old block may still be in use by queued work on this stream: drain it first.
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaStreamSynchronize(stream), "scratch: synchronize"));
  if (ptr != nullptr) cudaFree(ptr);
  ptr = nullptr;
  bytes = 0;
  const size_t grown = need + need / 4;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaMalloc(&ptr, grown), "scratch: cudaMalloc"));
  bytes = grown;
  return Status::Ok();
}

Status Scratch::Zeroed(size_t need, cudaStream_t stream, void** out) {
  if (need > zeroed_bytes) {
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaStreamSynchronize(stream), "zeroed scratch: synchronize"));
    if (zeroed != nullptr) cudaFree(zeroed);
    zeroed = nullptr;
    zeroed_bytes = 0;
    const size_t grown = std::max<size_t>(need * 2, 4096);
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMalloc(&zeroed, grown), "zeroed scratch: cudaMalloc"));
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMemsetAsync(zeroed, 0, grown, stream), "zeroed scratch: zero"));
    zeroed_bytes = grown;
  }
  *out = zeroed;
  return Status::Ok();
}

namespace {

__global__ void HoldKernel(int64_t nanoseconds) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<int64_t>(now - start) < nanoseconds);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override {
    cudaSetDevice(device_);
    for (auto& [id, s] : streams_) cudaStreamDestroy(s);
    for (auto& [id, e] : events_) cudaEventDestroy(e);
    for (auto& [id, sc] : scratch_) {
      if (sc.ptr) cudaFree(sc.ptr);
      if (sc.zeroed) cudaFree(sc.zeroed);
    }
  }

  Status Init() {
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaSetDevice(device_), "cudaSetDevice"));
    cudaDeviceProp p{};
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaGetDeviceProperties(&p, device_), "cudaGetDeviceProperties"));
    info_.name = p.name;
    info_.compute_major = p.major;
    info_.compute_minor = p.minor;
    info_.multiprocessors = p.multiProcessorCount;
    info_.total_memory = static_cast<int64_t>(p.totalGlobalMem);
    cudaDriverGetVersion(&info_.driver_version);
    cudaRuntimeGetVersion(&info_.runtime_version);
    if (p.major < 8) return Unsupported("cuda device ", device_, " (", p.name, ") has compute capability ", p.major, ".", p.minor, "; the kdtree kernels need 8.0 or newer (built for 9.0)");
    streams_[0] = nullptr;  // the legacy default stream
    return Status::Ok();
  }

  const char* kind() const override { return "cuda"; }
  DeviceInfo info() const override { return info_; }

  Status Alloc(size_t bytes, void** ptr) override {
    KDTREE_RETURN_IF_ERROR(Device());
    return FromCuda(cudaMalloc(ptr, bytes), "cudaMalloc");
  }
  Status Free(void* ptr) override { return FromCuda(cudaFree(ptr), "cudaFree"); }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    // pageable host memory: complete before returning, so the caller may reuse its array
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "upload"));
    return FromCuda(cudaStreamSynchronize(s), "upload");
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "download"));
    return FromCuda(cudaStreamSynchronize(s), "download");
  }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "copy");
  }
  Status Fill(void* dst, uint8_t value, size_t bytes, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return FromCuda(cudaMemsetAsync(dst, value, bytes, s), "fill");
  }
  Status Hold(int64_t microseconds, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    HoldKernel<<<1, 1, 0, s>>>(microseconds * 1000);
    return LaunchStatus("hold");
  }
  Status CreateStream(int* stream) override {
    KDTREE_RETURN_IF_ERROR(Device());
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
    *stream = next_stream_++;
    streams_[*stream] = s;
    return Status::Ok();
  }
  Status DestroyStream(int stream) override {
    if (stream == 0 || !streams_.count(stream)) return Invalid("destroy_stream: unknown stream ", stream);
    cudaStreamSynchronize(streams_[stream]);
    cudaStreamDestroy(streams_[stream]);
    streams_.erase(stream);
    if (scratch_.count(stream)) {
      cudaFree(scratch_[stream].ptr);
      cudaFree(scratch_[stream].zeroed);
      scratch_.erase(stream);
    }
    return Status::Ok();
  }
  Status Synchronize(int stream) override {
    if (stream < 0) return FromCuda(cudaDeviceSynchronize(), "synchronize");
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return FromCuda(cudaStreamSynchronize(s), "synchronize");
  }
  Status CheckStream(int stream) override {
    cudaStream_t s;
    return Stream(stream, &s);
  }
  Status CreateEvent(int* event) override {
    KDTREE_RETURN_IF_ERROR(Device());
    cudaEvent_t e;
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaEventCreate(&e), "cudaEventCreate"));
    *event = next_event_++;
    events_[*event] = e;
    return Status::Ok();
  }
  Status DestroyEvent(int event) override {
    if (!events_.count(event)) return Invalid("destroy_event: unknown event ", event);
    cudaEventDestroy(events_[event]);
    events_.erase(event);
    return Status::Ok();
  }
  Status RecordEvent(int event, int stream) override {
    if (!events_.count(event)) return Invalid("record_event: unknown event ", event);
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return FromCuda(cudaEventRecord(events_[event], s), "cudaEventRecord");
  }
  Status ElapsedMs(int start, int end, float* ms) override {
    if (!events_.count(start) || !events_.count(end)) return Invalid("elapsed_ms: unknown event");
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaEventSynchronize(events_[end]), "cudaEventSynchronize"));
    return FromCuda(cudaEventElapsedTime(ms, events_[start], events_[end]), "cudaEventElapsedTime");
  }

#define KDTREE_DISPATCH(Name, Launch, ...)                      \
  Status Name(const Name##Args& a, int stream) override {      \
    cudaStream_t s;                                             \
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));                 \
    return Launch(a, s __VA_ARGS__);                            \
  }
  KDTREE_DISPATCH(W4A16Pack, LaunchW4A16Pack)
  KDTREE_DISPATCH(W4A16Gemm, LaunchW4A16Gemm, , scratch_[stream], info_.multiprocessors)
  KDTREE_DISPATCH(MoeGemm, LaunchMoeGemm, , scratch_[stream], info_.multiprocessors)
  KDTREE_DISPATCH(MlaAttention, LaunchMlaAttention, , scratch_[stream], info_.multiprocessors)
  KDTREE_DISPATCH(Embedding, LaunchEmbedding)
  KDTREE_DISPATCH(RmsNorm, LaunchRmsNorm)
  KDTREE_DISPATCH(Rope, LaunchRope)
  KDTREE_DISPATCH(SiluMul, LaunchSiluMul)
  KDTREE_DISPATCH(Add, LaunchAdd)
  KDTREE_DISPATCH(Router, LaunchRouter)
  KDTREE_DISPATCH(Argmax, LaunchArgmax)
  KDTREE_DISPATCH(Topk, LaunchTopk, , scratch_[stream])
  KDTREE_DISPATCH(KvWrite, LaunchKvWrite)
  KDTREE_DISPATCH(DdtreeBuild, LaunchDdtreeBuild, , scratch_[stream])
  KDTREE_DISPATCH(DdtreeAccept, LaunchDdtreeAccept)
  KDTREE_DISPATCH(KvCommit, LaunchKvCommit)
#undef KDTREE_DISPATCH

 private:
  // Every call makes this backend's device current; asking first skips the set when it already is
  // (run 267: ~0.45 us less host time per single-launch call on the H200 host).
  Status Device() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == device_) return Status::Ok();
    return FromCuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  Status Stream(int id, cudaStream_t* s) {
    auto it = streams_.find(id);
    if (it == streams_.end()) return Invalid("unknown stream ", id, " (create it with createStream())");
    KDTREE_RETURN_IF_ERROR(Device());
    *s = it->second;
    return Status::Ok();
  }
  int device_;
  DeviceInfo info_;
  std::map<int, cudaStream_t> streams_;
  std::map<int, cudaEvent_t> events_;
  std::map<int, Scratch> scratch_;
  int next_stream_ = 1, next_event_ = 1;
};

}  // namespace
}  // namespace cuda

Status MakeCudaBackend(int device, std::unique_ptr<Backend>* out) {
  int count = 0;
  KDTREE_RETURN_IF_ERROR(cuda::FromCuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (device < 0 || device >= count) return Invalid("cuda device ", device, " does not exist (", count, " device(s) visible)");
  auto b = std::make_unique<cuda::CudaBackend>(device);
  KDTREE_RETURN_IF_ERROR(b->Init());
  *out = std::move(b);
  return Status::Ok();
}

CudaProbeResult ProbeCuda() {
  CudaProbeResult r;
  cudaDriverGetVersion(&r.driver_version);
  cudaRuntimeGetVersion(&r.runtime_version);
  if (r.driver_version == 0) {
    r.error = "no NVIDIA driver found (libcuda.so.1 is not loadable)";
    return r;
  }
  if (r.driver_version < r.runtime_version) {
    r.error = "the NVIDIA driver supports CUDA " + std::to_string(r.driver_version / 1000) + "." + std::to_string(r.driver_version % 1000 / 10) +
              ", older than the CUDA " + std::to_string(r.runtime_version / 1000) + "." + std::to_string(r.runtime_version % 1000 / 10) + " runtime this addon was built with";
    return r;
  }
  const cudaError_t e = cudaGetDeviceCount(&r.device_count);
  if (e != cudaSuccess) {
    r.error = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    return r;
  }
  for (int d = 0; d < r.device_count; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    DeviceInfo info;
    info.name = p.name;
    info.compute_major = p.major;
    info.compute_minor = p.minor;
    info.multiprocessors = p.multiProcessorCount;
    info.total_memory = static_cast<int64_t>(p.totalGlobalMem);
    r.devices.push_back(info);
  }
  r.ok = r.device_count > 0;
  if (!r.ok) r.error = "no CUDA device is visible";
  return r;
}

}  // namespace kdtree
