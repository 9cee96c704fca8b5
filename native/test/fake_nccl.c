// A stand-in for libnccl.so.2 with NCCL's ABI (NVIDIA/nccl src/nccl.h.in), for nccl_loader_test:
// it checks what the loader passes (the 128-byte id by value, world and rank) and lets the test set
// the communicator's asynchronous error and count aborts.
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
static int async_error = 0;
static int aborts = 0;

// the version code: 2.27.3 unless built with -DFAKE_NCCL_VERSION=... (an old library for the loader's check)
#ifndef FAKE_NCCL_VERSION
#define FAKE_NCCL_VERSION 22703
#endif
int ncclGetVersion(int* v) { *v = FAKE_NCCL_VERSION; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { memset(id, 7, sizeof(*id)); return 0; }
// succeeds for rank 1 of 2 with an id of all 7s (the last byte proves the id came whole, by value)
int ncclCommInitRank(void** comm, int n, ncclUniqueId id, int rank) {
  if (id.internal[0] != 7 || id.internal[127] != 7 || n != 2 || rank != 1) return 4;
  *comm = malloc(8);
  return 0;
}
int ncclAllReduce(const void* s, void* r, size_t count, int type, int op, void* comm, void* stream) { return count == 3 ? 5 : 0; }
int ncclAllGather(const void* s, void* r, size_t count, int type, void* comm, void* stream) { return 0; }
int ncclBroadcast(const void* s, void* r, size_t count, int type, int root, void* comm, void* stream) { return 0; }
int ncclCommAbort(void* comm) { aborts++; return 0; }
int ncclCommDestroy(void* comm) { return 0; }
int ncclCommGetAsyncError(void* comm, int* e) { *e = async_error; return 0; }
const char* ncclGetErrorString(int r) { return r == 4 ? "invalid argument" : r == 5 ? "invalid usage" : r == 6 ? "remote process exited or there was a network error" : "unknown"; }
const char* ncclGetLastError(void* comm) { return "fake detail"; }
void fake_set_async(int e) { async_error = e; }
int fake_aborts(void) { return aborts; }
