// The NCCL loader and watchdog (native/src/cuda/nccl.cc) against fake_nccl.c or no library at all:
// built and run by packages/cuda/src/nccl-loader.test.ts with the host C++ compiler (no CUDA).
// Prints one line per case, `name: value`, for the test to compare.
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "nccl.h"

using kdtree::Status;
using namespace kdtree::nccl;

int main() {
  int version = 0;
  Status s = Version(&version);
  std::printf("version: %d %s\n", version, s.message.c_str());
  if (!s.ok()) return 0;  // no library: the message is the case
  UniqueId id;
  GetUniqueId(&id);
  void* comm = nullptr;
  std::printf("init rank 1: %s\n", CommInitRank(&comm, 2, id, 1).ok() ? "ok" : "failed");
  void* other = nullptr;
  std::printf("init rank 0: %s\n", CommInitRank(&other, 2, id, 0).message.c_str());
  std::printf("all-reduce: %s\n", AllReduceSum(nullptr, nullptr, 3, 7, comm, nullptr).message.c_str());
  void* lib = dlopen("libnccl.so.2", RTLD_NOW);
  auto set_async = reinterpret_cast<void (*)(int)>(dlsym(lib, "fake_set_async"));
  auto aborts = reinterpret_cast<int (*)()>(dlsym(lib, "fake_aborts"));
  const auto sleep = [](int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); };
  {
    Watchdog w(comm, 1, 2, 10);
    w.Arm(100);
    w.Disarm();
    sleep(200);
    std::printf("disarmed: fired %d aborts %d\n", w.fired(), aborts());
  }
  {
    Watchdog w(comm, 1, 2, 10);
    w.Arm(100);
    sleep(400);
    std::printf("deadline: fired %d aborts %d %s\n", w.fired(), aborts(), w.reason().c_str());
  }
  {
    Watchdog w(comm, 1, 2, 10);
    set_async(6);
    sleep(200);
    std::printf("async: fired %d aborts %d %s\n", w.fired(), aborts(), w.reason().c_str());
  }
  return 0;
}
