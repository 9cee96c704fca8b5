// A backend owns memory and runs ops: `cpu` (the C++ twin of every kernel, multi-threaded) or
// `cuda` (one device). The Node binding holds one Backend per loaded variant and dispatches every
// op to it after validate.cc has checked the arguments.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kdtree/ops.h"
#include "kdtree/status.h"

namespace kdtree {

struct DeviceInfo {
  std::string name;
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  int64_t total_memory = 0;
  int driver_version = 0, runtime_version = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* kind() const = 0;  // "cpu" or "cuda"
  virtual DeviceInfo info() const = 0;

  // Memory: device memory for cuda, 64-byte aligned host memory for cpu.
  virtual Status Alloc(size_t bytes, void** ptr) = 0;
  virtual Status Free(void* ptr) = 0;
  virtual Status CopyToDevice(void* dst, const void* src, size_t bytes, int stream) = 0;
  virtual Status CopyToHost(void* dst, const void* src, size_t bytes, int stream) = 0;
  virtual Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, int stream) = 0;
  virtual Status Fill(void* dst, uint8_t value, size_t bytes, int stream) = 0;
  // Pinned (page-locked) host memory, which copies to the device can read asynchronously (cpu:
  // ordinary 64-byte aligned memory). FreeHost must wait for copies still reading it.
  virtual Status AllocHost(size_t bytes, void** ptr) = 0;
  virtual Status FreeHost(void* ptr) = 0;
  // Host -> device queued on `stream`, returning at once: `src` is pinned memory (AllocHost) that
  // stays untouched until the stream has passed the copy. cpu: complete on return.
  virtual Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, int stream) = 0;
  // Free and total device memory in bytes (cpu: the host's available and total memory).
  virtual Status MemoryInfo(int64_t* free, int64_t* total) = 0;
  // Keeps `stream` busy for about `microseconds` (a device-side wait): work queued behind it then
  // runs back to back, so benchmarks time the device and not the host's launch rate (nvbench's
  // blocking kernel). The CPU backend runs every op synchronously and returns at once.
  virtual Status Hold(int64_t microseconds, int stream) = 0;

  // Streams: 0 is the default stream; others are created on demand. Ops are asynchronous on cuda.
  virtual Status CreateStream(int* stream) = 0;
  virtual Status DestroyStream(int stream) = 0;
  virtual Status Synchronize(int stream) = 0;  // -1: the whole device
  virtual Status CheckStream(int stream) = 0;  // an error unless the stream exists
  // Events for timing device work: record on a stream, then read elapsed milliseconds.
  virtual Status CreateEvent(int* event) = 0;
  virtual Status DestroyEvent(int event) = 0;
  virtual Status RecordEvent(int event, int stream) = 0;
  virtual Status ElapsedMs(int start, int end, float* ms) = 0;
  // Work queued on `stream` after this waits (on the device, the host does not) for the work
  // queued before the event's last record; an event never recorded is no wait (CUDA's rule).
  virtual Status WaitEvent(int event, int stream) = 0;

  // Graphs: the work queued on one created stream between BeginCapture and EndCapture, replayed as
  // a whole by LaunchGraph with one host call: the engine's decode step costs one launch instead of
  // ~10-15 calls per layer of argument parsing and launching. cuda: a CUDA stream capture (the work
  // space its ops reserve meanwhile belongs to the graph); cpu: the binding hands each op of the
  // capture to RecordCall instead of running it. Everything host-side (buffer addresses, shapes,
  // scalars such as MLA's base) is fixed at capture; buffer contents are read at each launch.
  virtual Status BeginCapture(int stream) = 0;
  virtual Status EndCapture(int stream, int* graph) = 0;
  virtual Status LaunchGraph(int graph, int stream) = 0;
  virtual Status DestroyGraph(int graph) = 0;
  // Whether a capture keeps the op calls themselves (cpu: ops run on the calling thread, so there is
  // no queue to capture); `call` then runs the op, on any stream, at each launch.
  virtual bool RecordsCalls() const { return false; }
  virtual Status RecordCall(int stream, std::function<Status()> call) { return Unsupported(kind(), ": op calls are not recorded; stream ", stream, " is captured by the device"); }
  // For a library that queues work of its own (NCCL): makes this backend's device current and
  // gives the native stream behind `stream` (cuda: its cudaStream_t; null for the default stream).
  virtual Status NativeStream(int stream, void** out) { return Unsupported(kind(), ": no native streams; NCCL needs the cuda backend"); }

  // Forced GEMM kernel forms (tests, tuning), as KDTREE_GEMM_FORM and KDTREE_W4A16_PREFILL spell
  // them ("" or nullptr: the rule); an unknown value is an error. The binding sets them from the
  // environment once, when it creates the backend, so no op reads the environment. A backend whose
  // GEMMs have one form (cpu) checks the values and runs that form.
  virtual Status SetForcedForms(const char* gemm, const char* w4a16_prefill) = 0;
  // The kernel form the last Gemm, W4A16Gemm, MoeGemm or DdtreeBuild call ran, a static name (cuda:
  // "split", "wgmma", "one-token", "cluster", ... from dispatch_policy.h; cpu: "cpu"); nullptr before the first call,
  // and after a call that ran nothing (an empty shape) or failed before its launch.
  virtual const char* LastForm() const = 0;

  virtual Status W4A16Pack(const W4A16PackArgs& a, int stream) = 0;
  virtual Status W4A16Gemm(const W4A16GemmArgs& a, int stream) = 0;
  virtual Status Gemm(const GemmArgs& a, int stream) = 0;
  virtual Status MoeGemm(const MoeGemmArgs& a, int stream) = 0;
  virtual Status MlaAttention(const MlaAttentionArgs& a, int stream) = 0;
  virtual Status Embedding(const EmbeddingArgs& a, int stream) = 0;
  virtual Status RmsNorm(const RmsNormArgs& a, int stream) = 0;
  virtual Status Rope(const RopeArgs& a, int stream) = 0;
  virtual Status SiluMul(const SiluMulArgs& a, int stream) = 0;
  virtual Status GqaAttention(const GqaAttentionArgs& a, int stream) = 0;
  virtual Status Add(const AddArgs& a, int stream) = 0;
  virtual Status Router(const RouterArgs& a, int stream) = 0;
  virtual Status Argmax(const ArgmaxArgs& a, int stream) = 0;
  virtual Status Topk(const TopkArgs& a, int stream) = 0;
  virtual Status KvWrite(const KvWriteArgs& a, int stream) = 0;
  virtual Status MlaInputs(const MlaInputsArgs& a, int stream) = 0;
  virtual Status MlaQuery(const MlaQueryArgs& a, int stream) = 0;
  virtual Status DdtreeBuild(const DdtreeBuildArgs& a, int stream) = 0;
  virtual Status DdtreeAccept(const DdtreeAcceptArgs& a, int stream) = 0;
  virtual Status KvCommit(const KvCommitArgs& a, int stream) = 0;
  virtual Status Arange(const ArangeArgs& a, int stream) = 0;
};

std::unique_ptr<Backend> MakeCpuBackend();
#ifdef KDTREE_WITH_CUDA
// Fails (with the reason) when no usable device or driver is present.
Status MakeCudaBackend(int device, std::unique_ptr<Backend>* out);

// What the driver and runtime report, without failing: the loader's compatibility check.
struct CudaProbeResult {
  bool ok = false;
  std::string error;
  int driver_version = 0, runtime_version = 0, device_count = 0;
  std::vector<DeviceInfo> devices;
};
CudaProbeResult ProbeCuda();
#endif

}  // namespace kdtree
