// Where the cluster DDTree build spends its time, on the GPU host (nvcc there; `bash .gpu/run.sh
// ddtree-phases` builds and runs it from the repository root):
//   1. the expansion alone (one warp, the [depth, k] log-probs in shared memory), by tree size;
//   2. one part's pass alone (a block of 1024 threads over 4096 or 8192 values), by k;
//   3. the whole build's kernel, per form (a row over two blocks, or one), launched as the addon
//      launches it (LaunchPdlCluster; the two-block form's opt-in by ClusterOfHalvesFits): time a
//      launch in a graph of 50, and block 0's clock at each phase (median of 11 single launches);
//   4. the floor under 3: an empty cluster of the same blocks.
// It compiles native/src/cuda/ddtree.cu itself with KDTREE_DDTREE_PHASES, which turns on the
// kernel's phase marks (the addon's build leaves them out), and calls its internal functions.
// It measures; the trees these calls build are checked by the self-test (ddtree_build).
#include "cuda/ddtree.cu"
#include "cuda_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

// LaunchDdtreeBuild's other forms take scratch; this tool launches only the cluster kernel.
kdtree::Status kdtree::cuda::Scratch::Reserve(size_t, cudaStream_t) { return kdtree::Status::Ok(); }
kdtree::Status kdtree::cuda::Scratch::Zeroed(size_t, cudaStream_t, void**) { return kdtree::Status::Ok(); }

namespace kdtree {
namespace cuda {
namespace {

// lp: [depth, k] log-probs, each row descending. Writes each run's cycles.
__global__ void ExpandAlone(const double* lp, int depth, int k, int n, int runs, long long* cycles, int* size_out) {
  __shared__ double lp_s[kClusterRows * kFusedK];
  __shared__ int at_s[kMaxNodes], parents_s[kMaxNodes], depths_s[kMaxNodes], size_s;
  for (int i = threadIdx.x; i < depth * k; i += 32) lp_s[i] = lp[i];
  __syncwarp();
  for (int r = 0; r < runs; ++r) {
    __syncwarp();
    const long long t0 = clock64();
    ExpandWarpList(lp_s, nullptr, nullptr, depth, k, n, at_s, parents_s, depths_s, &size_s, size_out, nullptr);
    __syncwarp();
    const long long t1 = clock64();
    if (threadIdx.x == 0) cycles[r] = t1 - t0;
  }
}

// kPerThread as the build's instance for a part of that many values (4 for the halves of 8192)
template <int kPerThread>
__global__ void __launch_bounds__(1024) PartAlone(const float* row, int cols, int k, long long* cycles, float* values, int32_t* tokens) {
  __shared__ ClusterRowScratch scratch;
  __shared__ double2 lse;
  for (int r = 0; r < 4; ++r) {
    __syncthreads();
    const long long t0 = clock64();
    ClusterPart<kPerThread>(row, cols, 0, k, scratch, values, tokens, &lse);
    const long long t1 = clock64();
    if (threadIdx.x == 0) cycles[r] = t1 - t0;
  }
}

__global__ void __launch_bounds__(1024) EmptyKernel(int* out) {
  if (threadIdx.x == 1024) *out = 0;  // never: an empty body the compiler keeps
}

}  // namespace
}  // namespace cuda
}  // namespace kdtree

using namespace kdtree::cuda;

// A launch's Status (LaunchPdlCluster's: the addon's own launch, with its programmatic dependent
// launch attribute) as the tool's exit.
void Check(const kdtree::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.message.c_str());
    std::exit(1);
  }
}

// One line: us a launch in a graph of 50 launches (best of 5 x 4 graphs), and with `phases` block
// 0's cycles between its marks (median of 11 single launches).
template <typename Launch>
void Time(const char* what, bool phases, Launch launch) {
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  Check(launch(s));
  CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 50; ++i) Check(launch(s));
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaGraphLaunch(exec, s));
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < 4; ++i) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  std::printf("%-40s %7.2f us", what, best * 1000.f / 200.f);
  if (phases) {
    constexpr int kRuns = 11;
    long long marks[kRuns][8];
    for (int r = 0; r < kRuns; ++r) {
      const long long zero[8] = {};
      CHECK(cudaMemcpyToSymbol(g_ddtree_phases, zero, sizeof zero));
      Check(launch(s));
      CHECK(cudaStreamSynchronize(s));
      CHECK(cudaMemcpyFromSymbol(marks[r], g_ddtree_phases, sizeof zero));
    }
    const char* names[] = {"part", "wait", "merge", "to expansion", "expansion", "outputs", "total"};
    for (int p = 0; p < 7; ++p) {
      std::vector<long long> d;
      for (int r = 0; r < kRuns; ++r) d.push_back(p < 6 ? marks[r][p + 1] - marks[r][p] : marks[r][6] - marks[r][0]);
      std::sort(d.begin(), d.end());
      std::printf(" | %s %lld", names[p], d[kRuns / 2]);
    }
  }
  std::printf("\n");
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaStreamDestroy(s));
}

int main() {
  std::mt19937 gen(7);
  std::normal_distribution<double> normal(0.0, 3.0);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::printf("# %s, SM clock %.2f GHz; cycles are block 0's clock64\n\n", prop.name, clock_khz / 1e6);

  long long* cycles;
  int* size;
  double* lp;
  CHECK(cudaMalloc(&cycles, 64 * sizeof(long long)));
  CHECK(cudaMalloc(&size, sizeof(int)));
  CHECK(cudaMalloc(&lp, kClusterRows * kFusedK * sizeof(double)));

  std::printf("## 1. the expansion alone (7 depths): cycles for n nodes, median of 15 runs\n\n| k | n | cycles | cycles a pop |\n|---:|---:|---:|---:|\n");
  for (int k : {7, 32}) {
    std::vector<double> h(kClusterRows * kFusedK);
    for (int d = 0; d < 7; ++d) {
      std::vector<double> row(k);
      for (auto& x : row) x = -std::abs(normal(gen)) - 0.1;
      std::sort(row.rbegin(), row.rend());
      for (int i = 0; i < k; ++i) h[d * k + i] = row[i];
    }
    CHECK(cudaMemcpy(lp, h.data(), h.size() * sizeof(double), cudaMemcpyHostToDevice));
    for (int n : {1, 2, 4, 8, 17, 33}) {
      if (n - 1 > 7 * k) continue;
      ExpandAlone<<<1, 32>>>(lp, 7, k, n, 16, cycles, size);
      CHECK(cudaGetLastError());
      std::vector<long long> c(16);
      CHECK(cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
      std::sort(c.begin() + 1, c.end());  // the first run warms the instruction cache
      std::printf("| %d | %d | %lld | %.0f |\n", k, n, c[8], n > 1 ? static_cast<double>(c[8]) / (n - 1) : 0.0);
    }
  }

  float* x;
  float* values;
  int32_t* tokens;
  CHECK(cudaMalloc(&x, kClusterRows * 8192 * sizeof(float)));
  CHECK(cudaMalloc(&values, kFusedK * sizeof(float)));
  CHECK(cudaMalloc(&tokens, kFusedK * sizeof(int32_t)));
  // a DFlash drafter's rows (N(0, 3)) and an ngram drafter's as bench.ts makes them (-1e4 but two
  // continuations a depth, both in the first half of the row)
  auto rows = [&](bool ngram) {
    std::vector<float> h(kClusterRows * 8192);
    for (size_t i = 0; i < h.size(); ++i) h[i] = ngram ? -1e4f : static_cast<float>(normal(gen));
    if (ngram) {
      for (int d = 0; d < kClusterRows; ++d) {
        h[d * 8192 + 17 + 31 * d] = std::log(0.75f);
        h[d * 8192 + 4000 + d] = std::log(0.25f);
      }
    }
    CHECK(cudaMemcpy(x, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  };

  std::printf("\n## 2. one part's pass alone (a block of 1024 threads): cycles, median of runs 2-4\n\n| rows | values | k | cycles |\n|---|---:|---:|---:|\n");
  for (bool ngram : {false, true}) {
    rows(ngram);
    for (int k : {1, 7, 32}) {
      for (int cols : {4096, 8192}) {
        if (cols <= 4096) PartAlone<4><<<1, 1024>>>(x, cols, k, cycles, values, tokens);
        else PartAlone<8><<<1, 1024>>>(x, cols, k, cycles, values, tokens);
        CHECK(cudaGetLastError());
        long long c[4];
        CHECK(cudaMemcpy(c, cycles, sizeof c, cudaMemcpyDeviceToHost));
        std::sort(c + 1, c + 4);
        std::printf("| %s | %d | %d | %lld |\n", ngram ? "ngram" : "DFlash", cols, k, c[2]);
      }
    }
  }

  int32_t *out_tokens, *parents, *depths, *positions, *out_size;
  uint8_t* mask;
  float* log_probs;
  int* dummy;
  int32_t *root_on_device, *start_on_device;  // as a step leaves them (the engine's DDTree step)
  const int32_t root = 1, start = 100;
  CHECK(cudaMalloc(&root_on_device, sizeof(int32_t)));
  CHECK(cudaMalloc(&start_on_device, sizeof(int32_t)));
  CHECK(cudaMemcpy(root_on_device, &root, sizeof root, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(start_on_device, &start, sizeof start, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&out_tokens, kMaxNodes * sizeof(int32_t)));
  CHECK(cudaMalloc(&parents, kMaxNodes * sizeof(int32_t)));
  CHECK(cudaMalloc(&depths, kMaxNodes * sizeof(int32_t)));
  CHECK(cudaMalloc(&positions, kMaxNodes * sizeof(int32_t)));
  CHECK(cudaMalloc(&out_size, sizeof(int32_t)));
  CHECK(cudaMalloc(&mask, kMaxNodes * kMaxNodes));
  CHECK(cudaMalloc(&log_probs, kMaxNodes * sizeof(float)));
  CHECK(cudaMalloc(&dummy, sizeof(int)));
  std::printf("\n## 3. the cluster build of [7, 8192], root and start read on the device (us a launch in a graph; block 0's cycles a phase)\n\n");
  if (!ClusterOfHalvesFits(7)) {
    std::fprintf(stderr, "this device holds no cluster of 14 blocks: the build runs a row a block here\n");
    return 1;
  }
  for (bool ngram : {false, true}) {
    rows(ngram);
    for (int budget : {1, 7, 32}) {
      const auto run = [&](auto kernel, int blocks, const char* form) {
        char what[96];
        std::snprintf(what, sizeof what, "%s B %d, %s (%d blocks)", ngram ? "ngram" : "DFlash", budget, form, blocks);
        Time(what, true, [&](cudaStream_t s) {
          return LaunchPdlCluster("ddtree build (cluster)", kernel, dim3(blocks), dim3(1024), 0, s, blocks, static_cast<const float*>(x), 7, int64_t{8192}, budget, 0, budget,
                                  int64_t{0}, static_cast<const int32_t*>(root_on_device),
                               static_cast<const int32_t*>(start_on_device), out_tokens, parents, depths, positions, mask, out_size, log_probs);
        });
      };
      run(ClusterBuildKernel<4, 2>, 14, "a row over two blocks");
      run(ClusterBuildKernel<8, 1>, 7, "a row a block");
    }
  }
  std::printf("\n## 4. the floor: an empty cluster\n\n");
  CHECK(cudaFuncSetAttribute(EmptyKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  for (const int blocks : {14, 7}) {
    char what[64];
    std::snprintf(what, sizeof what, "%d blocks of 1024 threads", blocks);
    Time(what, false, [&](cudaStream_t s) { return LaunchPdlCluster("empty cluster", EmptyKernel, dim3(blocks), dim3(1024), 0, s, blocks, dummy); });
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
