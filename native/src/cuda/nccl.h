// NCCL, loaded at run time: the build machines have no NCCL headers or library, and a host without
// NCCL must still run everything else, so libnccl.so.2 is opened with dlopen on first use and the
// few types the calls need are declared here (NVIDIA/nccl src/nccl.h.in): ncclUniqueId is 128 bytes
// passed by value, ncclComm_t an opaque pointer, ncclResult_t an int, cudaStream_t a pointer.
// Every call returns a Status whose message names the op, its sizes and NCCL's own words.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "kdtree/status.h"
#include "kdtree/tensor.h"

namespace kdtree {
namespace nccl {

constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
struct UniqueId {
  char internal[kUniqueIdBytes];
};

// ncclDataType_t for a kdtree dtype; false when NCCL has no such type.
bool DataType(DType t, int* out);

// Opens libnccl.so.2 once (later calls return the first outcome); the error names the library,
// what dlopen said and what to install.
Status Load();
Status Version(int* version);  // ncclGetVersion: e.g. 22703 for 2.27.3
Status GetUniqueId(UniqueId* id);
// ncclCommInitRank on the current device; blocks until all `world` ranks have joined.
Status CommInitRank(void** comm, int world, const UniqueId& id, int rank);
// Queued on `stream` (a cudaStream_t): captured into a graph like any kernel when it captures.
Status AllReduceSum(const void* send, void* recv, size_t count, int dtype, void* comm, void* stream);
Status AllGather(const void* send, void* recv, size_t send_count, int dtype, void* comm, void* stream);
Status Broadcast(const void* send, void* recv, size_t count, int dtype, int root, void* comm, void* stream);
// The communicator's asynchronous error: 0 (ncclSuccess), 7 (ncclInProgress) or a failure, whose
// text goes to *message.
Status AsyncError(void* comm, int* result, std::string* message);
Status CommAbort(void* comm);
Status CommDestroy(void* comm);

// A thread that watches one communicator, because the thread that owns it may be blocked in a
// synchronize that only an abort can end: every `interval_ms` it polls ncclCommGetAsyncError, and
// while armed it checks the deadline. On an error, or the deadline passing, it aborts the
// communicator (collectives queued on it then fail instead of waiting for a rank that is gone) and
// keeps the reason. The owner must not use the communicator once fired() (the abort freed it).
class Watchdog {
 public:
  Watchdog(void* comm, int rank, int world, int interval_ms);
  ~Watchdog();  // Stop()
  // Stops the thread (it does not abort); after it returns, fired() no longer changes.
  void Stop();
  // Abort unless Disarm() within `ms` from now (the owner arms before work that may block).
  void Arm(int64_t ms);
  void Disarm();
  bool fired() const;
  std::string reason() const;

 private:
  struct State;
  State* state_;
};

}  // namespace nccl
}  // namespace kdtree
