// The CPU twin of gemm (cuda/gemm.cu): y = x W^T with 16-bit (or f32) weights as stored.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "twins.h"

namespace kdtree {
namespace cpu {

// Each output is one f32 dot product in a fixed order (8 interleaved partial sums, K being a
// multiple of 8, added pairwise), whatever M is: batch-invariant like the CUDA kernel, though not
// its bits (a tensor core's sum of products is its own).
Status Gemm(const GemmArgs& a, ThreadPool& pool) {
  const int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.w.dim(0);
  const std::vector<float> x = LoadAll(a.x);
  pool.ParallelFor(n, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(k));
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t i = 0; i < k; ++i) w[i] = LoadF(a.w, row * k + i);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = &x[r * k];
        float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t i = 0; i < k; i += 8) {
          for (int j = 0; j < 8; ++j) s[j] = std::fma(xr[i + j], w[i + j], s[j]);
        }
        StoreF(a.y, r * n + row, ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
      }
    }
  }, std::max<int64_t>(1, 4096 / k));  // rows per chunk: ~4K weights at least (K > 0 is validated)
  return Status::Ok();
}

}  // namespace cpu
}  // namespace kdtree
