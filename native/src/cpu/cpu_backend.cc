// The cpu backend: memory, streams, events and graphs on the host, and the op table, each op the
// CPU twin of the CUDA op of the same name (twins.h lists them and their files). Ops run
// synchronously on the calling thread (their work spread over the thread pool), so a stream only
// has to exist and an event is a timestamp.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include <unistd.h>

#include "../common/dispatch_policy.h"
#include "kdtree/backend.h"
#include "thread_pool.h"
#include "twins.h"

namespace kdtree {
namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend() : pool_(std::max(1u, std::thread::hardware_concurrency())) {}
  const char* kind() const override { return "cpu"; }
  DeviceInfo info() const override {
    DeviceInfo d;
    d.name = "cpu (" + std::to_string(pool_.size()) + " threads)";
    d.multiprocessors = static_cast<int>(pool_.size());
    return d;
  }

  Status Alloc(size_t bytes, void** ptr) override {
    *ptr = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
    if (*ptr == nullptr) return MakeStatus(Code::kOutOfMemory, "cpu: cannot allocate ", bytes, " bytes");
    return Status::Ok();
  }
  Status Free(void* ptr) override {
    std::free(ptr);
    return Status::Ok();
  }
  Status AllocHost(size_t bytes, void** ptr) override { return Alloc(bytes, ptr); }
  Status FreeHost(void* ptr) override { return Free(ptr); }
  Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, int stream) override {
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    return Copy(dst, src, bytes);
  }
  // The host's memory: MemAvailable and MemTotal of /proc/meminfo (what the kernel could hand out
  // without swapping), else the free and total physical pages.
  Status MemoryInfo(int64_t* free, int64_t* total) override {
    *free = *total = -1;
    if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
      char key[64];
      long long kib = 0;
      while (std::fscanf(f, "%63s %lld kB", key, &kib) == 2) {
        if (std::strcmp(key, "MemTotal:") == 0) *total = kib * 1024;
        if (std::strcmp(key, "MemAvailable:") == 0) *free = kib * 1024;
      }
      std::fclose(f);
    }
    const int64_t page = sysconf(_SC_PAGESIZE);
    if (*total < 0) *total = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * page;
    if (*free < 0) *free = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
    if (*total <= 0 || *free < 0) return MakeStatus(Code::kDeviceError, "cpu: the host's memory could not be read (/proc/meminfo, sysconf)");
    return Status::Ok();
  }
  Status CopyToDevice(void* dst, const void* src, size_t bytes, int) override { return Copy(dst, src, bytes); }
  Status CopyToHost(void* dst, const void* src, size_t bytes, int) override { return Copy(dst, src, bytes); }
  Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes, int) override { return Copy(dst, src, bytes); }
  Status Fill(void* dst, uint8_t value, size_t bytes, int) override {
    std::memset(dst, value, bytes);
    return Status::Ok();
  }
  Status Hold(int64_t, int stream) override { return CheckStream(stream); }  // ops here are synchronous: nothing queues
  Status CreateStream(int* stream) override {
    *stream = next_stream_++;
    streams_.insert(*stream);
    return Status::Ok();
  }
  Status DestroyStream(int stream) override {
    if (stream == 0 || streams_.count(stream) == 0) return Invalid("destroy_stream: unknown stream ", stream);
    if (recording_.count(stream)) return Invalid("destroy_stream: stream ", stream, " is capturing; end the capture first");
    streams_.erase(stream);
    return Status::Ok();
  }
  Status Synchronize(int stream) override { return stream < 0 ? Status::Ok() : CheckStream(stream); }
  Status CheckStream(int stream) override {
    if (stream != 0 && streams_.count(stream) == 0) return Invalid("unknown stream ", stream, " (create it with createStream())");
    return Status::Ok();
  }
  Status CreateEvent(int* event) override {
    *event = next_event_++;
    events_[*event] = kNeverRecorded;
    return Status::Ok();
  }
  Status DestroyEvent(int event) override {
    if (events_.erase(event) == 0) return Invalid("destroy_event: unknown event ", event);
    return Status::Ok();
  }
  Status RecordEvent(int event, int stream) override {
    if (!events_.count(event)) return Invalid("record_event: unknown event ", event);
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    events_[event] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    return Status::Ok();
  }
  Status ElapsedMs(int start, int end, float* ms) override {
    for (const int e : {start, end}) {
      auto it = events_.find(e);
      if (it == events_.end()) return Invalid("elapsed_ms: unknown event ", e);
      if (it->second == kNeverRecorded) return Invalid("elapsed_ms: event ", e, " was never recorded (recordEvent first)");
    }
    *ms = static_cast<float>(events_[end] - events_[start]);
    return Status::Ok();
  }

  Status WaitEvent(int event, int stream) override {  // ops here are synchronous: nothing to wait for
    if (!events_.count(event)) return Invalid("wait_event: unknown event ", event);
    return CheckStream(stream);
  }

  // A graph is the op calls of its capture, replayed in order on the calling thread.
  Status BeginCapture(int stream) override {
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    if (stream == 0) return Invalid("begin_capture: stream 0 (the default stream) cannot be captured; capture a stream from createStream()");
    if (!recording_.emplace(stream, std::vector<std::function<Status()>>{}).second) return Invalid("begin_capture: stream ", stream, " is already capturing");
    return Status::Ok();
  }
  Status EndCapture(int stream, int* graph) override {
    auto it = recording_.find(stream);
    if (it == recording_.end()) return Invalid("end_capture: stream ", stream, " is not capturing");
    *graph = next_graph_++;
    graphs_[*graph] = std::move(it->second);
    recording_.erase(it);
    return Status::Ok();
  }
  bool RecordsCalls() const override { return true; }
  Status RecordCall(int stream, std::function<Status()> call) override {
    auto it = recording_.find(stream);
    if (it == recording_.end()) return Invalid("record: stream ", stream, " is not capturing");
    it->second.push_back(std::move(call));
    return Status::Ok();
  }
  Status LaunchGraph(int graph, int stream) override {
    KDTREE_RETURN_IF_ERROR(CheckStream(stream));
    auto it = graphs_.find(graph);
    if (it == graphs_.end()) return Invalid("launch_graph: unknown graph ", graph);
    const std::vector<std::function<Status()>>& calls = it->second;
    for (size_t i = 0; i < calls.size(); ++i) {
      const Status s = calls[i]();
      if (!s.ok()) return MakeStatus(s.code, "graph ", graph, ", call ", i + 1, " of ", calls.size(), ": ", s.message);
    }
    return Status::Ok();
  }
  Status DestroyGraph(int graph) override {
    if (graphs_.erase(graph) == 0) return Invalid("destroy_graph: unknown graph ", graph);
    return Status::Ok();
  }

  // The ops: each runs its twin (twins.h), in the file named as the cuda op's.
  Status W4A16Pack(const W4A16PackArgs& a, int) override {
    cpu::W4A16Pack(a, pool_);
    return Status::Ok();
  }

  Status SetForcedForms(const char* gemm, const char* w4a16_prefill) override {
    policy::ForcedForms f;
    KDTREE_RETURN_IF_ERROR(policy::ParseGemmForm(gemm, &f.gemm));
    return policy::ParsePrefillOverride(w4a16_prefill, &f.w4a16_prefill);
  }
  const char* LastForm() const override { return last_form_; }

  Status W4A16Gemm(const W4A16GemmArgs& a, int) override {
    last_form_ = "cpu";
    return cpu::W4A16Gemm(a, pool_);
  }
  Status Gemm(const GemmArgs& a, int) override {
    last_form_ = "cpu";
    return cpu::Gemm(a, pool_);
  }
  Status MoeGemm(const MoeGemmArgs& a, int) override {
    last_form_ = "cpu";
    return a.w.present() ? cpu::MoeGemmBf16(a, pool_) : cpu::MoeGemm(a, pool_);
  }
  Status MlaAttention(const MlaAttentionArgs& a, int) override { return cpu::MlaAttention(a, pool_); }
  Status Embedding(const EmbeddingArgs& a, int) override { return cpu::Embedding(a, pool_); }
  Status RmsNorm(const RmsNormArgs& a, int) override { return cpu::RmsNorm(a, pool_); }
  Status Rope(const RopeArgs& a, int) override { return cpu::Rope(a, pool_); }
  Status GqaAttention(const GqaAttentionArgs& a, int) override { return cpu::GqaAttention(a, pool_); }
  Status SiluMul(const SiluMulArgs& a, int) override { return cpu::SiluMul(a, pool_); }
  Status Add(const AddArgs& a, int) override { return cpu::Add(a, pool_); }
  Status Router(const RouterArgs& a, int) override { return cpu::Router(a, pool_); }
  Status Argmax(const ArgmaxArgs& a, int) override { return cpu::Argmax(a, pool_); }
  Status Topk(const TopkArgs& a, int) override { return cpu::Topk(a, pool_); }
  Status KvWrite(const KvWriteArgs& a, int) override { return cpu::KvWrite(a, pool_); }
  Status MlaInputs(const MlaInputsArgs& a, int) override { return cpu::MlaInputs(a, pool_); }
  Status MlaQuery(const MlaQueryArgs& a, int) override { return cpu::MlaQuery(a, pool_); }
  Status DdtreeBuild(const DdtreeBuildArgs& a, int) override {
    last_form_ = "cpu";
    return cpu::DdtreeBuild(a, pool_);
  }
  Status DdtreeAccept(const DdtreeAcceptArgs& a, int) override { return cpu::DdtreeAccept(a, pool_); }
  Status KvCommit(const KvCommitArgs& a, int) override { return cpu::KvCommit(a, pool_); }
  Status Arange(const ArangeArgs& a, int) override { return cpu::Arange(a, pool_); }

 private:
  static Status Copy(void* dst, const void* src, size_t bytes) {
    // an empty or detached view may pass a null pointer, which memmove may not take even for 0 bytes
    if (bytes > 0) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  ThreadPool pool_;
  const char* last_form_ = nullptr;  // LastForm()
  int next_stream_ = 1, next_event_ = 1;
  std::set<int> streams_;
  static constexpr double kNeverRecorded = -1;  // an event's time before its first record
  std::map<int, double> events_;  // event -> the steady-clock ms of its last record
  int next_graph_ = 1;
  std::map<int, std::vector<std::function<Status()>>> recording_;  // capturing stream -> its calls so far
  std::map<int, std::vector<std::function<Status()>>> graphs_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace kdtree
