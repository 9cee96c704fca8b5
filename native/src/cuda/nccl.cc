// See nccl.h. The function types below are NCCL's (src/nccl.h.in) with ncclComm_t, cudaStream_t
// and the enums spelled as what they are in the ABI: pointers and ints.
#include "nccl.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

namespace kdtree {
namespace nccl {
namespace {

constexpr const char* kLibrary = "libnccl.so.2";
constexpr int kSum = 0;          // ncclSum
constexpr int kInProgress = 7;   // ncclInProgress

// The oldest NCCL the engine runs on, as ncclGetVersion's code: 2.10.3, the release that brought
// ncclBfloat16 (9, which DataType maps bf16 to). The rest of what it uses is older: collectives
// captured into CUDA graphs (2.9), ncclCommAbort and ncclCommGetAsyncError for the watchdog (2.4),
// and ncclGetLastError (2.13) is optional. ncclInProgress (7, 2.14) is only compared against: an
// older library never returns it.
constexpr int kMinVersion = 21003;
constexpr const char* kMinVersionName = "2.10.3";

// ncclGetVersion's code as major.minor.patch: major * 10000 + minor * 100 + patch since 2.9,
// major * 1000 + minor * 100 + patch before.
std::string VersionName(int code) {
  const bool wide = code >= 10000;
  const int major = wide ? code / 10000 : code / 1000;
  const int minor = wide ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

// The file the dynamic loader took for the library (found through LD_LIBRARY_PATH or the cache).
std::string LibraryPath(void* symbol) {
  Dl_info info{};
  if (symbol != nullptr && dladdr(symbol, &info) != 0 && info.dli_fname != nullptr) return info.dli_fname;
  return kLibrary;
}

using GetVersionFn = int (*)(int*);
using GetUniqueIdFn = int (*)(UniqueId*);
using CommInitRankFn = int (*)(void**, int, UniqueId, int);
using AllReduceFn = int (*)(const void*, void*, size_t, int, int, void*, void*);
using AllGatherFn = int (*)(const void*, void*, size_t, int, void*, void*);
using BroadcastFn = int (*)(const void*, void*, size_t, int, int, void*, void*);
using CommFn = int (*)(void*);
using GetAsyncErrorFn = int (*)(void*, int*);
using GetErrorStringFn = const char* (*)(int);
using GetLastErrorFn = const char* (*)(void*);

struct Api {
  GetVersionFn get_version = nullptr;
  GetUniqueIdFn get_unique_id = nullptr;
  CommInitRankFn comm_init_rank = nullptr;
  AllReduceFn all_reduce = nullptr;
  AllGatherFn all_gather = nullptr;
  BroadcastFn broadcast = nullptr;
  CommFn comm_abort = nullptr;
  CommFn comm_destroy = nullptr;
  GetAsyncErrorFn get_async_error = nullptr;
  GetErrorStringFn get_error_string = nullptr;
  GetLastErrorFn get_last_error = nullptr;  // NCCL 2.13+: optional
};

Api api;
Status load_status;
std::once_flag load_once;

template <typename Fn>
bool Symbol(void* lib, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

void LoadOnce() {
  void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    load_status = MakeStatus(Code::kUnsupported, "nccl: cannot load ", kLibrary, " (", why ? why : "not found",
                             "); tensor parallelism on GPUs needs NCCL 2: install it (e.g. the libnccl2 package, or pip's nvidia-nccl-cu13) and make it findable (LD_LIBRARY_PATH)");
    return;
  }
  std::string missing;
  Symbol(lib, "ncclGetVersion", &api.get_version, &missing);
  Symbol(lib, "ncclGetUniqueId", &api.get_unique_id, &missing);
  Symbol(lib, "ncclCommInitRank", &api.comm_init_rank, &missing);
  Symbol(lib, "ncclAllReduce", &api.all_reduce, &missing);
  Symbol(lib, "ncclAllGather", &api.all_gather, &missing);
  Symbol(lib, "ncclBroadcast", &api.broadcast, &missing);
  Symbol(lib, "ncclCommAbort", &api.comm_abort, &missing);
  Symbol(lib, "ncclCommDestroy", &api.comm_destroy, &missing);
  Symbol(lib, "ncclCommGetAsyncError", &api.get_async_error, &missing);
  Symbol(lib, "ncclGetErrorString", &api.get_error_string, &missing);
  api.get_last_error = reinterpret_cast<GetLastErrorFn>(dlsym(lib, "ncclGetLastError"));
  if (!missing.empty()) {
    api = Api{};
    dlclose(lib);
    load_status = MakeStatus(Code::kUnsupported, "nccl: ", kLibrary, " lacks ", missing, "; install NCCL ", kMinVersionName, " or newer");
    return;
  }
  int version = 0;
  const int r = api.get_version(&version);
  if (r != 0 || version < kMinVersion) {
    const std::string path = LibraryPath(reinterpret_cast<void*>(api.get_version));
    api = Api{};
    dlclose(lib);
    load_status = r != 0 ? MakeStatus(Code::kUnsupported, "nccl: ncclGetVersion of ", path, " failed: ncclResult ", r)
                         : MakeStatus(Code::kUnsupported, "nccl: ", path, " is NCCL ", VersionName(version), " (version code ", version, "); the engine needs NCCL ",
                                      kMinVersionName, " or newer (ncclBfloat16): install a newer one (e.g. the libnccl2 package, or pip's nvidia-nccl-cu13) and make it findable (LD_LIBRARY_PATH)");
  }
}

// A failed ncclResult_t as a Status: the op and its sizes, NCCL's name for the result and, where
// the library keeps one, its last message for the communicator.
template <typename... Parts>
Status Failed(int result, void* comm, Parts&&... what) {
  std::string detail = api.get_error_string ? api.get_error_string(result) : "";
  if (api.get_last_error != nullptr) {
    const char* last = api.get_last_error(comm);
    if (last != nullptr && *last != '\0') detail += std::string(detail.empty() ? "" : ": ") + last;
  }
  return MakeStatus(Code::kDeviceError, std::forward<Parts>(what)..., ": ncclResult ", result, detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")");
}

}  // namespace

bool DataType(DType t, int* out) {
  switch (t) {
    case DType::kF32: *out = 7; return true;   // ncclFloat32
    case DType::kF16: *out = 6; return true;   // ncclFloat16
    case DType::kBF16: *out = 9; return true;  // ncclBfloat16
    case DType::kI32: *out = 2; return true;   // ncclInt32
    case DType::kU8: *out = 1; return true;    // ncclUint8
    case DType::kF64: *out = 8; return true;   // ncclFloat64
  }
  return false;
}

Status Load() {
  std::call_once(load_once, LoadOnce);
  return load_status;
}

Status Version(int* version) {
  KDTREE_RETURN_IF_ERROR(Load());
  const int r = api.get_version(version);
  return r == 0 ? Status::Ok() : Failed(r, nullptr, "ncclGetVersion");
}

Status GetUniqueId(UniqueId* id) {
  KDTREE_RETURN_IF_ERROR(Load());
  std::memset(id, 0, sizeof(*id));
  const int r = api.get_unique_id(id);
  return r == 0 ? Status::Ok() : Failed(r, nullptr, "ncclGetUniqueId");
}

Status CommInitRank(void** comm, int world, const UniqueId& id, int rank) {
  KDTREE_RETURN_IF_ERROR(Load());
  *comm = nullptr;
  const int r = api.comm_init_rank(comm, world, id, rank);
  return r == 0 ? Status::Ok() : Failed(r, nullptr, "ncclCommInitRank (rank ", rank, " of ", world, ")");
}

Status AllReduceSum(const void* send, void* recv, size_t count, int dtype, void* comm, void* stream) {
  const int r = api.all_reduce(send, recv, count, dtype, kSum, comm, stream);
  return r == 0 || r == kInProgress ? Status::Ok() : Failed(r, comm, "ncclAllReduce (sum of ", count, " values of ncclDataType ", dtype, ")");
}

Status AllGather(const void* send, void* recv, size_t send_count, int dtype, void* comm, void* stream) {
  const int r = api.all_gather(send, recv, send_count, dtype, comm, stream);
  return r == 0 || r == kInProgress ? Status::Ok() : Failed(r, comm, "ncclAllGather (", send_count, " values of ncclDataType ", dtype, " per rank)");
}

Status Broadcast(const void* send, void* recv, size_t count, int dtype, int root, void* comm, void* stream) {
  const int r = api.broadcast(send, recv, count, dtype, root, comm, stream);
  return r == 0 || r == kInProgress ? Status::Ok() : Failed(r, comm, "ncclBroadcast (", count, " values of ncclDataType ", dtype, " from rank ", root, ")");
}

Status AsyncError(void* comm, int* result, std::string* message) {
  int async = 0;
  const int r = api.get_async_error(comm, &async);
  if (r != 0) return Failed(r, comm, "ncclCommGetAsyncError");
  *result = async;
  message->clear();
  if (async != 0 && async != kInProgress) *message = Failed(async, comm, "nccl communicator").message;
  return Status::Ok();
}

Status CommAbort(void* comm) {
  const int r = api.comm_abort(comm);
  return r == 0 ? Status::Ok() : Failed(r, nullptr, "ncclCommAbort");
}

Status CommDestroy(void* comm) {
  const int r = api.comm_destroy(comm);
  return r == 0 ? Status::Ok() : Failed(r, nullptr, "ncclCommDestroy");
}

struct Watchdog::State {
  void* comm;
  int rank, world, interval_ms;
  std::atomic<int64_t> deadline_ms{0};  // steady-clock ms; 0 = disarmed
  std::atomic<bool> fired{false};
  mutable std::mutex m;
  std::condition_variable wake;
  bool stop = false;
  std::string reason;
  std::thread thread;
};

static int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Watchdog::Watchdog(void* comm, int rank, int world, int interval_ms) : state_(new State) {
  State* s = state_;
  s->comm = comm;
  s->rank = rank;
  s->world = world;
  s->interval_ms = interval_ms;
  s->thread = std::thread([s] {
    std::unique_lock<std::mutex> lock(s->m);
    while (!s->stop) {
      s->wake.wait_for(lock, std::chrono::milliseconds(s->interval_ms));
      if (s->stop) break;
      int result = 0;
      std::string message;
      std::string why;
      const Status polled = AsyncError(s->comm, &result, &message);
      if (!polled.ok()) why = polled.message;
      else if (!message.empty()) why = message;
      const int64_t deadline = s->deadline_ms.load();
      if (why.empty() && deadline != 0 && NowMs() > deadline) why = "timed out: a collective did not complete within the bound (a rank stalled or died)";
      if (why.empty()) continue;
      s->reason = "nccl rank " + std::to_string(s->rank) + " of " + std::to_string(s->world) + ": " + why + "; the communicator was aborted";
      CommAbort(s->comm);
      s->fired = true;
      break;
    }
  });
}

Watchdog::~Watchdog() {
  Stop();
  delete state_;
}

void Watchdog::Stop() {
  {
    std::lock_guard<std::mutex> lock(state_->m);
    state_->stop = true;
  }
  state_->wake.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

void Watchdog::Arm(int64_t ms) { state_->deadline_ms = NowMs() + ms; }
void Watchdog::Disarm() { state_->deadline_ms = 0; }
bool Watchdog::fired() const { return state_->fired.load(); }
std::string Watchdog::reason() const {
  std::lock_guard<std::mutex> lock(state_->m);
  return state_->reason;
}

}  // namespace nccl
}  // namespace kdtree
