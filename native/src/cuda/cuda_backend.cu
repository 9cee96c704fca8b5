// The cuda backend: device memory, streams, events, per-stream scratch, and dispatch of every op
// to its launcher. All ops are asynchronous on their stream; faults surface at synchronize().
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common.cuh"
#include "kdtree/backend.h"

namespace kdtree {
namespace cuda {

// An outgrown block: freed once the stream has drained, or kept for the graph during a capture.
static Status Outgrow(void** block, size_t* bytes, bool capturing, std::vector<void*>* retired, cudaStream_t stream, const char* what) {
  if (*block != nullptr) {
    if (capturing) {
      retired->push_back(*block);
    } else {
      KDTREE_RETURN_IF_ERROR(FromCuda(cudaStreamSynchronize(stream), what));  // it may still be in use by queued work
      cudaFree(*block);
    }
  }
  *block = nullptr;
  *bytes = 0;
  return Status::Ok();
}

Status Scratch::Reserve(size_t need, cudaStream_t stream) {
  if (need <= bytes) return Status::Ok();
  KDTREE_RETURN_IF_ERROR(Outgrow(&ptr, &bytes, capturing, &retired, stream, "scratch: synchronize"));
  const size_t grown = need + need / 4;
  KDTREE_RETURN_IF_ERROR(FromCuda(cudaMalloc(&ptr, grown), "scratch: cudaMalloc"));
  bytes = grown;
  return Status::Ok();
}

Status Scratch::Zeroed(size_t need, cudaStream_t stream, void** out) {
  if (need > zeroed_bytes) {
    KDTREE_RETURN_IF_ERROR(Outgrow(&zeroed, &zeroed_bytes, capturing, &retired, stream, "zeroed scratch: synchronize"));
    const size_t grown = std::max<size_t>(need * 2, 4096);
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMalloc(&zeroed, grown), "zeroed scratch: cudaMalloc"));
    // in a capture this memset is a node of the graph: each launch zeroes the block again first
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMemsetAsync(zeroed, 0, grown, stream), "zeroed scratch: zero"));
    zeroed_bytes = grown;
  }
  *out = zeroed;
  return Status::Ok();
}

void Scratch::Release() {
  for (void* p : retired) cudaFree(p);
  if (ptr != nullptr) cudaFree(ptr);
  if (zeroed != nullptr) cudaFree(zeroed);
  *this = Scratch{};
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
    for (auto& [id, saved] : saved_scratch_) {  // a capture never ended: end it and drop what it captured
      cudaGraph_t g = nullptr;
      if (cudaStreamEndCapture(streams_[id], &g) == cudaSuccess && g != nullptr) cudaGraphDestroy(g);
      saved.Release();
    }
    for (auto& [id, g] : graphs_) DropGraph(g);
    for (Graph& g : deferred_graphs_) DropGraph(g);
    for (void* p : deferred_frees_) cudaFree(p);
    for (auto& [id, s] : streams_) cudaStreamDestroy(s);
    for (auto& [id, e] : events_) cudaEventDestroy(e);
    for (auto& [id, sc] : scratch_) sc.Release();
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
  Status Free(void* ptr) override {
    // cudaFree waits for the whole device, which a capture under way forbids: free it after the capture
    if (!saved_scratch_.empty()) {
      deferred_frees_.push_back(ptr);
      return Status::Ok();
    }
    return FromCuda(cudaFree(ptr), "cudaFree");
  }
  Status AllocHost(size_t bytes, void** ptr) override {
    KDTREE_RETURN_IF_ERROR(Device());
    const cudaError_t e = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) return MakeStatus(Code::kOutOfMemory, "allocHost: cannot pin ", bytes, " bytes of host memory");
    return FromCuda(e, "cudaHostAlloc");
  }
  Status FreeHost(void* ptr) override {
    // copies may still read it, and cudaFreeHost does not wait for them
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaDeviceSynchronize(), "freeHost: synchronize"));
    return FromCuda(cudaFreeHost(ptr), "cudaFreeHost");
  }
  Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return FromCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "upload");
  }
  Status MemoryInfo(int64_t* free, int64_t* total) override {
    KDTREE_RETURN_IF_ERROR(Device());
    size_t f = 0, t = 0;
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaMemGetInfo(&f, &t), "cudaMemGetInfo"));
    *free = static_cast<int64_t>(f);
    *total = static_cast<int64_t>(t);
    return Status::Ok();
  }
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
    if (saved_scratch_.count(stream)) return Invalid("destroy_stream: stream ", stream, " is capturing; end the capture first");
    cudaStreamSynchronize(streams_[stream]);
    cudaStreamDestroy(streams_[stream]);
    streams_.erase(stream);
    if (scratch_.count(stream)) {
      Scratch& sc = scratch_[stream];
      if (saved_scratch_.empty()) {
        sc.Release();
      } else {  // another stream captures: free the blocks after it
        for (void* p : {sc.ptr, sc.zeroed}) if (p != nullptr) deferred_frees_.push_back(p);
        deferred_frees_.insert(deferred_frees_.end(), sc.retired.begin(), sc.retired.end());
      }
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
  Status NativeStream(int stream, void** out) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    *out = s;
    return Status::Ok();
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
    recorded_events_.erase(event);
    return Status::Ok();
  }
  Status RecordEvent(int event, int stream) override {
    if (!events_.count(event)) return Invalid("record_event: unknown event ", event);
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaEventRecord(events_[event], s), "cudaEventRecord"));
    recorded_events_.insert(event);
    return Status::Ok();
  }
  Status ElapsedMs(int start, int end, float* ms) override {
    for (const int e : {start, end}) {
      if (!events_.count(e)) return Invalid("elapsed_ms: unknown event ", e);
      // cudaEventElapsedTime would fail with a device error; say what is wrong instead
      if (!recorded_events_.count(e)) return Invalid("elapsed_ms: event ", e, " was never recorded (recordEvent first)");
    }
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaEventSynchronize(events_[end]), "cudaEventSynchronize"));
    return FromCuda(cudaEventElapsedTime(ms, events_[start], events_[end]), "cudaEventElapsedTime");
  }

  Status WaitEvent(int event, int stream) override {
    if (!events_.count(event)) return Invalid("wait_event: unknown event ", event);
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return FromCuda(cudaStreamWaitEvent(s, events_[event], 0), "cudaStreamWaitEvent");
  }

  // Relaxed capture mode: Scratch::Reserve may cudaMalloc during a capture, which the other modes
  // forbid. The stream's own work space is set aside meanwhile, so the graph's blocks are its own:
  // later direct calls on the stream may outgrow (and free) theirs while the graph still runs.
  Status BeginCapture(int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    if (stream == 0) return Invalid("begin_capture: stream 0 (the default stream) cannot be captured; capture a stream from createStream()");
    if (saved_scratch_.count(stream)) return Invalid("begin_capture: stream ", stream, " is already capturing");
    KDTREE_RETURN_IF_ERROR(FromCuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), "begin_capture"));
    saved_scratch_[stream] = std::move(scratch_[stream]);
    scratch_[stream] = Scratch{};
    return Status::Ok();
  }
  Status EndCapture(int stream, int* graph) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    auto saved = saved_scratch_.find(stream);
    if (saved == saved_scratch_.end()) return Invalid("end_capture: stream ", stream, " is not capturing");
    Graph g;
    g.scratch = std::move(scratch_[stream]);
    g.scratch.capturing = false;
    scratch_[stream] = std::move(saved->second);
    saved_scratch_.erase(saved);
    // an op that failed to launch during the capture invalidated it: the error says so here
    Status st = FromCuda(cudaStreamEndCapture(s, &g.graph), "end_capture");
    if (st.ok()) st = FromCuda(cudaGraphInstantiate(&g.exec, g.graph, 0), "end_capture: instantiate the graph");
    if (st.ok()) {
      *graph = next_graph_++;
      graphs_[*graph] = std::move(g);
    } else {
      deferred_graphs_.push_back(std::move(g));
    }
    if (saved_scratch_.empty()) FreeDeferred();
    return st;
  }
  Status LaunchGraph(int graph, int stream) override {
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    auto it = graphs_.find(graph);
    if (it == graphs_.end()) return Invalid("launch_graph: unknown graph ", graph);
    return FromCuda(cudaGraphLaunch(it->second.exec, s), "launch_graph");
  }
  Status DestroyGraph(int graph) override {
    auto it = graphs_.find(graph);
    if (it == graphs_.end()) return Invalid("destroy_graph: unknown graph ", graph);
    deferred_graphs_.push_back(std::move(it->second));
    graphs_.erase(it);
    if (saved_scratch_.empty()) FreeDeferred();  // its blocks' cudaFree waits for the device: not during a capture
    return Status::Ok();
  }

#define KDTREE_DISPATCH(Name, Launch, ...)                      \
  Status Name(const Name##Args& a, int stream) override {      \
    cudaStream_t s;                                             \
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));                 \
    return Launch(a, s __VA_ARGS__);                            \
  }
  KDTREE_DISPATCH(W4A16Pack, LaunchW4A16Pack)
  Status W4A16Gemm(const W4A16GemmArgs& a, int stream) override {
    last_form_ = nullptr;
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return LaunchW4A16Gemm(a, s, ScratchOf(stream), Gemms());
  }
  Status Gemm(const GemmArgs& a, int stream) override {
    last_form_ = nullptr;
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    return LaunchGemm(a, s, ScratchOf(stream), Gemms());
  }
  Status MoeGemm(const MoeGemmArgs& a, int stream) override {
    last_form_ = nullptr;
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    if (!a.w.present()) return LaunchMoeGemm(a, s, ScratchOf(stream), Gemms());
    last_form_ = "bf16-experts";  // moe_bf16.cu: one form
    return LaunchMoeGemmBf16(a, s);
  }
  Status SetForcedForms(const char* gemm, const char* w4a16_prefill) override {
    policy::ForcedForms f;
    KDTREE_RETURN_IF_ERROR(policy::ParseGemmForm(gemm, &f.gemm));
    KDTREE_RETURN_IF_ERROR(policy::ParsePrefillOverride(w4a16_prefill, &f.w4a16_prefill));
    forced_ = f;
    return Status::Ok();
  }
  const char* LastForm() const override { return last_form_; }
  KDTREE_DISPATCH(MlaAttention, LaunchMlaAttention, , ScratchOf(stream), info_.multiprocessors)
  KDTREE_DISPATCH(Embedding, LaunchEmbedding)
  KDTREE_DISPATCH(RmsNorm, LaunchRmsNorm)
  KDTREE_DISPATCH(Rope, LaunchRope)
  KDTREE_DISPATCH(SiluMul, LaunchSiluMul)
  KDTREE_DISPATCH(GqaAttention, LaunchGqaAttention)
  KDTREE_DISPATCH(Add, LaunchAdd)
  KDTREE_DISPATCH(Router, LaunchRouter)
  KDTREE_DISPATCH(Argmax, LaunchArgmax, , ScratchOf(stream))
  KDTREE_DISPATCH(Topk, LaunchTopk, , ScratchOf(stream))
  KDTREE_DISPATCH(KvWrite, LaunchKvWrite)
  KDTREE_DISPATCH(MlaInputs, LaunchMlaInputs)
  KDTREE_DISPATCH(MlaQuery, LaunchMlaQuery)
  Status DdtreeBuild(const DdtreeBuildArgs& a, int stream) override {
    last_form_ = nullptr;
    cudaStream_t s;
    KDTREE_RETURN_IF_ERROR(Stream(stream, &s));
    const char* form = nullptr;
    KDTREE_RETURN_IF_ERROR(LaunchDdtreeBuild(a, s, ScratchOf(stream), &form));
    last_form_ = form;
    return Status::Ok();
  }
  KDTREE_DISPATCH(DdtreeAccept, LaunchDdtreeAccept)
  KDTREE_DISPATCH(KvCommit, LaunchKvCommit)
  KDTREE_DISPATCH(Arange, LaunchArange)
#undef KDTREE_DISPATCH

 private:
  // What the GEMM launchers read of this backend, and where they report the form they ran.
  GemmContext Gemms() { return GemmContext{info_.multiprocessors, forced_, &last_form_}; }
  // Every call makes this backend's device current; asking first skips the set when it already is:
  // cudaSetDevice costs host time on every call even when the device does not change.
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
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    Scratch scratch;  // the work space its kernels were captured with
  };
  static void DropGraph(Graph& g) {
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
    if (g.graph != nullptr) cudaGraphDestroy(g.graph);
    g.scratch.Release();  // cudaFree waits for launches still running
  }
  // Every op's work space: during any capture it keeps what it outgrows (Scratch::capturing).
  Scratch& ScratchOf(int stream) {
    Scratch& sc = scratch_[stream];
    sc.capturing = !saved_scratch_.empty();
    return sc;
  }
  // After the last capture: what was freed or outgrown meanwhile (outgrown blocks once their stream
  // has drained).
  void FreeDeferred() {
    for (Graph& g : deferred_graphs_) DropGraph(g);
    deferred_graphs_.clear();
    for (void* p : deferred_frees_) cudaFree(p);
    deferred_frees_.clear();
    for (auto& [id, sc] : scratch_) {
      if (sc.retired.empty()) continue;
      cudaStreamSynchronize(streams_[id]);
      for (void* p : sc.retired) cudaFree(p);
      sc.retired.clear();
    }
  }
  int device_;
  DeviceInfo info_;
  policy::ForcedForms forced_;        // SetForcedForms (the binding sets the environment's at creation)
  const char* last_form_ = nullptr;  // LastForm()
  std::map<int, Scratch> saved_scratch_;  // capturing stream -> its own work space, set aside
  std::map<int, Graph> graphs_;
  std::vector<Graph> deferred_graphs_;  // destroyed or failed during a capture
  std::vector<void*> deferred_frees_;   // buffers freed during a capture
  int next_graph_ = 1;
  std::map<int, cudaStream_t> streams_;
  std::map<int, cudaEvent_t> events_;
  std::set<int> recorded_events_;  // events recorded at least once: only those can be timed
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
