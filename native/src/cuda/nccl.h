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

}  // namespace nccl
}  // namespace kdtree
